"""A warm start serves with the engine worker ``octo serve`` started before its own imports, and loads on demand
take the spare worker kept warm; no worker outlives the gateway (octo.runtime.prespawn, octo.runtime.remote)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from serverproc import alive, children, run_octo

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def ggufs():
    from octo.synth.gguf import build_gguf

    return [os.path.realpath(build_gguf("tiny", ftype=f)) for f in ("q8_0", "f16")]


def _prespawned(log: str) -> int:
    found = re.findall(r"pre-spawned an engine worker \(pid (\d+)\) before the gateway's imports", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


def test_a_warm_start_serves_with_the_worker_started_before_the_gateways_imports(ggufs, tmp_path):
    env = {"OCTO_HOME": str(tmp_path)}
    args = (ggufs[0], "--engine", "llamacpp", "--log-level", "debug")
    with run_octo(*args, env=env):
        pass  # a first start: the crash-safety probe's verdict is cached in OCTO_HOME
    t0 = time.monotonic()
    with run_octo(*args, env=env) as server:
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text() if sys.platform.startswith("linux") else None
        stream = server.openai().chat.completions.create(
            model=ggufs[0], messages=[{"role": "user", "content": "hello"}], max_tokens=2, stream=True)
        next(c for c in stream if c.choices and c.choices[0].delta.content is not None)
        took = time.monotonic() - t0
        log = server.log()
        pid = _prespawned(log)
        assert server.get_json("/health")["worker"]["pid"] == pid  # the model loaded in the pre-spawned worker
        # it was started before the gateway imported its server (the loading line comes after)
        assert log.index("pre-spawned an engine worker") < log.index("octo: loading")
        assert took < 60, took  # generous: a busy CI host (about 2 s on a quiet 2-core one)
        if maps is not None:  # the engine was detected in the worker: llama.cpp is not loaded into the gateway
            assert "libllama" in Path(f"/proc/{pid}/maps").read_text()
            assert "libllama" not in maps
            # nor later, by the catalog's scan of what could serve (every engine's detect(), in the gateway)
            assert _wait(lambda: any(m["id"] == "demo" for m in server.get_json("/v1/models")["data"]), 20)
            maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
            assert "libllama" not in maps and "onnxruntime" not in maps


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_loads_on_demand_take_the_spare_worker_and_nothing_outlives_the_gateway(ggufs, tmp_path, sig):
    folder = str(Path(ggufs[0]).parent)
    with run_octo("--models-dir", folder, "--max-loaded", "1", "--log-level", "debug",
                  env={"OCTO_HOME": str(tmp_path)}) as server:
        gateway = server.proc.pid
        spare = _prespawned(server.log())  # no model named: the pre-spawned worker waits as the spare
        assert children(gateway) == [spare]
        seen = []
        for model in (ggufs[0], ggufs[1], ggufs[0]):  # each load unloads the other model (--max-loaded 1)
            assert _wait(lambda: len(children(gateway)) == 1 + bool(seen), 30), children(gateway)
            spares = set(children(gateway)) - set(seen[-1:])
            out = server.openai().completions.create(model=model, prompt="hi", max_tokens=2)
            assert out.choices[0].finish_reason in ("stop", "length")
            worker = next(m["worker"]["pid"] for m in server.get_json("/v1/models")["data"] if m["id"] == model)
            assert worker in spares, (worker, spares)  # the load took the spare, not a new process
            seen.append(worker)
        assert _wait(lambda: len(children(gateway)) == 2, 30)  # the model's worker and a new spare
        everyone = children(gateway)
        os.kill(gateway, sig)
        server.proc.wait(30)
        assert _wait(lambda: not any(map(alive, everyone)), 15), [p for p in everyone if alive(p)]
        assert not any(map(alive, seen))


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": -999, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "color": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["answer", "ok", "color"], "additionalProperties": False}


def _constrained(server, model: str) -> dict:
    r = server.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"answer", "ok", "color"}, obj
    assert isinstance(obj["answer"], int) and -999 <= obj["answer"] <= 999
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")
    return obj


def test_a_constrained_first_request_builds_the_deferred_vocabulary_and_is_answered_right(ggufs, tmp_path):
    """The worker no longer builds its constrained-decoding vocabulary as it starts serving (it competed with the first
    token): a constrained request that comes first builds it itself and gets a grammar-constrained answer."""
    with run_octo(ggufs[0], "--engine", "llamacpp", "--log-level", "debug", env={"OCTO_HOME": str(tmp_path)}) as server:
        _constrained(server, ggufs[0])  # at once: before any lull
        assert _wait(lambda: "a request built it before the first lull" in server.log(), 30), server.log()[-3000:]
        assert "vocabulary built in a lull" not in server.log()
        _constrained(server, ggufs[0])


def test_the_vocabulary_waits_for_a_lull_after_the_first_plain_request(ggufs, tmp_path):
    with run_octo(ggufs[0], "--engine", "llamacpp", "--log-level", "debug", env={"OCTO_HOME": str(tmp_path)}) as server:
        t0 = time.monotonic()
        out = server.openai().completions.create(model=ggufs[0], prompt="hi", max_tokens=2)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert "vocabulary built in a lull" not in server.log()  # not before the first request was answered ...
        assert _wait(lambda: "vocabulary built in a lull" in server.log(), 30), server.log()[-3000:]
        assert time.monotonic() - t0 < 30  # ... soon after it (0.5 s of idleness), not at the latest bound
        _constrained(server, ggufs[0])
