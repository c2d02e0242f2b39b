"""Web pages against a local `octo serve` in a real headless Chromium (Debian's, driven by Playwright as in
test_dashboard_browser.py): a page of another origin (a second local HTTP server on another port) can neither chat,
load, unload, store nor read anything, with CORS requests or with the no-cors tricks that need no preflight (Blob
bodies without a type, text/plain, form data, body-less POSTs); a page of an origin named in --cors-origins can
(the control: the same page and requests work when allowed); a page reached through a rebound name (Chromium's
resolver maps it to 127.0.0.1, as DNS rebinding would) gets 403 even from its own origin."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from serverproc import run_octo

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REBOUND = "rebind.octo-test.example"
SERVED = re.compile(r'octo_requests_total\{endpoint="/v1/(chat/completions|responses)",status="200"\} (\S+)')

ATTACKS = r"""
async ([base, gguf]) => {
  const chat = JSON.stringify({model: "test-model", max_tokens: 4, messages: [{role: "user", content: "pwned"}]});
  const store = JSON.stringify({model: "test-model", input: "stored by a page", store: true});
  const tries = {
    "cors-json-chat": () => fetch(base + "/v1/chat/completions",
        {method: "POST", headers: {"Content-Type": "application/json"}, body: chat}),
    "no-cors-blob-chat": () => fetch(base + "/v1/chat/completions", {method: "POST", mode: "no-cors",
        body: new Blob([chat])}),
    "no-cors-typed-blob-chat": () => fetch(base + "/v1/chat/completions", {method: "POST", mode: "no-cors",
        body: new Blob([chat], {type: "application/json"})}),
    "no-cors-text-chat": () => fetch(base + "/v1/chat/completions", {method: "POST", mode: "no-cors", body: chat}),
    "no-cors-load": () => fetch(base + "/v1/models/" + encodeURIComponent(gguf) + "/load",
        {method: "POST", mode: "no-cors"}),
    "no-cors-unload": () => fetch(base + "/v1/models/test-model/unload", {method: "POST", mode: "no-cors"}),
    "no-cors-store": () => fetch(base + "/v1/responses", {method: "POST", mode: "no-cors", body: new Blob([store])}),
    "no-cors-form-audio": () => { const f = new FormData(); f.append("model", "test-model");
        f.append("file", new Blob(["RIFF"]), "a.wav");
        return fetch(base + "/v1/audio/transcriptions", {method: "POST", mode: "no-cors", body: f}); },
    "cors-read-models": () => fetch(base + "/v1/models"),
    "no-cors-read-models": () => fetch(base + "/v1/models", {mode: "no-cors"}),
  };
  const out = {};
  for (const [name, go] of Object.entries(tries)) {
    try {
      const r = await go();
      out[name] = {status: r.status, type: r.type, body: r.type === "opaque" ? "" : await r.text()};
    } catch (e) {
      out[name] = {error: String(e)};
    }
  }
  return out;
}
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<!doctype html><title>another origin</title><p>a page of another origin"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def origins():
    """Two pages of other origins (local HTTP servers on other ports): an attacker's and a friend's."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
    for srv in servers:
        srv.shutdown()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs Debian's chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                                                 f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(origins, tmp_path_factory):
    from octo.synth.gguf import build_gguf

    models = tmp_path_factory.mktemp("servable")
    shutil.copy(build_gguf("tiny", ftype="q8_0"), models / "tiny-q8_0.gguf")
    with run_octo("test-model", "--engine", "echo", "--models-dir", str(models), "--cors-origins", origins[1]) as s:
        s.gguf = str(Path(os.path.realpath(models)) / "tiny-q8_0.gguf")
        yield s


def _attack(browser, page_url: str, base: str, gguf: str) -> dict:
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(page_url)
        return page.evaluate(ATTACKS, [base, gguf])
    finally:
        ctx.close()


def _metrics(server) -> str:
    return urllib.request.urlopen(server.url("/metrics"), timeout=30).read().decode()


def test_a_page_of_another_origin_can_do_nothing(browser, server, origins):
    before = _metrics(server)
    got = _attack(browser, origins[0] + "/", server.base_url, server.gguf)
    # CORS requests fail in the browser (the preflight / the response carry no Access-Control-Allow-Origin)
    assert "error" in got["cors-json-chat"] and "error" in got["cors-read-models"], got
    # no-cors requests go out unasked and come back opaque: the server refused each before doing anything
    for name in ("no-cors-blob-chat", "no-cors-typed-blob-chat", "no-cors-text-chat", "no-cors-load",
                 "no-cors-unload", "no-cors-store", "no-cors-form-audio", "no-cors-read-models"):
        assert got[name].get("type") == "opaque" and got[name]["body"] == "", (name, got[name])
    log = server.log()
    refused = re.findall(r"refused (\w+) (\S+): 403 origin_not_allowed", log)
    assert {p for _, p in refused} >= {"/v1/chat/completions", "/v1/responses", "/v1/models/test-model/unload",
                                       "/v1/audio/transcriptions", "/v1/models"}, refused
    assert any(p.endswith("/load") for _, p in refused), refused
    states = {m["id"]: m["state"] for m in server.get_json("/v1/models")["data"]}
    assert states["test-model"] == "ready" and server.gguf not in states  # nothing loaded, nothing unloaded
    after = _metrics(server)
    assert SERVED.findall(after) == SERVED.findall(before)  # no chat ran, nothing was stored
    assert "pwned" not in log and "stored by a page" not in log


def test_a_page_named_in_cors_origins_can_chat_and_read(browser, server, origins):
    """The control: the same requests from an allowed origin work (so the refusals above are the server's)."""
    got = _attack(browser, origins[1] + "/", server.base_url, server.gguf)
    assert got["cors-json-chat"]["status"] == 200, got["cors-json-chat"]
    assert json.loads(got["cors-json-chat"]["body"])["choices"][0]["message"]["content"]
    assert got["cors-read-models"]["status"] == 200 and "test-model" in got["cors-read-models"]["body"]
    assert SERVED.findall(_metrics(server))  # (the counter the first test compares does count chats)


def test_a_rebound_name_is_refused_even_from_its_own_origin(browser, server):
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        first = page.goto(f"http://{REBOUND}:{server.port}/")
        assert first.status == 403
        got = page.evaluate("""async () => {
          const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
            body: JSON.stringify({model: "test-model", messages: [{role: "user", content: "rebound"}]})});
          const m = await fetch("/v1/models");
          return [r.status, await r.json(), m.status];
        }""")
    finally:
        ctx.close()
    assert got[0] == 403 and got[1]["error"]["code"] == "host_not_allowed" and got[2] == 403, got
