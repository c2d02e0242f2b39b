"""Ollama's default CORS origins in a real headless Chromium (as tests/test_cross_origin_browser.py drives it): a
page served on 127.0.0.1 at another port (a local web app, such as one on http://localhost:3000) can chat and list
models on Ollama's routes, its JSON posts going through the browser's own preflight, with no --cors-origins; the
same page cannot use the OpenAI routes; a page of a non-local origin (a name Chromium maps to 127.0.0.1) can use
neither."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from serverproc import run_octo

CHROMIUM = "/usr/bin/chromium"
ELSEWHERE = "app.octo-test.example"  # not one of Ollama's origins; Chromium resolves it to 127.0.0.1

CALLS = r"""
async (base) => {
  const json = {"Content-Type": "application/json"};
  const tries = {
    "ollama-chat": () => fetch(base + "/api/chat", {method: "POST", headers: json, body: JSON.stringify(
        {model: "test-model", stream: false, messages: [{role: "user", content: "hello from a local app"}]})}),
    "ollama-tags": () => fetch(base + "/api/tags"),
    "openai-chat": () => fetch(base + "/v1/chat/completions", {method: "POST", headers: json, body: JSON.stringify(
        {model: "test-model", messages: [{role: "user", content: "not here"}]})}),
    "openai-models": () => fetch(base + "/v1/models"),
  };
  const out = {};
  for (const [name, go] of Object.entries(tries)) {
    try {
      const r = await go();
      out[name] = {status: r.status, body: await r.text()};
    } catch (e) {
      out[name] = {error: String(e)};
    }
  }
  return out;
}
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<!doctype html><title>a local app</title><p>a web app on this machine"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def page_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
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
                                                                 f"--host-resolver-rules=MAP {ELSEWHERE} 127.0.0.1"])
        yield b
        b.close()


def _calls(browser, page_url: str, base: str) -> dict:
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(page_url)
        return page.evaluate(CALLS, base)
    finally:
        ctx.close()


def test_a_local_app_can_use_ollamas_routes_only(browser, page_port):
    with run_octo("test-model", "--engine", "echo") as server:  # no --cors-origins
        got = _calls(browser, f"http://127.0.0.1:{page_port}/", server.base_url)
        assert got["ollama-chat"]["status"] == 200 and "hello from a local app" in got["ollama-chat"]["body"], got
        assert got["ollama-tags"]["status"] == 200 and "test-model:latest" in got["ollama-tags"]["body"], got
        assert "error" in got["openai-chat"] and "error" in got["openai-models"], got  # CORS refuses them
        other = _calls(browser, f"http://{ELSEWHERE}:{page_port}/", server.base_url)
        assert all("error" in r for r in other.values()), other
