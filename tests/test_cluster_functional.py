"""Scale-out on Ray Serve (``octo serve --cluster ray``), on loopback with a local Ray head each server starts.

Real `octo serve` processes: the echo engine in 2 replicas behind octo's front door (which replica answered, where
each runs, sticky conversations), backpressure (503 + Retry-After when every replica and the queue are full),
a replica killed mid-load (503 for its in-flight requests only, then recovery), autoscaling 1 -> 2 -> 1, and a
Whisper model and a llama.cpp model as two deployments behind one URL. And: without --cluster, ray is never imported.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serverproc import REPO, run_octo

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'octo[ray]'); the cluster tests need it")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'octo[ray]')")
httpx = pytest.importorskip("httpx")

START = 240.0  # a local Ray head, Serve, then the replicas


def _models_file(tmp_path: Path, models: list) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": models}))  # JSON is YAML
    return str(path)


def _chat(server, question: str, *, max_tokens: int = 4, stream: bool = False, model: str = "echo-m",
          timeout: float = 60, client: httpx.Client | None = None) -> tuple[int, dict | list, str | None]:
    """(status, JSON body or SSE payloads, X-Octo-Replica) of one chat request (on ``client`` when given)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": question}]}
    with contextlib.nullcontext(client) if client is not None else httpx.Client(timeout=timeout) as client:
        with client.stream("POST", server.url("/v1/chat/completions"), json=body) as r:
            replica = r.headers.get("X-Octo-Replica")
            if not stream or r.status_code != 200:
                r.read()
                return r.status_code, {**r.json(), "_headers": dict(r.headers)}, replica
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            return r.status_code, events, replica


def _cluster(server, model: str = "echo-m") -> dict:
    return next(m for m in server.get_json("/v1/models")["data"] if m["id"] == model)["cluster"]


def _wait(what, check, seconds: float):
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _reporting(server, n: int, seconds: float = 60) -> dict:
    """The cluster once n replicas run and each has reported (Ray lists a replica as soon as it routes to it; its
    pid and node arrive with its first stats report, each second)."""
    return _wait(f"{n} replicas reporting", lambda: c if (c := _cluster(server))["replicas"] == n and all(
        p["node_id"] and p["pid"] for p in c["placement"]) else None, seconds)


def _sticky_questions(server, per_replica: int) -> dict[str, list[str]]:
    """Questions (conversations) grouped by the replica their first turn went to."""
    groups: dict[str, list[str]] = {}
    for i in range(60):
        q = f"conversation {i}: " + "where are the rocks? " * 40  # echo answers with it: long enough to be cut
        status, _, replica = _chat(server, q)
        assert status == 200 and replica
        groups.setdefault(replica, []).append(q)
        if len(groups) >= 2 and all(len(v) >= per_replica for v in groups.values()):
            break
    return groups


def test_serve_without_cluster_never_imports_ray():
    code = ("import sys, json\n"
            "from octo import cli, cluster\n"
            "from octo.cluster import deploy\n"
            "from octo.runtime import registry\n"
            "from octo.server import app as server\n"
            "from octo.config import ServerConfig\n"
            "from octo.runtime.registry import Registry\n"
            "app = server.create_app(ServerConfig(), Registry(ServerConfig(), {}))\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    # and a real server: no Ray library mapped into the process
    with run_octo("plain-echo", "--engine", "echo") as server:
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "_raylet" not in maps and "/ray/" not in maps
        assert server.post_json("/v1/chat/completions", {"model": "plain-echo", "messages": [
            {"role": "user", "content": "hi"}]})[0] == 200


def test_models_file_cluster_keys_are_checked(tmp_path):
    from octo.errors import ConfigError
    from octo.runtime.specs import load_models_file

    mf = _models_file(tmp_path, [{"model": "a", "engine": "echo", "replicas": 2,
                                  "resources": {"num_cpus": 0.5, "memory_gb": 1}},
                                 {"model": "b", "engine": "echo", "autoscaling": {"min": 1, "max": 3, "target": 2}}])
    a, b = load_models_file(mf)
    assert a.replicas == 2 and a.resources == {"num_cpus": 0.5, "memory_gb": 1.0} and a.autoscaling is None
    assert b.autoscaling["min_replicas"] == 1 and b.autoscaling["max_replicas"] == 3
    assert b.autoscaling["target_ongoing_requests"] == 2
    for bad in ({"replicas": 0}, {"replicas": 2, "autoscaling": "1:2"}, {"autoscaling": {"min": 3, "max": 1}},
                {"resources": {"cpus": 1}}):
        with pytest.raises(ConfigError):
            load_models_file(_models_file(tmp_path, [{"model": "x", "engine": "echo", **bad}]))
    bad_flag = subprocess.run([sys.executable, "-m", "octo.cli", "serve", "x", "--engine", "echo", "--replicas", "2"],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad_flag.returncode != 0 and "--cluster" in bad_flag.stderr


def test_two_replicas_behind_the_front_door():
    with run_octo("echo-m", "--engine", "echo", "--cluster", "ray", "--replicas", "2", "--replica-cpus", "0.5",
                  timeout=START) as server:
        info = _reporting(server, 2)
        assert len({p["replica"] for p in info["placement"]}) == 2
        groups = _sticky_questions(server, 2)
        assert len(groups) == 2, "both replicas answered"
        # a conversation sticks to its replica, turn after turn (streams too)
        for replica, questions in groups.items():
            for q in questions[:2]:
                for stream in (False, True):
                    status, body, got = _chat(server, q, stream=stream)
                    assert status == 200 and got == replica
        # the official SDK, streaming, sees an ordinary model
        client = server.openai()
        chunks = list(client.chat.completions.create(model="echo-m", max_tokens=3, stream=True,
                                                     messages=[{"role": "user", "content": "one two three four"}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
        emb = client.embeddings.create(model="echo-m", input=["a", "b"])
        assert len(emb.data) == 2
        # errors keep octo's shape
        status, body = server.post_json("/v1/chat/completions", {"model": "nope", "messages": [
            {"role": "user", "content": "hi"}]})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = server.post_json("/v1/chat/completions", {"model": "echo-m", "messages": "bad"})
        assert status == 400 and body["error"]["param"]
        # queue stats: the replicas and where each runs (their counts are reported every second)
        def processed():
            st = server.get_json("/v1/queue/stats")["models"]["echo-m"]
            return st if len(st["replicas"]) == 2 and all(r["total_processed"] for r in st["replicas"]) else None
        st = _wait("per-replica stats", processed, 15)
        assert {r["replica"] for r in st["replicas"]} == set(groups)
        assert server.get_json("/v1/engines")["isolation"] == "cluster"


def test_backpressure_503_when_every_replica_is_full():
    with run_octo("echo-m", "--engine", "echo", "-o", "token_delay_ms=40", "--cluster", "ray", "--replicas", "1",
                  "--max-batch", "1", "--max-queue", "1", "--replica-cpus", "0.5", timeout=START) as server:
        # the ten requests leave together: their clients exist before (an httpx client loads its CA bundle, 50-100 ms
        # of CPU each: made in the threads on a busy host they spread the burst over seconds, and requests that
        # come after others finished find room)
        clients = [httpx.Client(timeout=60) for _ in range(10)]
        start = threading.Barrier(10)

        def burst(i: int) -> tuple[int, dict | list, str | None]:
            start.wait()
            return _chat(server, f"q{i}", max_tokens=30, client=clients[i])

        try:
            with concurrent.futures.ThreadPoolExecutor(10) as pool:
                got = list(pool.map(burst, range(10)))
        finally:
            for c in clients:
                c.close()
        statuses = [s for s, _, _ in got]
        assert statuses.count(200) >= 2 and statuses.count(503) >= 4, statuses
        refused = [b for s, b, _ in got if s == 503]
        assert all(b["error"]["type"] == "server_overloaded" and b["_headers"].get("retry-after") for b in refused)
        assert _chat(server, "after")[0] == 200  # and it serves again


def test_replica_killed_mid_load_fails_only_its_requests_then_recovers():
    with run_octo("echo-m", "--engine", "echo", "-o", "token_delay_ms=60", "--cluster", "ray", "--replicas", "2",
                  "--replica-cpus", "0.5", timeout=START) as server:
        _reporting(server, 2)
        groups = _sticky_questions(server, 2)
        assert len(groups) == 2
        victim, survivor = sorted(groups)
        pid = next(p["pid"] for p in _cluster(server)["placement"] if p["replica"] == victim)
        jobs = [(r, q, stream) for r in (victim, survivor) for q in groups[r][:2] for stream in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futs = {pool.submit(_chat, server, q, max_tokens=80, stream=s, timeout=90): (r, s) for r, q, s in jobs}
            time.sleep(1.5)  # every request is running (80 tokens take ~5 s)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            for fut in concurrent.futures.as_completed(futs, timeout=90):
                replica, stream = futs[fut]
                status, body, got = fut.result()
                if replica == victim:  # a clear 503 (or, in a started stream, an error event), never a hang
                    assert time.monotonic() - t0 < 30
                    if stream:
                        assert status == 200 and body[-1]["error"]["code"] == "replica_lost", body[-1]
                    else:
                        assert status == 503 and body["error"]["code"] == "replica_lost", body
                else:  # the other replica's requests go on
                    assert status == 200, body
                    last = body[-1] if stream else body
                    assert last["choices"][0]["finish_reason"] == "length"
        # new requests are served meanwhile, and Ray Serve brings the replica back
        assert _chat(server, groups[victim][0])[0] == 200
        _wait("the replica restarted", lambda: (c := _reporting(server, 2, 90))
              and pid not in {p["pid"] for p in c["placement"]}, 90)
        assert all(_chat(server, q)[0] == 200 for qs in groups.values() for q in qs[:1])
        assert _cluster(server)["requests_lost"] >= 2


def test_autoscaling_one_two_one(tmp_path):
    mf = _models_file(tmp_path, [{"model": "echo-m", "engine": "echo", "options": {"token_delay_ms": "40"},
                                  "autoscaling": {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 1,
                                                  "downscale_delay_s": 3, "metrics_interval_s": 0.5,
                                                  "look_back_period_s": 2}}])
    with run_octo("--models-file", mf, "--cluster", "ray", "--replica-cpus", "0.5", timeout=START) as server:
        assert _cluster(server)["replicas"] == 1 and _cluster(server)["autoscaling"]["max_replicas"] == 2
        stop = time.monotonic() + 60

        def load(i: int) -> None:
            while time.monotonic() < stop and _cluster(server)["replicas"] < 2:
                _chat(server, f"busy {i} {time.monotonic()}", max_tokens=40)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(load, range(4)))
        assert _cluster(server)["replicas"] == 2, "sustained queueing added a replica"
        _wait("scaled back to 1", lambda: _cluster(server)["replicas"] == 1, 60)


@pytest.mark.slow
def test_whisper_and_llamacpp_as_two_deployments(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("whisper", reason="openai-whisper is not installed")
    from octo.synth.gguf import build_gguf
    from octo.synth.whisper import build_whisper, speech

    gguf, ckpt = str(build_gguf("tiny", ftype="q8_0")), str(build_whisper("test"))
    wav = speech("hello world", tmp_path / "hello.wav")
    mf = _models_file(tmp_path, [{"model": gguf, "engine": "llamacpp", "replicas": 1},
                                 {"model": ckpt, "replicas": 1, "resources": {"num_cpus": 1}}])
    with run_octo("--models-file", mf, "--cluster", "ray", "--bench-seconds", "0.5", timeout=START) as server:
        listed = {m["id"]: m for m in server.get_json("/v1/models")["data"] if "cluster" in m}
        assert set(listed) == {gguf, ckpt}
        assert listed[gguf]["engine"] == "llamacpp" and listed[ckpt]["engine"] == "whisper"
        client = server.openai()
        raw = client.chat.completions.with_raw_response.create(model="tiny-q8_0", max_tokens=4,
                                                               messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().choices[0].finish_reason in ("stop", "length")
        with open(wav, "rb") as f:
            raw_t = client.audio.transcriptions.with_raw_response.create(model="whisper-1", file=f)
        assert isinstance(raw_t.parse().text, str)
        chat_replica, audio_replica = raw.headers["x-octo-replica"], raw_t.headers["x-octo-replica"]
        assert {chat_replica} == {p["replica"] for p in listed[gguf]["cluster"]["placement"]}
        assert {audio_replica} == {p["replica"] for p in listed[ckpt]["cluster"]["placement"]}
        stats = server.get_json("/v1/queue/stats")["models"]
        assert set(stats) == {gguf, ckpt}
