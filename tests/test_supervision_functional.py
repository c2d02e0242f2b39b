"""The gateway supervises its workers (real `octo serve` processes): a worker that stops answering (SIGSTOP, or an
engine stuck in a C call that holds the GIL) is killed and restarted, its requests ending at once with engine_hung,
while every route the gateway answers itself keeps answering within a second; crash blame (an outside SIGKILL never
moves to a fallback configuration); a failed model retries with back-off; loads are not queue waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from serverproc import REPO, run_octo

PLUGINS = str(REPO / "tests" / "plugins")
WORDS = " ".join(f"w{i}" for i in range(300))


def _chat(text: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _timed_get(server, path: str) -> tuple[float, int, bytes]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(server.url(path), timeout=30) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    return time.monotonic() - t0, status, body


async def _raw_stream(base: str, body: dict, on_first=None) -> tuple[list[dict], bool, float]:
    """A streamed chat read as raw SSE: its data events, whether it ended with [DONE], and the seconds from the
    first event to the end."""
    events, done, t_first = [], False, None
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
                    if t_first is None:
                        t_first = time.monotonic()
                        if on_first is not None:
                            on_first()
    return events, done, time.monotonic() - (t_first or time.monotonic())


def _gateway_routes_answer(server) -> dict:
    """Every route the gateway answers itself, each within a second; the queue figures' JSON."""
    out = {}
    for path in ("/health", "/v1/models", "/v1/queue/stats", "/metrics"):
        took, status, body = _timed_get(server, path)
        assert took < 1.0, (path, took)
        assert status in (200, 503), (path, status)
        out[path] = body
    return json.loads(out["/v1/queue/stats"])


def _check_hung_then_restarted(server, pid: int, engine: str) -> None:
    health = server.get_json("/health")
    assert health["state"] == "crashed" and "hung" in health["reason"], health
    assert server.get_json("/v1/models")["data"][0]["state"] == "crashed"
    metrics = urllib.request.urlopen(server.url("/metrics")).read().decode()
    assert f'octo_worker_hangs_total{{engine="{engine}",model="m"}} 1.0' in metrics
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    status, body = server.post_json("/v1/chat/completions", _chat("back again"))  # restarted as after a crash
    assert status == 200 and body["choices"][0]["message"]["content"] == "back again", body
    health = server.get_json("/health")
    assert health["state"] == "ready" and health["worker"]["pid"] != pid and health["worker"]["hangs"] == 1


def test_a_stopped_worker_is_killed_its_stream_ends_and_the_gateway_answers_meanwhile(tmp_path):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=30",
                  "--worker-timeout", "5", env={"OCTO_HOME": str(tmp_path)}) as server:
        pid = server.get_json("/health")["worker"]["pid"]
        stopped: list[float] = []

        def stop() -> None:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(asyncio.run, _raw_stream(server.base_url, _chat(WORDS), on_first=stop))
            while not stopped:
                time.sleep(0.01)
            time.sleep(0.5)
            stats = _gateway_routes_answer(server)  # from the gateway's own state, the worker's figures marked stale
            assert stats["models"]["m"]["stale"] is True and stats["models"]["m"]["active"] == 1, stats
            assert server.get_json("/health")["worker"]["heartbeat_age_s"] > 0.4
            time.sleep(max(0.0, stopped[0] + 2.8 - time.monotonic()))  # silent for 3 beats (2 s at least): shown
            health = server.get_json("/health")
            assert health["state"] == "unresponsive" and health["status"] == "degraded", health
            assert server.get_json("/v1/models")["data"][0]["state"] == "unresponsive"
            # a new request to the stopped worker is answered too (engine_hung once the worker is killed)
            status, body = server.post_json("/v1/chat/completions", _chat("hello"))
            events, done, _ = stream.result(timeout=30)
        ended = time.monotonic() - stopped[0]
        assert status == 502 and body["error"]["code"] == "engine_hung", body
        assert "'m'" in body["error"]["message"] and "no sign of life for" in body["error"]["message"]
        assert 5.0 <= ended < 10.0, ended
        err = events[-1].get("error")
        assert err and err["code"] == "engine_hung" and "faulty" in err["message"] and done, events[-2:]
        _check_hung_then_restarted(server, pid, "faulty")


def test_an_engine_holding_the_gil_in_a_c_call_is_killed_as_hung(tmp_path):
    with run_octo("m", "--engine", "gilhold", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=20",
                  "--worker-timeout", "2", env={"OCTO_HOME": str(tmp_path)}) as server:
        client = server.openai(max_retries=0)
        pid = server.get_json("/health")["worker"]["pid"]
        t0 = time.monotonic()
        stream = client.chat.completions.create(model="m", stream=True, messages=[
            {"role": "user", "content": "one two GILHOLD " + WORDS}])
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "engine_hung" in str(e.value.body) and time.monotonic() - t0 < 10
        _check_hung_then_restarted(server, pid, "gilhold")


def test_a_slow_step_that_releases_the_gil_is_not_a_hang(tmp_path):
    # each decode step sleeps 3 s (as a native engine computing with the GIL released): past --worker-timeout 2,
    # the heartbeat thread keeps beating
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=3000",
                  "--worker-timeout", "2", env={"OCTO_HOME": str(tmp_path)}) as server:
        status, body = server.post_json("/v1/chat/completions", _chat("slow but fine", max_tokens=2))
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert server.get_json("/health")["worker"]["hangs"] == 0


def test_the_gateway_holds_the_queue_deadline_of_a_stopped_worker(tmp_path):
    # --worker-timeout 30 (the longest bound) and --queue-timeout 1: the gateway answers 504 itself at the deadline
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "--worker-timeout", "30",
                  "--queue-timeout", "1", env={"OCTO_HOME": str(tmp_path)}) as server:
        pid = server.get_json("/health")["worker"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            status, body = server.post_json("/v1/chat/completions", _chat("hello"))
            assert status == 504 and body["error"]["code"] == "queue_timeout", body
            assert 1.0 <= time.monotonic() - t0 < 4.0
            _gateway_routes_answer(server)
        finally:
            os.kill(pid, signal.SIGCONT)
        status, body = server.post_json("/v1/chat/completions", _chat("hello again"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello again"


def _fallback_memos(home: Path) -> list[Path]:
    return list(home.rglob("fallback-*.json"))


def test_an_outside_sigkill_of_a_fresh_worker_is_not_blamed_on_its_configuration(tmp_path):
    home = tmp_path / "home"
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, env={"OCTO_HOME": str(home)}) as server:
        pid = server.get_json("/health")["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)  # the OOM killer or an operator, before the worker ran a single request
        deadline = time.monotonic() + 10
        while server.get_json("/health")["state"] == "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "SIGKILL" in server.get_json("/health")["reason"]
        status, body = server.post_json("/v1/chat/completions", _chat("still me"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "still me"
        worker = server.get_json("/health")["worker"]
        assert worker["fallback"] is None and worker["restarts"] == 1  # the same configuration
        assert "serving with safe=true" not in server.log()
    assert _fallback_memos(home) == []


def test_a_sigkill_at_load_keeps_the_configuration_and_says_why(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(RuntimeError) as e:
        with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=load", "-o", "how=kill",
                      env={"OCTO_HOME": str(home)}, timeout=60):
            pass
    log = str(e.value)
    assert "trying the same configuration once more" in log and "OOM killer" in log
    assert "serving with safe=true" not in log
    assert _fallback_memos(home) == []


def test_a_model_that_crashes_twice_retries_after_a_back_off_or_at_once_on_load(tmp_path):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=step", "-o", "safe=false",
                  env={"OCTO_HOME": str(tmp_path)}) as server:
        for _ in range(2):  # a crash, a restart, a crash again within 60 s
            status, body = server.post_json("/v1/chat/completions", _chat("CRASH now please"))
            assert status == 502 and body["error"]["code"] == "engine_crashed"
        status, body = server.post_json("/v1/chat/completions", _chat("hello"))
        err = body["error"]
        assert status == 503 and err["code"] == "model_failed" and "tried again in" in err["message"], err
        health = server.get_json("/v1/models")["data"][0]
        assert health["state"] == "failed" and "retried in 10 s" in health["reason"]
        status, body = server.post_json("/v1/models/m/load", {})  # retried at once
        assert status == 200 and body["state"] == "ready", body
        assert server.post_json("/v1/chat/completions", _chat("hello"))[0] == 200
        # crashing again at once: failed for twice as long; the back-off passes by itself too
        assert server.post_json("/v1/chat/completions", _chat("CRASH again"))[0] == 502
        status, body = server.post_json("/v1/chat/completions", _chat("hello"))
        assert status == 503 and "retried in 20 s" in body["error"]["message"]
        retry = int(body["error"]["message"].split("tried again in ")[1].split(" s")[0])
        assert 15 <= retry <= 20
        time.sleep(retry + 0.5)
        status, body = server.post_json("/v1/chat/completions", _chat("hello"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello"


def test_loading_a_model_that_stays_failed_is_never_a_200(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with run_octo("e", "--engine", "echo", "--models-dir", str(tmp_path)) as server:
        for _ in range(2):  # the second is tried again at once, not answered from the back-off
            status, body = server.post_json(f"/v1/models/{bad}/load", {})
            assert status == 503 and body["error"]["code"] == "model_failed" and "broken.gguf" in str(body)
        assert server.log().count("broken.gguf' failed") == 2


def test_requests_wait_for_the_load_they_trigger_not_their_queue_timeout(tmp_path):
    # a model that takes 6 s to load, a 2 s queue time-out, 8 clients at once: each waits for the load (up to
    # --load-timeout), then is served; meanwhile /health, /v1/models and the dashboard feed show the load
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=6", "--queue-timeout", "2",
                  env={"OCTO_HOME": str(tmp_path)}, timeout=120) as server:
        assert server.post_json("/v1/models/m/unload", {})[0] == 200
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            t0 = time.monotonic()
            futures = [pool.submit(server.post_json, "/v1/chat/completions", _chat(f"client {i}")) for i in range(8)]
            time.sleep(2.5)
            models = server.get_json("/v1/models")["data"][0]
            assert models["state"] == "loading" and models["loading_s"] > 1 and models["waiting"] == 8, models
            health = server.get_json("/health")
            assert {"id": "m", "state": "loading"}.items() <= health["models"][0].items(), health
            feed = asyncio.run(_one_feed_sample(server.base_url))
            assert feed["models"]["m"]["state"] == "loading" and feed["models"]["m"]["loading_s"] > 1, feed
            results = [f.result(timeout=60) for f in futures]
        assert [s for s, _ in results] == [200] * 8, results
        assert [b["choices"][0]["message"]["content"] for _, b in results] == [f"client {i}" for i in range(8)]
        assert time.monotonic() - t0 >= 5


def test_a_load_past_load_timeout_is_given_up_naming_it(tmp_path):
    with pytest.raises(RuntimeError) as e:
        with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "load_s=20", "--load-timeout", "3",
                      env={"OCTO_HOME": str(tmp_path)}, timeout=60):
            pass
    assert "hung while loading 'm' (no answer in 3 s, --load-timeout)" in str(e.value)


async def _one_feed_sample(base: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/dashboard/live") as r:
            async for raw in r.content:
                if raw.startswith(b"data:"):
                    return json.loads(raw[5:])
    raise AssertionError("no sample")
