"""The security boundary of a local server (docs/security.md) through a real `octo serve`: Host names (DNS rebinding),
Origin and content type (pages of other origins), what requests may load (--models-dir, --allow-any-path, never the
hub), the memory guard (model count, available memory, waiting for room, keep_alive caps), /health behind a key and
the log line of every refusal. The browser side (a real Chromium) is in test_cross_origin_browser.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from hub_standin import HubStandin, gguf_bytes
from serverproc import children, run_octo

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
M = [{"role": "user", "content": "hi"}]
KEY = "sec-key-123"


def raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict]:
    """(status, JSON body) of one request written by hand (the Host header is the point)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, payload = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(payload) if payload.strip() else {}


def post(server, path: str, body: dict | None, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else b""
    hdrs = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return raw(server.port, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n{hdrs}", data)


JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A --models-dir holding copies of two tiny GGUFs (copies: a symlink the operator puts there is servable
    too, and would make its target's own path servable through it)."""
    from octo.synth.gguf import build_gguf

    d = tmp_path_factory.mktemp("models")
    for ftype in ("q8_0", "f16", "f32"):
        shutil.copy(build_gguf("tiny", ftype=ftype), d / f"tiny-{ftype}.gguf")
    (d / "sub").mkdir()
    shutil.copy(build_gguf("tiny", ftype="q8_0"), d / "sub" / "nested.gguf")
    return Path(os.path.realpath(d))


@pytest.fixture(scope="module")
def hub():
    with HubStandin() as standin:
        standin.add_repo("org/Remote-GGUF", {"Remote-Q4_K_M.gguf": gguf_bytes()})
        yield standin


@pytest.fixture(scope="module")
def server(models_dir, hub, tmp_path_factory):
    # the hub stand-in is reachable and downloads are allowed: only octo's own rule keeps requests off it
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path_factory.mktemp("hf")), "HF_HUB_OFFLINE": ""}
    with run_octo("test-model", "--engine", "echo", "--models-dir", str(models_dir),
                  "--allowed-hosts", "octo.internal,*.lan", env=env) as s:
        yield s


# -- Host (DNS rebinding) --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:{port}", "localhost.evil.example",
                                  "127.0.0.1.nip.io:{port}", "octo.internal.evil", "lan", "10.0.0.1:{port}"])
def test_a_foreign_host_is_refused_in_the_api_shape(server, host):
    host = host.format(port=server.port)
    status, body = raw(server.port, f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n")
    assert status == 403 and body["error"]["code"] == "host_not_allowed" and body["error"]["type"] == "permission_error"
    status, body = raw(server.port, f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n",
                       json.dumps({"model": "test-model", "max_tokens": 4, "messages": M}).encode())
    assert status == 403 and body["type"] == "error" and body["error"]["type"] == "permission_error"
    status, _ = raw(server.port, f"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n")
    assert status == 403  # preflights too


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "LOCALHOST.", "app.localhost:{port}",
                                  "127.0.0.1:{port}", "127.8.9.10", "[::1]:{port}", "0.0.0.0:{port}", "{hostname}",
                                  "octo.internal:{port}", "box.lan"])
def test_local_names_and_allowed_hosts_are_served(server, host):
    host = host.format(port=server.port, hostname=socket.gethostname())
    status, body = raw(server.port, f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n")
    assert status == 200 and body["object"] == "list"


# -- content type and Origin -----------------------------------------------------------------------------------------
def test_json_routes_need_application_json_and_other_pages_are_refused(server):
    chat = {"model": "test-model", "messages": M, "max_tokens": 4}
    assert post(server, "/v1/chat/completions", chat, JSON)[0] == 200
    status, body = post(server, "/v1/chat/completions", chat)  # no Content-Type: a no-cors Blob post
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"
    assert post(server, "/v1/chat/completions", chat, {"Content-Type": "text/plain"})[0] == 415
    # a page of another origin: refused whatever it sends, before anything runs (loads, unloads, stores)
    evil = {"Origin": "http://127.0.0.1:1", **JSON}
    for path, body in [("/v1/chat/completions", chat), ("/v1/models/tiny-q8_0.gguf/load", None),
                       ("/v1/models/test-model/unload", None),
                       ("/v1/responses", {"model": "test-model", "input": "x", "store": True})]:
        status, got = post(server, path, body, evil)
        assert status == 403 and got["error"]["code"] == "origin_not_allowed", (path, got)
    status, _ = raw(server.port, f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nOrigin: null\r\n")
    assert status == 403
    states = {m["id"]: m["state"] for m in server.get_json("/v1/models")["data"]}
    assert states["test-model"] == "ready" and not any(k.endswith("tiny-q8_0.gguf") for k in states)
    # the server's own page (the dashboard) and tools without an Origin (curl) are served; a load needs no body
    own = {"Origin": f"http://127.0.0.1:{server.port}", **JSON}
    assert post(server, "/v1/chat/completions", chat, own)[0] == 200
    assert post(server, "/v1/models/test-model/load", None)[0] == 200


def test_cors_origins_let_a_named_page_in(models_dir):
    with run_octo("test-model", "--engine", "echo", "--cors-origins", "http://app.example:3000") as s:
        chat = {"model": "test-model", "messages": M, "max_tokens": 4}
        assert post(s, "/v1/chat/completions", chat, {"Origin": "http://app.example:3000", **JSON})[0] == 200
        assert post(s, "/v1/chat/completions", chat, {"Origin": "http://app.example:3001", **JSON})[0] == 403


# -- what a request may load -----------------------------------------------------------------------------------------
def _message(server, model: str) -> tuple[int, str, str]:
    status, body = post(server, "/v1/chat/completions", {"model": model, "messages": M, "max_tokens": 2}, JSON)
    err = body.get("error") or {}
    return status, err.get("code"), (err.get("message") or "").replace(model, "<M>")


def test_a_path_outside_the_models_dirs_reads_like_an_unknown_name(server, models_dir, tmp_path):
    outside = tmp_path / "tiny-q8_0.gguf"
    shutil.copy(models_dir / "tiny-q8_0.gguf", outside)  # a real model file, just not servable
    unknown = _message(server, "no-such-model-here")
    assert unknown[0] == 404 and unknown[1] == "model_not_found" and "octo models" in unknown[2]
    for model in [str(outside), "/etc/passwd", "/no/such/dir/m.gguf", "~root/m.gguf", "~/m.gguf",
                  f"{models_dir}/../{outside.parent.name}/tiny-q8_0.gguf", "../tiny-q8_0.gguf", "/proc/self/mem",
                  str(models_dir)[:-1] + "/tiny-q8_0.gguf"]:
        assert _message(server, model) == unknown, model
        status, body = post(server, f"/v1/models/{quote(model, safe='')}/load", None)
        assert status == 404 and body["error"]["code"] == "model_not_found", (model, body)
    assert _message(server, "/x" * 3000)[:2] == (404, "model_not_found")
    assert "No such file" not in server.log() and "not a supported model" not in server.log()


def test_models_under_the_dir_load_by_path_and_spellings_stay_bounded(server, models_dir):
    client = server.openai(max_retries=0)
    by_name = client.completions.create(model="tiny-q8_0.gguf", prompt="hi", max_tokens=2)  # relative to the dir
    assert by_name.choices and by_name.model
    real = str(models_dir / "tiny-q8_0.gguf")
    entry = server.get_json(f"/v1/models/{real}")
    assert entry["state"] == "ready" and entry["id"] == real
    def listing_size() -> int:  # numbers (memory, expiry) change their digits by themselves: count them as 0
        return len(re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "0", json.dumps(server.get_json("/v1/models"))))

    size = listing_size()
    for i in range(1, 41):  # other spellings of the same file: the same model, none kept as an alias
        spelling = f"{models_dir}{'/.' * (i % 7)}{'/' * (i // 7 + 1)}tiny-q8_0.gguf"
        assert client.completions.create(model=spelling, prompt="hi", max_tokens=1).choices
    assert listing_size() == size
    assert server.get_json(f"/v1/models/{real}")["aliases"] == entry["aliases"]
    metrics = server.url("/metrics")
    import urllib.request

    assert "octo_model_loads_total 2.0" in urllib.request.urlopen(metrics).read().decode()  # test-model + this
    assert client.completions.create(model="sub/nested.gguf", prompt="hi", max_tokens=1).choices


def test_a_hub_id_that_is_not_downloaded_is_a_404_and_the_hub_is_never_asked(server, hub):
    for model in ["org/Remote-GGUF", "org/Remote-GGUF:Q4_K_M", "hf://org/Remote-GGUF/Remote-Q4_K_M.gguf"]:
        status, body = post(server, "/v1/chat/completions", {"model": model, "messages": M}, JSON)
        assert status == 404 and "octo pull" in body["error"]["message"], body
    assert hub.requests == []


def test_allow_any_path_loads_any_readable_model(models_dir, tmp_path):
    outside = tmp_path / "elsewhere.gguf"
    shutil.copy(models_dir / "tiny-f16.gguf", outside)
    with run_octo("test-model", "--engine", "echo", "--allow-any-path", "--log-level", "debug") as s:
        out = s.openai().completions.create(model=str(outside), prompt="hi", max_tokens=2)
        assert out.choices
        assert s.get_json(f"/v1/models/{outside}")["state"] == "ready"
        status, body = post(s, "/v1/chat/completions", {"model": "test-model", "messages": "not-a-list"}, JSON)
        assert status == 400
        assert "not-a-list" in s.log()  # --log-level debug: a refused request's body is logged


# -- refusals are logged once ----------------------------------------------------------------------------------------
def test_every_refusal_is_logged_once_without_its_body(server):
    secret = "secret-prompt-text-4711"
    status, _ = post(server, "/v1/chat/completions", {"model": "nope-4711", "messages": [
        {"role": "user", "content": secret}]}, JSON)
    assert status == 404
    status, _ = post(server, "/v1/completions", {"model": "test-model", "prompt": "x", "temperature": "hot"}, JSON)
    assert status == 400
    deadline = time.monotonic() + 5
    while "temperature" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    lines = [ln for ln in log.splitlines() if "nope-4711" in ln]
    assert len(lines) == 1 and " INFO " in lines[0] and "/v1/chat/completions" in lines[0] and "404" in lines[0] \
        and "(param model)" in lines[0], lines
    assert [ln for ln in log.splitlines() if "refused POST /v1/completions: 400" in ln and "(param temperature)" in ln]
    assert secret not in log


def test_request_values_cannot_forge_a_log_line(server):
    """A model name, a path, a parameter name with a newline and ANSI escapes: quoted in the log line (as Go's %q,
    as Ollama's slog lines), so a client cannot write a line of its own, nor colour the operator's terminal."""
    forged = "x\n2099-01-01 00:00:00,000 ERROR octo.forged: \x1b[31mpwned\x1b[0m\u2028\u009b"
    assert post(server, "/v1/chat/completions", {"model": forged, "messages": M}, JSON)[0] == 404
    assert post(server, "/api/chat", {"model": forged, "messages": M, "stream": False}, JSON)[0] == 404
    assert post(server, "/api/pull", {"model": forged}, JSON)[0] == 404
    assert raw(server.port, f"GET /v1/models/{quote(forged, safe='')} HTTP/1.1\r\nHost: 127.0.0.1\r\n")[0] == 404
    status, _ = post(server, "/v1/chat/completions", {"model": "test-model", "messages": M, forged: 1}, JSON)
    assert status == 400
    deadline = time.monotonic() + 5
    while server.log().count("pwned") < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    assert log.count("pwned") >= 5, log[-3000:]
    assert not [ln for ln in log.splitlines() if ln.startswith("2099")]  # no line of the client's own
    assert "\x1b" not in log and "\u2028" not in log and "\u009b" not in log
    assert "\\n2099-01-01" in log and "\\x1b[31mpwned" in log and "\\u2028" in log


# -- /health behind a key --------------------------------------------------------------------------------------------
def test_health_without_the_key_says_the_status_only():
    with run_octo("test-model", "--engine", "echo", api_key=KEY) as s:
        status, body = s.get_status("/health")
        assert status == 200 and body == {"status": "ok"}
        import urllib.request

        req = urllib.request.Request(s.url("/health"), headers={"Authorization": f"Bearer {KEY}"})
        full = json.loads(urllib.request.urlopen(req).read())
        assert full["status"] == "ok" and full["models"][0]["id"] == "test-model" and "memory" in full


# -- the memory guard ------------------------------------------------------------------------------------------------
def _huge_context(src: Path, dst: Path) -> None:
    """A copy of a GGUF whose header claims a 4-billion-token context: its KV cache cannot fit anywhere."""
    data = bytearray(src.read_bytes())
    key = b"context_length"
    at = data.index(key) + len(key)
    kind = struct.unpack_from("<I", data, at)[0]
    assert kind == 4, kind  # uint32
    struct.pack_into("<I", data, at + 4, 0xFFFFFFF0)
    dst.write_bytes(bytes(data))


def test_a_model_that_does_not_fit_in_memory_is_a_503_naming_why(models_dir, tmp_path):
    _huge_context(models_dir / "tiny-q8_0.gguf", tmp_path / "huge.gguf")
    env = {"OCTO_MODELS_DIR": f"{models_dir}:{tmp_path}"}  # folders separated by ':' in the variable
    with run_octo("test-model", "--engine", "echo", env=env) as s:
        t0 = time.monotonic()
        status, body = post(s, "/v1/chat/completions", {"model": "huge.gguf", "messages": M}, JSON)
        assert status == 503 and body["error"]["code"] == "no_room" and "available" in body["error"]["message"]
        assert time.monotonic() - t0 < 30  # refused, not loaded
        assert {m["id"]: m["state"] for m in s.get_json("/v1/models")["data"]}["test-model"] == "ready"


def test_a_load_waits_for_a_busy_model_then_503_and_keep_alive_is_capped(models_dir):
    with run_octo("busy", "--engine", "echo", "-o", "token_delay_ms=40", "--max-loaded", "1", "--queue-timeout",
                  "3", "--models-dir", str(models_dir), "--keep-alive", "2m", "--evict-startup-models") as s:
        client = s.openai(max_retries=0)
        words = " ".join(f"w{i}" for i in range(250))  # 10 s of stream
        stream = client.chat.completions.create(model="busy", stream=True, messages=[{"role": "user",
                                                                                          "content": words}])
        next(iter(stream))
        t0 = time.monotonic()
        status, body = post(s, "/v1/completions", {"model": "tiny-q8_0.gguf", "prompt": "x"}, JSON)
        waited = time.monotonic() - t0
        assert status == 503 and body["error"]["code"] == "no_room" and "--max-loaded 1" in body["error"]["message"]
        assert 2.5 < waited < 20, waited
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)  # never broken
        assert post(s, "/v1/models/tiny-q8_0.gguf/load", None)[0] == 200  # (an admin load waits for the load)
        # Ollama clients send keep_alive -1: served, held to --keep-alive (the default --max-keep-alive)
        out = client.completions.create(model="tiny-q8_0.gguf", prompt="x", max_tokens=2,
                                        extra_body={"keep_alive": -1})
        assert out.choices
        entry = s.get_json(f"/v1/models/{models_dir / 'tiny-q8_0.gguf'}")
        assert entry["keep_alive"] == 120 and time.time() < entry["expires_at"] <= time.time() + 121
        client.completions.create(model="tiny-q8_0.gguf", prompt="x", max_tokens=2, extra_body={"keep_alive": "9h"})
        assert s.get_json(f"/v1/models/{models_dir / 'tiny-q8_0.gguf'}")["keep_alive"] == 120
        client.completions.create(model="tiny-q8_0.gguf", prompt="x", max_tokens=2, extra_body={"keep_alive": 30})
        assert s.get_json(f"/v1/models/{models_dir / 'tiny-q8_0.gguf'}")["keep_alive"] == 30


def test_models_named_at_start_stay_loaded_and_a_failed_load_unloads_nothing(models_dir, tmp_path):
    with run_octo("test-model", "--engine", "echo", "--max-loaded", "1", "--models-dir", str(models_dir)) as s:
        t0 = time.monotonic()
        status, body = post(s, "/v1/completions", {"model": "tiny-q8_0.gguf", "prompt": "x"}, JSON)
        assert status == 503 and body["error"]["code"] == "no_room" and "named at start" in body["error"]["message"]
        assert time.monotonic() - t0 < 20  # nothing to wait for: the model named at start does not go
        assert {m["id"]: m["state"] for m in s.get_json("/v1/models")["data"]}["test-model"] == "ready"
    (tmp_path / "broken.gguf").write_bytes(gguf_bytes())  # a sound header, no tensors: llama.cpp cannot load it
    with run_octo("--models-dir", f"{models_dir}", "--models-dir", str(tmp_path), "--max-loaded", "1") as s:
        client = s.openai(max_retries=0)
        assert client.completions.create(model="tiny-q8_0.gguf", prompt="x", max_tokens=1).choices
        status, body = post(s, "/v1/completions", {"model": "broken.gguf", "prompt": "x"}, JSON)
        assert status >= 500, body
        states = {m["id"]: m["state"] for m in s.get_json("/v1/models")["data"]}
        assert states[str(models_dir / "tiny-q8_0.gguf")] == "ready", states  # over the count only: kept
        import urllib.request

        assert "octo_model_unloads_total 0.0" in urllib.request.urlopen(s.url("/metrics")).read().decode()


def test_three_models_on_demand_by_default_and_max_keep_alive(models_dir):
    with run_octo("--models-dir", str(models_dir), "--max-keep-alive", "1h") as s:
        client = s.openai(max_retries=0)
        for model in ("tiny-q8_0.gguf", "tiny-f16.gguf", "sub/nested.gguf", "tiny-f32.gguf"):
            assert client.completions.create(model=model, prompt="x", max_tokens=1,
                                             extra_body={"keep_alive": "10h"}).choices
            loaded = [m for m in s.get_json("/v1/models")["data"] if m["state"] == "ready"]
            assert len(loaded) <= 3, [m["id"] for m in loaded]
        assert [m["keep_alive"] for m in loaded] == [3600] * len(loaded)
        assert "unloading" in s.log() and "least recently used" in s.log()


def test_while_starting_a_foreign_host_is_refused_and_a_keyed_health_names_nothing():
    import subprocess
    import sys

    from serverproc import REPO, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", "secret-model-name", "--engine", "faulty", "--plugins-dir",
           str(REPO / "tests" / "plugins"), "-o", "load_s=20", "--api-key", KEY, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = raw(port, "GET /health HTTP/1.1\r\nHost: localhost\r\n")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert status == 503 and body["status"] == "loading" and "secret-model-name" not in json.dumps(body)
        status, body = raw(port, "GET /health HTTP/1.1\r\nHost: evil.example.com\r\n")
        assert status == 403 and body["error"]["code"] == "host_not_allowed"
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_network_bind_needs_a_key():
    import subprocess
    import sys

    from serverproc import REPO

    for host in ("0.0.0.0", "::"):
        out = subprocess.run([sys.executable, "-m", "octo.cli", "serve", "m", "--engine", "echo", "--host", host,
                              "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "without --api-key" in out.stderr, out.stderr


def test_on_a_network_bind_the_key_not_the_host_name_decides():
    with run_octo("test-model", "--engine", "echo", "--host", "0.0.0.0", api_key=KEY) as s:
        head = f"GET /v1/models HTTP/1.1\r\nHost: octo.example.com:{s.port}\r\n"
        assert raw(s.port, head)[0] == 401
        assert raw(s.port, head + f"Authorization: Bearer {KEY}\r\n")[0] == 200


def test_engine_workers_run_with_the_libraries_telemetry_off():
    """ONNX Runtime looks up Microsoft's telemetry host from every process that loads it unless
    ORT_DISABLE_TELEMETRY is set: octo sets it (and huggingface_hub's switch) for the processes it starts, even when
    the environment it was started in has none of them."""
    names = ("ORT_DISABLE_TELEMETRY", "HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK")
    with run_octo("demo", "--engine", "onnx", unset=names) as server:
        reply = server.openai().chat.completions.create(model="demo", max_tokens=2, extra_body={"ignore_eos": True},
                                                        messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason == "length"
        workers = children(server.proc.pid)
        assert workers, "the ONNX engine runs in a worker process"
        for pid in workers:
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            assert all(environ.get(n) == "1" for n in names), {n: environ.get(n) for n in names}
