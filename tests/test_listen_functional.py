"""``octo serve``'s port: taken before anything loads, a 503 while it loads, and a clear error when in use.

Real ``octo serve`` processes. A Ray head (``--cluster ray``) starts services on free ports while it starts; before
the port was taken first, one of them once took the port a test had chosen, and answered its health check.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from serverproc import REPO, free_port

PLUGINS = str(REPO / "tests" / "plugins")


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "octo.cli", "serve", *args], cwd=REPO, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _get(port: int, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def test_a_port_in_use_is_a_clear_error_at_once_not_after_the_load():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        # a model that would take a minute to load: the error comes before it
        proc = _serve("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=60", "--port", str(port))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and time.monotonic() - started < 20
    assert f"127.0.0.1:{port} is already in use" in err and "--port" in err
    assert "Traceback" not in err


def test_a_port_in_use_fails_before_anything_starts_or_loads():
    """The port is taken before the engine worker starts and before the model's load: the only output is the error
    (no "loading" line, as when the load started first and the port came after it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = _serve("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=60", "--port", str(port),
                      "--log-level", "debug")
        out, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 1 and time.monotonic() - started < 10, err
    assert lines == [f"Error: cannot serve: 127.0.0.1:{port} is already in use (another server on that port? "
                     "choose another with --port)"], err


def test_while_loading_every_route_is_a_503_in_its_api_shape_then_the_same_port_serves():
    port = free_port()
    proc = _serve("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=12", "--port", str(port))
    try:
        deadline = time.monotonic() + 30
        while True:  # the port answers (a 503) long before the load ends
            try:
                status, headers, body = _get(port, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert status == 503 and body["status"] == "loading" and headers["Retry-After"] == "5"
        assert body["models"] == [{"id": "m", "state": "loading"}]
        page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Accept": "text/html"})
        try:
            urllib.request.urlopen(page, timeout=10)
            raise AssertionError("the dashboard answered before the server was up")
        except urllib.error.HTTPError as e:  # a page that reloads itself, not a JSON error, for a browser
            assert e.code == 503 and e.headers["Content-Type"].startswith("text/html")
            assert b"http-equiv=refresh" in e.read()
        chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
        status, headers, body = _get(port, "/v1/chat/completions", chat)
        assert status == 503 and headers["Retry-After"] == "5"
        assert body["error"]["code"] == "server_starting" and "starting" in body["error"]["message"]
        status, _, body = _get(port, "/v1/messages", {"model": "m", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and body["type"] == "error" and body["error"]["type"] == "overloaded_error"
        assert _get(port, "/v1/models")[0] == 503
        ps = subprocess.run([sys.executable, "-m", "octo.cli", "ps", "--port", str(port)], cwd=REPO,
                            capture_output=True, text=True)
        assert ps.returncode == 1
        assert f"octo at http://127.0.0.1:{port} answered 503: The server is starting" in ps.stderr
        while (status := _get(port, "/health")[0]) == 503:  # then the API, on the same port
            assert time.monotonic() < deadline + 30 and proc.poll() is None
            time.sleep(0.1)
        assert status == 200
        status, _, body = _get(port, "/v1/chat/completions", chat)
        assert status == 200 and body["choices"][0]["message"]["content"]
    finally:
        _stop(proc)


def test_a_model_that_fails_to_load_ends_the_process_with_its_reason():
    port = free_port()
    proc = _serve("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "info=bad", "--port", str(port))
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise AssertionError("octo serve kept running after its only model failed to load") from None
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    with socket.socket() as s:  # and the port is free again
        s.bind(("127.0.0.1", port))


def test_a_port_out_of_range_is_a_usage_error():
    proc = _serve("echo-m", "--engine", "echo", "--port", "70000")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "70000 is not in the range 0<=x<=65535" in err and "Traceback" not in err


def test_an_ipv6_address_is_served_and_printed_in_brackets():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    proc = _serve("echo-m", "--engine", "echo", "--host", "::1", "--port", "0")
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "octo serve never said where it serves"
            line = proc.stderr.readline()
        url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        assert url.startswith("http://[::1]:")  # a URL a browser or client can use, not http://::1:PORT
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        _stop(proc)


def test_every_address_of_a_host_on_one_port_and_a_clear_error_for_none():
    from octo.server import listen

    socks = listen.open_sockets(None, 0)  # every interface: 0.0.0.0, and :: where the host has IPv6
    try:
        assert socks and len({s.getsockname()[1] for s in socks}) == 1
    finally:
        for s in socks:
            s.close()
    with pytest.raises(OSError, match="cannot listen on any address of --host 192.0.2.1"):  # not this host's
        listen.open_sockets("192.0.2.1", 0)


def test_the_openai_sdk_waits_out_the_load_by_its_own_retries():
    """A client that starts with the server: the SDK retries the 503 after its Retry-After and gets its answer."""
    import openai

    port = free_port()
    proc = _serve("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=8", "--port", str(port))
    try:
        deadline = time.monotonic() + 30
        while True:  # the port answers before the load ends
            try:
                assert _get(port, "/health")[0] == 503
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=6, timeout=30)
        started = time.monotonic()
        reply = client.chat.completions.create(model="m", max_tokens=4,
                                               messages=[{"role": "user", "content": "hello there"}])
        assert reply.choices[0].message.content and time.monotonic() - started > 2  # it waited for the load
    finally:
        _stop(proc)
