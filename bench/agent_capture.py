"""Capture what Codex CLI and Claude Code send on the wire, with their default settings, for bench/agent_prefill.py.

    .venv/bin/python bench/agent_capture.py            # writes bench/data/codex.json and bench/data/claude_code.json

Each agent runs one non-interactive task (``codex exec``, ``claude -p``) against ``octo serve test-model --engine
echo`` through a recording proxy, exactly as tests/test_codex_functional.py and tests/test_claude_code_functional.py
run them: the task holds a Hermes call of the agent's shell tool, the echo model repeats it, the agent runs the
command and sends its output back, and the echo model's answer (that output) ends the task. So two requests go over
the wire: the first turn (system prompt, tools, the task) and the second (the same, then the assistant's tool call
and its result): an agent loop's first and next turn.

The requests are kept as sent (their system prompts, tools and every field), sanitized: the run's temporary folders
become ``/home/user/project`` and ``/home/user``, session and user identifiers become fixed strings. The agents come
from ``.cache/npm`` (scripts/system-deps.sh installs the pinned versions); ``--codex``/``--claude`` pick others.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp import REPO, free_port, server  # noqa: E402

DATA = REPO / "bench" / "data"
NPM = REPO / ".cache" / "npm"
MARK = "octo-was-here"
TASK = "Write the marker into out.txt with the shell, then tell me what the command printed."
CODEX_CALL = {"name": "exec_command", "arguments": {"cmd": f"echo {MARK} | tee out.txt"}}
CLAUDE_CALL = {"name": "Bash", "arguments": {"command": f"echo {MARK} | tee out.txt", "description": "Write a file"}}
CODEX_CONFIG = """\
model = "test-model"
model_provider = "octo"

[model_providers.octo]
name = "octo"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
"""
DEVICE = re.compile(r'(device_id\\*":\\*)"[0-9a-f]{64}')
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


class Recorder(http.server.BaseHTTPRequestHandler):
    """Forwards each POST to octo and records its path, headers' names and JSON body."""

    upstream = ""
    seen: list[dict] = []
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        req = urllib.request.Request(self.upstream + self.path, data=raw, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, data, kind = r.status, r.read(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            status, data, kind = e.code, e.read(), e.headers.get("content-type", "")
        body = json.loads(raw) if raw.strip().startswith(b"{") else None
        self.seen.append({"path": self.path, "status": status, "body": body,
                          "headers": sorted(k.lower() for k in headers)})
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        req = urllib.request.Request(self.upstream + self.path, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, data, kind = r.status, r.read(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            status, data, kind = e.code, e.read(), e.headers.get("content-type", "")
        self.seen.append({"path": self.path, "status": status, "body": None, "method": "GET"})
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def recording(upstream: str):
    handler = type("Rec", (Recorder,), {"upstream": upstream, "seen": []})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", handler.seen
    finally:
        proxy.shutdown()
        proxy.server_close()


def hermes(call: dict) -> str:
    return f"{TASK}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def run_codex(codex: list[str], url: str, home: Path, work: Path) -> subprocess.CompletedProcess:
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.replace("http://127.0.0.1:{port}", url))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY")}
    env.update({"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "NO_COLOR": "1"})
    cmd = [*codex, "exec", "--strict-config", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json",
           "-C", str(work), hermes(CODEX_CALL)]
    return subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)


def run_claude(claude: str, url: str, home: Path, work: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update({"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "IS_SANDBOX": "1",
                "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy", "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"})
    cmd = [claude, "-p", hermes(CLAUDE_CALL), "--model", "test-model", "--dangerously-skip-permissions",
           "--output-format", "json"]
    return subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)


def sanitize(obj, folders: dict[str, str]):
    """``obj`` with the run's folders replaced, identifiers fixed (uuids, user ids, cache keys)."""
    text = json.dumps(obj)
    for real, fake in sorted(folders.items(), key=lambda kv: -len(kv[0])):
        # a path, not a tag's name (``</root>`` stays) nor a longer name's start
        text = re.sub(rf"(?<![<\w]){re.escape(real)}(?![\w.-])", fake, text)
        text = text.replace(re.sub(r"[^A-Za-z0-9]", "-", real), fake.replace("/", "-"))  # ~/.claude/projects/
    text = UUID.sub("00000000-0000-4000-8000-000000000000", text)
    text = DEVICE.sub(r'\1"' + "0" * 64, text)  # Claude Code's device id (metadata.user_id)
    return json.loads(text)


def version(cmd: list[str]) -> str:
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"\d+\.\d+\.\d+", out)
    return found.group(0) if found else "unknown"


def capture(name: str, run, cmd: list[str], base: str, tmp: Path) -> dict:
    home, work = tmp / f"{name}-home", tmp / f"{name}-work"
    home.mkdir()
    work.mkdir()
    with recording(base) as (url, seen):
        proc = run(url, home, work)
    if proc.returncode != 0 or (work / "out.txt").read_text(errors="replace").strip() != MARK:
        raise RuntimeError(f"{name} failed: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    turns = [r for r in seen if r["body"] and r["path"].split("?")[0] in ("/v1/responses", "/v1/messages")]
    if len(turns) != 2 or any(r["status"] != 200 for r in turns):
        raise RuntimeError(f"{name}: expected two answered turns, got {[(r['path'], r['status']) for r in seen]}")
    folders = {str(work.resolve()): "/home/user/project", str(work): "/home/user/project",
               str(home.resolve()): "/home/user", str(home): "/home/user", str(tmp): "/tmp",
               str(REPO): "/home/user/src"}
    return sanitize({"client": name, "version": version(cmd), "path": turns[0]["path"],
                     "other_requests": [f"{r.get('method', 'POST')} {r['path']} {r['status']}" for r in seen
                                        if r not in turns],
                     "headers": turns[0]["headers"], "turns": [r["body"] for r in turns]}, folders)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codex", default=str(NPM / "bin" / "codex"))
    ap.add_argument("--claude", default=str(NPM / "bin" / "claude"))
    ap.add_argument("--only", choices=["codex", "claude_code"], default=None)
    args = ap.parse_args()
    if shutil.which("node") is None:
        sys.exit("node is not in PATH")
    DATA.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", "test-model", "--engine", "echo", "-o", "n_ctx=65536",
           "--port", str(port)]
    agents = {"codex": (lambda url, h, w: run_codex([args.codex], url, h, w), [args.codex]),
              "claude_code": (lambda url, h, w: run_claude(args.claude, url, h, w), [args.claude])}
    with server(cmd, port, "/health", "octo-echo") as base, tempfile.TemporaryDirectory() as tmp:
        for name, (run, agent_cmd) in agents.items():
            if args.only and name != args.only:
                continue
            data = capture(name, run, agent_cmd, base, Path(tmp).resolve())
            out = DATA / f"{name}.json"
            out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            sizes = [len(json.dumps(t)) for t in data["turns"]]
            print(f"{name} {data['version']}: {out.relative_to(REPO)}, turns of {sizes} bytes; "
                  f"other requests: {data['other_requests']}")


if __name__ == "__main__":
    main()
