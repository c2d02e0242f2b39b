"""Run the real Open WebUI against `octo serve demo` in headless Chromium, as a new user would, and write a JSON result.

    .venv/bin/python scripts/openwebui_check.py [--venv DIR] [--out DIR]

It installs Open WebUI (PyPI ``open-webui``, ``--version``) into its own virtual environment ``--venv`` when that has
none (about 3 GB; it never goes into octo's .venv), starts `octo serve demo` on a free loopback port, then Open WebUI
twice with a fresh data folder each: through its Ollama connection (``OLLAMA_BASE_URL``) and through its OpenAI
connection (``OPENAI_API_BASE_URL``, key ``none``), default settings otherwise. For each, Playwright drives Chromium:
the page opens, the demo is picked in the model selector, a first message and a second turn are sent; a reply must
appear (text, not an error) and its chat record must hold no error; the random model does not end by itself, so after
``--answer-seconds`` the Stop button ends the answer as a user would. Admin Settings > Connections > Verify
Connection must succeed. A logging proxy between Open WebUI and octo records every request (method, path, status,
time; bodies of failed ones); screenshots are taken after every step.

Loopback only: Open WebUI runs with OFFLINE_MODE and its telemetry and update checks off; the browser aborts and
records any request to a non-loopback address; with ``strace`` installed, octo's and Open WebUI's processes run under
it and every connect/sendto to a non-loopback address (DNS lookups included, with the name looked up) fails the
``loopback_only`` step. The result (``result.json`` in ``--out``): pass/fail per step, versions, timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
OFFLINE_ENV = {  # Open WebUI offline and quiet: no hub, no update check, no telemetry
    "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "false",
    "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false", "ENABLE_OTEL": "false",
    "RAG_EMBEDDING_ENGINE": "ollama", "WEBUI_AUTH": "False",
}
MESSAGES = ["Hello, who are you?", "Tell me more about the harbor."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f} s")


class Result:
    """Steps (pass/fail, seconds, detail), versions and everything else ``result.json`` holds."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": [], "versions": {}}

    @contextlib.contextmanager
    def step(self, name: str, connection: str | None = None):
        rec = {"step": name, "connection": connection, "ok": False, "seconds": None, "detail": ""}
        self.data["steps"].append(rec)
        t0 = time.monotonic()
        try:
            yield rec
            rec["ok"] = True
        except Exception as e:  # noqa: BLE001 - a failed step is recorded, the run goes on
            rec["detail"] = (rec["detail"] + "; " if rec["detail"] else "") + f"{type(e).__name__}: {e}"[:2000]
        finally:
            rec["seconds"] = round(time.monotonic() - t0, 2)
            print(f"{'PASS' if rec['ok'] else 'FAIL'} {connection or '-':7s} {name} ({rec['seconds']} s) "
                  f"{rec['detail'][:300]}", flush=True)

    def write(self) -> bool:
        self.data["ok"] = all(s["ok"] for s in self.data["steps"])
        (self.out / "result.json").write_text(json.dumps(self.data, indent=1) + "\n")
        return self.data["ok"]


# -- processes -------------------------------------------------------------------------------------------------
def traced(cmd: list[str], log: Path | None) -> list[str]:
    """``cmd`` under strace (connect and sendto of every thread and child) when a log is given."""
    if log is None:
        return cmd
    return ["strace", "-f", "-s", "256", "--seccomp-bpf", "-e", "trace=connect,sendto,sendmsg", "-o", str(log), *cmd]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command (under strace: to strace's child, the command itself), then SIGKILL after 20 s."""
    if proc.poll() is None:
        targets = children(proc.pid) if proc.args[0] == "strace" else []
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
        if not targets:
            proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ensure_openwebui(venv: Path, version: str, python: str, result: Result) -> Path:
    exe = venv / "bin" / "open-webui"
    if exe.exists():
        return exe
    with result.step("install_openwebui") as rec:
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"open-webui=={version}"], check=True)
        rec["detail"] = f"open-webui=={version} into {venv}"
    if not exe.exists():
        raise SystemExit(f"Open WebUI is not installed in {venv}")
    return exe


def start_octo(out: Path, strace_dir: Path | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = (out / "octo.log").open("wb")
    cmd = traced([sys.executable, "-m", "octo.cli", "serve", "demo", "--port", str(port)],
                 strace_dir / "octo.strace" if strace_dir else None)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    wait_http(f"http://127.0.0.1:{port}/health", 900, proc)
    return proc, port


def start_openwebui(exe: Path, connection: str, upstream: str, out: Path, strace_dir: Path | None):
    port = free_port()
    data = out / f"data-{connection}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = {**os.environ, **OFFLINE_ENV, "DATA_DIR": str(data), "WEBUI_SECRET_KEY": os.urandom(24).hex()}
    if connection == "ollama":
        env.update(ENABLE_OLLAMA_API="True", OLLAMA_BASE_URL=upstream, ENABLE_OPENAI_API="False")
    else:
        env.update(ENABLE_OLLAMA_API="False", ENABLE_OPENAI_API="True", OPENAI_API_BASE_URL=upstream + "/v1",
                   OPENAI_API_KEY="none")
    log = (out / f"openwebui-{connection}.log").open("wb")
    cmd = traced([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)],
                 strace_dir / f"openwebui-{connection}.strace" if strace_dir else None)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=data, env=env)
    wait_http(f"http://127.0.0.1:{port}/health", 600, proc)
    return proc, port


# -- the logging proxy between Open WebUI and octo ------------------------------------------------------------
class Proxy:
    """A reverse proxy on a loopback port in its own thread: every exchange is recorded (bodies of failures)."""

    HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}

    def __init__(self, upstream: str) -> None:
        self.upstream, self.port, self.records, self.label = upstream, free_port(), [], ""
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(30)

    def _run(self) -> None:
        import asyncio

        from aiohttp import web

        async def main() -> None:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())

    async def _handle(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        rec = {"connection": self.label, "method": request.method, "path": request.path_qs, "t": time.time(),
               "request_bytes": len(body)}
        self.records.append(rec)
        chunks: list[bytes] = []
        out = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s, s.request(
                    request.method, self.upstream + request.path_qs, data=body or None, headers=headers,
                    auto_decompress=False) as r:
                rec["status"] = r.status
                out = web.StreamResponse(status=r.status, headers={k: v for k, v in r.headers.items()
                                                                   if k.lower() not in self.HOP})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    chunks.append(chunk)
                    await out.write(chunk)
                await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientError) as e:
            if isinstance(e, (ConnectionResetError, aiohttp.ClientConnectionResetError)) and "status" in rec:
                rec["hung_up"] = "Open WebUI"  # the Stop button: Open WebUI closed the stream
            else:
                rec["error"] = repr(e)
                rec.setdefault("status", 502)
        finally:
            rec["seconds"] = round(time.time() - rec["t"], 2)
            rec["response_bytes"] = sum(map(len, chunks))
            if rec.get("status", 0) >= 400:
                rec["request_body"] = body[:4000].decode("utf-8", "replace")
                rec["response_body"] = b"".join(chunks)[:4000].decode("utf-8", "replace")
        return out if out is not None else web.Response(status=502, text=rec.get("error", ""))


# -- the browser ---------------------------------------------------------------------------------------------------
class Browser:
    """Headless Chromium through Playwright; a request to any non-loopback address is aborted and recorded."""

    def __init__(self, chromium: str, out: Path) -> None:
        from playwright.sync_api import sync_playwright

        self.out, self.blocked = out, []
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        self.version = self.browser.version

    def page(self, base: str):
        from urllib.parse import urlparse

        def guard(route) -> None:
            url = route.request.url
            if url.startswith(("data:", "blob:")) or urlparse(url).hostname in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                self.blocked.append(url)
                route.abort()

        page = self.browser.new_page(viewport={"width": 1280, "height": 900})
        page.route("**/*", guard)
        page.goto(base + "/", wait_until="load")
        page.wait_for_selector("#chat-input", timeout=120_000)
        page.wait_for_timeout(2000)
        whats_new = page.get_by_text("Okay, Let's Go!")  # the release notes a first visit shows
        if whats_new.count():
            whats_new.first.click()
        return page

    def shot(self, page, name: str) -> str:
        path = self.out / f"{name}.png"
        page.screenshot(path=str(path))
        return path.name

    def close(self) -> None:
        self.browser.close()
        self.pw.stop()


def pick_model(page, model: str) -> None:
    page.locator("#model-selector-model-button").click()
    page.wait_for_timeout(1000)
    page.get_by_role("button").filter(has_text=re.compile(rf"^\s*{re.escape(model)}\s*$")).first.click()
    page.wait_for_timeout(500)
    shown = page.locator("#model-selector-model-button").inner_text().strip()
    if shown != model:
        raise AssertionError(f"the model selector shows {shown!r}, not {model!r}")


def chat_record(page) -> dict:
    """The chat as Open WebUI stored it (its own API, the page's token)."""
    chat_id = page.url.rstrip("/").rsplit("/c/", 1)[-1]
    return page.evaluate("""async (id) => (await (await fetch('/api/v1/chats/' + id,
        {headers: {Authorization: 'Bearer ' + localStorage.token}})).json())""", chat_id)


def last_reply(page) -> tuple[str, str]:
    """(the text of the last answer, the error it shows), as the user sees them."""
    box = page.locator("#response-content-container").last
    if not box.count():
        return "", ""
    text = box.inner_text().strip()
    error = box.locator("div.rounded-2xl").filter(has=page.locator("svg")).all_inner_texts()
    return text, " ".join(e.strip() for e in error)


def send_turn(page, text: str, answer_seconds: float, rec: dict) -> None:
    """Send ``text``; a reply must show text; Stop ends it after ``answer_seconds`` if the model has not."""
    before = page.locator("#response-content-container").count()
    box = page.locator("#chat-input")
    box.click()
    box.type(text)
    page.keyboard.press("Enter")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        page.wait_for_timeout(500)
        if page.locator("#response-content-container").count() > before:
            reply, error = last_reply(page)
            if error:
                raise AssertionError(f"the reply is an error: {error}")
            if reply:
                break
    else:
        raise TimeoutError("no reply text in 600 s")
    rec["first_text_seconds"] = round(time.monotonic() - t0, 2)
    stopped = False
    while page.locator("button[aria-label='Stop']").count():
        if time.monotonic() - t0 > rec["first_text_seconds"] + answer_seconds:
            page.locator("button[aria-label='Stop']").first.click()
            stopped = True
            break
        page.wait_for_timeout(500)
    page.wait_for_timeout(3000)
    rec["stopped_by_user"] = stopped
    reply, error = last_reply(page)
    if error or not reply:
        raise AssertionError(f"after the answer: text {reply[:80]!r}, error {error!r}")
    rec["reply_chars"] = len(reply)


def check_record(page, turns: int) -> None:
    chat = chat_record(page)["chat"]
    answers = [m for m in chat["history"]["messages"].values() if m["role"] == "assistant"]
    if len(answers) != turns:
        raise AssertionError(f"{len(answers)} answers stored, {turns} expected")
    for m in answers:
        if m.get("error") or not m.get("content"):
            raise AssertionError(f"stored answer: error {m.get('error')!r}, content {str(m.get('content'))[:80]!r}")


def verify_connection(page, base: str) -> None:
    page.goto(base + "/admin/settings/connections", wait_until="load")
    page.wait_for_selector("button[aria-label='Configure']", timeout=60_000)
    page.locator("button[aria-label='Configure']").first.click()
    page.locator("button[aria-label='Verify Connection']").click()
    page.get_by_text("Server connection verified").wait_for(timeout=60_000)


# -- a run -----------------------------------------------------------------------------------------------------
def run_connection(result: Result, browser: Browser, exe: Path, connection: str, proxy: Proxy, args) -> None:
    model = "demo:latest" if connection == "ollama" else "demo"
    proxy.label = connection
    strace_dir = args.out if args.strace else None
    proc = None
    with result.step("start_openwebui", connection) as rec:
        proc, port = start_openwebui(exe, connection, f"http://127.0.0.1:{proxy.port}", args.out, strace_dir)
        rec["detail"] = f"port {port}"
    if proc is None:
        return
    base = f"http://127.0.0.1:{port}"
    try:
        page = None
        with result.step("open_page_and_pick_model", connection) as rec:
            page = browser.page(base)
            pick_model(page, model)
            rec["screenshot"] = browser.shot(page, f"{connection}-0-model")
        for turn, text in enumerate(MESSAGES, 1):
            with result.step(f"turn_{turn}", connection) as rec:
                if page is None:
                    raise RuntimeError("no page")
                try:
                    send_turn(page, text, args.answer_seconds, rec)
                finally:
                    rec["screenshot"] = browser.shot(page, f"{connection}-{turn}-turn")
        with result.step("chat_record_holds_the_answers", connection):
            check_record(page, len(MESSAGES))
        with result.step("verify_connection", connection) as rec:
            try:
                verify_connection(page, base)
            finally:
                rec["screenshot"] = browser.shot(page, f"{connection}-3-verify")
        with result.step("octo_answers_ok", connection) as rec:
            mine = [r for r in proxy.records if r["connection"] == connection]
            failed = [r for r in mine if r.get("status", 0) >= 400]
            rec["detail"] = f"{len(mine)} requests to octo, {len(failed)} failed"
            if failed:
                raise AssertionError(json.dumps(failed)[:1500])
    finally:
        stop(proc)


def strace_audit(out: Path) -> list[dict]:
    """Every connect/sendto to an address that is not loopback in the strace logs, DNS questions decoded."""
    found: list[dict] = []
    addr = re.compile(r'(connect|sendto|sendmsg)\((\d+), .*?sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
                      r'(?:sin_addr=inet_addr\("([^"]+)"\)|sin6_addr=inet_pton\(AF_INET6, "([^"]+)"\))')
    for log in sorted(out.glob("*.strace")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = addr.search(line)
            if not m:
                continue
            ip = m.group(4) or m.group(5)
            if ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1", "0.0.0.0"):
                continue
            item = {"process": log.stem, "call": m.group(1), "address": ip, "port": int(m.group(3))}
            if item["port"] == 53:
                item["dns_question"] = dns_question(lines, i, m.group(2))
            if item not in found:
                found.append(item)
    return found


def dns_question(lines: list[str], i: int, fd: str) -> str:
    """The name in the DNS query the same thread sends on ``fd`` after its connect (strace's escaped payload)."""
    tid = lines[i].split()[0]
    for line in lines[i:i + 20]:
        m = re.match(rf'{tid}\s+send(?:to|msg)\({fd}, "(.*?)"', line)
        if m:
            raw = m.group(1).encode("latin-1").decode("unicode_escape").encode("latin-1")
            labels, pos = [], 12
            while pos < len(raw) and raw[pos]:
                labels.append(raw[pos + 1:pos + 1 + raw[pos]].decode("ascii", "replace"))
                pos += 1 + raw[pos]
            return ".".join(labels)
    return ""


def versions(exe: Path, browser: Browser | None) -> dict:
    from importlib.metadata import version

    owui = subprocess.run([str(exe.parent / "python"), "-c", "import importlib.metadata as m; "
                           "print(m.version('open-webui'))"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    return {"open_webui": owui, "octo": version("octo"), "octo_commit": commit + ("+dirty" if dirty else ""),
            "chromium": browser.version if browser else None, "playwright": version("playwright"),
            "python": platform.python_version(), "host": f"{platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".cache" / "openwebui" / "venv",
                    help="Open WebUI's own virtual environment (installed there when missing)")
    ap.add_argument("--version", default="0.12.4", help="the open-webui version to install")
    ap.add_argument("--python", default="python3.11", help="the interpreter for a new venv (Open WebUI: 3.11)")
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "openwebui" / "result")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--connections", default="ollama,openai")
    ap.add_argument("--answer-seconds", type=float, default=15.0,
                    help="how long an answer may run after its first text before the Stop button ends it")
    ap.add_argument("--no-strace", dest="strace", action="store_false", help="skip the strace network audit")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("*.strace"), *args.out.glob("*.png")]:
        old.unlink()
    args.strace = args.strace and shutil.which("strace") is not None
    result = Result(args.out)
    exe = ensure_openwebui(args.venv.resolve(), args.version, args.python, result)
    octo = browser = None
    try:
        with result.step("start_octo_serve_demo") as rec:
            octo, port = start_octo(args.out, args.out if args.strace else None)
            rec["detail"] = f"port {port}"
        with result.step("start_chromium"):
            browser = Browser(args.chromium, args.out)
        if octo is not None and browser is not None:
            proxy = Proxy(f"http://127.0.0.1:{port}")
            for connection in args.connections.split(","):
                run_connection(result, browser, exe, connection, proxy, args)
            result.data["octo_requests"] = proxy.records
    finally:
        if browser is not None:
            browser.close()
        if octo is not None:
            stop(octo)
        result.data["versions"] = versions(exe, browser)
    with result.step("loopback_only") as rec:
        leaks = strace_audit(args.out) if args.strace else []
        result.data["network"] = {"browser_blocked": browser.blocked if browser else None,
                                  "non_loopback": leaks, "strace_audit": args.strace}
        rec["detail"] = "strace audit" if args.strace else "browser only (strace not installed)"
        if leaks or (browser and browser.blocked):
            raise AssertionError(json.dumps({"processes": leaks, "browser": browser and browser.blocked})[:1500])
    ok = result.write()
    print(f"{'PASS' if ok else 'FAIL'}: {args.out / 'result.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
