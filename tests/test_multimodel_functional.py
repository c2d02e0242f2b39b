"""Several models behind one URL: routing, load on demand, unload (LRU, keep_alive, admin), pinning, failures.

Real `octo serve` processes on tiny synthetic models (GGUF through llama.cpp in worker processes, the echo
engine, a synthetic Whisper checkpoint), driven through the official openai SDK where a client would use it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serverproc import REPO, rss_tree, run_octo

PLUGINS = str(REPO / "tests" / "plugins")


@pytest.fixture(scope="module")
def ggufs():
    from octo.synth.gguf import build_gguf

    # real paths: a model a request loads by path is named by its real path (.cache may be a symlink)
    return {"chat": os.path.realpath(build_gguf("tiny", ftype="q8_0")),
            "chat2": os.path.realpath(build_gguf("tiny", ftype="f16")),
            "embed": os.path.realpath(build_gguf("tiny", ftype="f16", pooling="mean"))}


def _dir(ggufs) -> str:
    """The folder of the synthetic GGUFs: requests may load models on demand by path only under --models-dir."""
    return str(Path(ggufs["chat"]).parent)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    return server.post_json(path, body)


def _states(server) -> dict[str, str]:
    return {m["id"]: m["state"] for m in server.get_json("/v1/models")["data"]}


def _wait_state(server, model: str, state: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while _states(server).get(model) != state:
        assert time.monotonic() < deadline, f"{model} never became {state}: {_states(server)}"
        time.sleep(0.1)


def _models_file(tmp_path: Path, models: list) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": models}))  # JSON is YAML
    return str(path)


def test_chat_embeddings_and_whisper_behind_one_url(ggufs, tmp_path):
    from octo.synth.whisper import build_whisper, speech

    ckpt = str(build_whisper("test"))
    wav = speech("hello world", tmp_path / "hello.wav")
    with run_octo(ggufs["chat"], ggufs["embed"], ckpt, "--share-cores", "turns") as server:
        client = server.openai()
        listed = client.models.list().data
        names = {m.id for m in listed if m.model_extra.get("source") != "catalog"}
        assert names == {ggufs["chat"], ggufs["embed"], ckpt}
        # catalog models this host could load on demand are listed too (the synthetic demo is built locally)
        assert any(m.id == "demo" and m.model_extra["state"] == "available" for m in listed)
        chat = client.chat.completions.create(model="tiny-q8_0", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length")
        emb = client.embeddings.create(model="tiny-embmean-f16", input=["one", "two"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
        with open(wav, "rb") as f:
            text = client.audio.transcriptions.create(model="whisper-1", file=f)
        assert isinstance(text.text, str)
        # without a model name: a 400 naming `model` when several are loaded
        status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["error"]["param"] == "model"
        status, body = _post(server, "/v1/chat/completions", {"model": "nope", "messages": [
            {"role": "user", "content": "hi"}]})
        assert status == 404 and "nope" in body["error"]["message"] and "tiny-q8_0" in body["error"]["message"]
        per_model = server.get_json("/v1/queue/stats")["models"]
        assert set(per_model) == names and per_model[ggufs["chat"]]["total_processed"] >= 1
        engines = server.get_json("/v1/engines")
        assert {m["model"] for m in engines["models"]} == names
        assert server.get_json(f"/v1/engines?model={ckpt}")["active"] == "whisper"
        metrics = urllib.request.urlopen(server.url("/metrics")).read().decode()
        assert f'octo_processed_total{{model="{ggufs["chat"]}"}}' in metrics
        # three models in workers with --share-cores turns: they compute in turns (octo.runtime.arbiter)
        workers = {m["id"]: m["worker"] for m in server.get_json("/v1/models")["data"] if "worker" in m}
        assert all(w["shares_cores"] for w in workers.values())
        assert workers[ggufs["chat"]]["compute_turns"] > 0


def test_load_on_demand_once_for_concurrent_requests_and_keep_alive_zero(ggufs):
    with run_octo("resident", "--engine", "echo", "--models-dir", _dir(ggufs)) as server:
        assert {m: st for m, st in _states(server).items() if st != "available"} == {"resident": "ready"}
        client = server.openai(max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client.completions.create, model=ggufs["chat2"], prompt="hello", max_tokens=3)
                       for _ in range(8)]
            outs = [f.result(timeout=120) for f in futures]
        assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)
        metrics = urllib.request.urlopen(server.url("/metrics")).read().decode()
        assert "octo_model_loads_total 2.0" in metrics  # the resident model and ONE load for eight requests
        assert _states(server)[ggufs["chat2"]] == "ready"
        entry = server.get_json(f"/v1/models/{ggufs['chat2']}")
        assert entry["engine"] == "llamacpp" and entry["keep_alive"] == 300 and entry["expires_at"] > time.time()
        assert entry["memory"]["estimated_bytes"] > 0 and entry["memory"]["measured_bytes"] > 0
        # keep_alive 0 (Ollama's): unloaded right after the request
        client.completions.create(model=ggufs["chat2"], prompt="bye", max_tokens=2, extra_body={"keep_alive": 0})
        _wait_state(server, ggufs["chat2"], "available")
        assert _states(server)["resident"] == "ready"
        status, body = _post(server, "/v1/completions", {"model": ggufs["chat2"], "prompt": "x", "keep_alive": "soon"})
        assert status == 400 and body["error"]["param"] == "keep_alive"
        # `octo ps` lists what the server has loaded
        out = subprocess.run([sys.executable, "-m", "octo.cli", "ps", "--port", str(server.port)],
                             capture_output=True, text=True, check=True).stdout
        assert "resident" in out and "echo" in out and ggufs["chat2"] not in out


def test_lru_eviction_pinning_and_busy_models(ggufs, tmp_path):
    mf = _models_file(tmp_path, [{"model": "pinned-echo", "engine": "echo", "pinned": True},
                                 {"model": "busy-echo", "engine": "echo", "options": {"token_delay_ms": "30"}}])
    with run_octo("--models-file", mf, "--max-loaded", "2", "--models-dir", _dir(ggufs),
                  "--evict-startup-models") as server:  # (busy-echo, named at start, may go too)
        client = server.openai(max_retries=0)
        a, b = ggufs["chat"], ggufs["chat2"]
        for model in (a, b, a, b):  # alternating: each load evicts the least recently used idle model, never pinned
            client.completions.create(model=model, prompt="hi", max_tokens=2)
            states = _states(server)
            assert states[model] == "ready" and states["pinned-echo"] == "ready"
            assert sorted(m for m, st in states.items() if st == "ready") == sorted(["pinned-echo", model])
        assert "octo_model_unloads_total 4.0" in urllib.request.urlopen(server.url("/metrics")).read().decode()
        # a model with a stream running is never evicted: the load waits until it is idle (within --queue-timeout;
        # test_security_functional has the 503 after it), the stream is never broken
        words = " ".join(f"w{i}" for i in range(60))
        stream = client.chat.completions.create(model="busy-echo", stream=True,
                                                messages=[{"role": "user", "content": words}])
        first = next(iter(stream))
        assert client.completions.create(model=a, prompt="hi", max_tokens=2).choices  # after busy-echo's stream
        assert _states(server)["busy-echo"] == "available"
        rest = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices) == words
        # admin routes: unload and load by name
        status, body = _post(server, f"/v1/models/{a}/unload", {})
        assert status == 200 and body["state"] == "available"
        status, body = _post(server, f"/v1/models/{b}/load", {})
        assert status == 200 and body["state"] == "ready"


def test_a_failing_load_answers_its_waiters_and_the_others_keep_serving(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with run_octo("steady-echo", "--engine", "echo", "--models-dir", str(tmp_path)) as server:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _post(server, "/v1/completions", {"model": str(bad), "prompt": "x"}),
                                    range(4)))
        assert all(s == 503 for s, _ in results), results
        err = results[0][1]["error"]
        assert err["code"] == "model_failed" and "broken.gguf" in err["message"]
        t0 = time.monotonic()  # not retried in a loop: the same answer at once
        status, _ = _post(server, "/v1/completions", {"model": str(bad), "prompt": "x"})
        assert status == 503 and time.monotonic() - t0 < 1.0
        assert _states(server)[os.path.realpath(bad)] == "failed"
        ok = server.openai().completions.create(model="steady-echo", prompt="still serving")
        assert ok.choices[0].text == "still serving"


def test_a_model_that_is_not_downloaded_names_octo_pull(tmp_path):
    catalog = tmp_path / "models.yaml"
    catalog.write_text("models:\n  - id: remote-only\n    task: chat\n    default_variant: default\n"
                       "    variants:\n      default:\n        llamacpp: hf://octo-test/missing/model.gguf\n")
    env = {"OCTO_CATALOG": str(catalog), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    with run_octo("e", "--engine", "echo", env=env) as server:
        status, body = _post(server, "/v1/completions", {"model": "remote-only", "prompt": "x"})
        assert status == 404 and "octo pull" in body["error"]["message"]


def test_another_model_keeps_streaming_while_one_crashes(tmp_path):
    mf = _models_file(tmp_path, [{"model": "calm", "engine": "echo", "options": {"token_delay_ms": "20"}},
                                 {"model": "crasher", "engine": "faulty",
                                  "options": {"crash_in": "step", "safe": "false"}}])
    with run_octo("--models-file", mf, "--plugins-dir", PLUGINS) as server:
        client = server.openai(max_retries=0)
        words = " ".join(f"w{i}" for i in range(40))
        stream = client.chat.completions.create(model="calm", stream=True,
                                                messages=[{"role": "user", "content": words}])
        first = next(iter(stream))
        status, body = _post(server, "/v1/chat/completions", {"model": "crasher", "messages": [
            {"role": "user", "content": "CRASH it all now"}]})
        assert status == 502 and body["error"]["code"] == "engine_crashed"
        rest = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
        assert text == words and rest[-1].choices[0].finish_reason == "stop"
        health = server.get_json("/health")
        assert health["status"] == "degraded"
        assert {m["id"]: m["state"] for m in health["models"]} == {"calm": "ready", "crasher": "crashed"}


def test_unloading_gives_the_memory_back(ggufs):
    """Load/unload cycles of a model in a worker: the gateway's and workers' memory comes back. The baseline is the
    second cycle: by then the gateway has imported what it imports lazily (the catalog scan's hub client and the
    engines' libraries, 3 s after the start). No spare worker: whether one is running when a sample is taken depends on
    timing, not on what unloading gives back."""

    with run_octo("e", "--engine", "echo", "--models-dir", _dir(ggufs), env={"OCTO_SPARE_WORKER": "0"}) as server:
        started, sizes = time.monotonic(), []
        for i in range(6):
            if i == 1:
                time.sleep(max(0.0, 4.0 - (time.monotonic() - started)))
            assert _post(server, f"/v1/models/{ggufs['chat']}/load", {})[0] == 200
            assert _post(server, "/v1/completions", {"model": ggufs["chat"], "prompt": "hi", "max_tokens": 2})[0] \
                == 200
            assert _post(server, f"/v1/models/{ggufs['chat']}/unload", {})[0] == 200
            sizes.append(rss_tree(server.proc.pid))
        assert sizes[-1] <= sizes[1] * 1.10, sizes
