"""Faults stay contained (real `octo serve` processes, model in the gateway and in a worker process).

The fault-injection engine (tests/plugins/faulty.py) fails on purpose when a prompt holds a fault word: SEQFAIL (the
step returns an exception for that sequence), STEPFAIL (the step raises), BYTESFAIL (``token_bytes`` raises), HANG
(the step never returns). Also here: abandoned clients, a client that stops reading, graceful shutdown.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import aiohttp
import pytest
from serverproc import REPO, rss_tree, run_octo

PLUGINS = str(REPO / "tests" / "plugins")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa"


def _chat(text: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


async def _stream(session, base: str, body: dict) -> dict:
    """A streamed chat: its text, finish reason and error event, if any."""
    text, finish, error = [], None, None
    async with session.post(f"{base}/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            return {"status": r.status, "error": (await r.json())["error"]}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                error = data["error"]
            for ch in data.get("choices", []):
                text.append(ch["delta"].get("content") or "")
                finish = ch.get("finish_reason") or finish
    return {"status": 200, "text": "".join(text), "finish": finish, "error": error}


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", params=["thread", "process"])
def faulty(request):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "--isolation", request.param,
                  "-o", "token_delay_ms=20", "--max-queue", "256") as server:
        yield server


def _idle(server, within: float = 1.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        q = server.get_json("/v1/queue/stats")
        if (q["active"], q["pending"]) == (0, 0) or time.monotonic() > deadline:
            return q
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["SEQFAIL", "BYTESFAIL"])
def test_a_sequence_the_engine_fails_fails_alone(faulty, fault):
    async def go():
        async with aiohttp.ClientSession() as s:
            bodies = [_chat(f"{WORDS} {i}") for i in range(3)] + [_chat(f"one two {fault} three four five")]
            return await asyncio.gather(*(_stream(s, faulty.base_url, b) for b in bodies))

    *good, bad = _run(go())
    for i, r in enumerate(good):
        assert r["error"] is None and r["finish"] == "stop" and r["text"] == f"{WORDS} {i}"
    assert bad["error"]["code"] == "engine_error" and bad["finish"] is None
    assert "faulty engine" in bad["error"]["message"]
    assert _idle(faulty)["active"] == 0
    assert faulty.post_json("/v1/chat/completions", _chat("still here"))[0] == 200


def test_a_step_that_raises_fails_its_batch_with_a_clear_500(faulty):
    status, body = faulty.post_json("/v1/chat/completions", _chat("one two STEPFAIL three four"))
    assert status == 500 and body["error"]["code"] == "engine_error" and "failed this step" in body["error"]["message"]
    assert faulty.post_json("/v1/chat/completions", _chat("still here"))[0] == 200
    assert faulty.get_json("/v1/queue/stats")["engine_thread"] == "ok"


def test_abandoned_streams_and_requests_are_cancelled_within_a_second(faulty):
    before = faulty.get_json("/v1/queue/stats")["total_cancelled"]
    long_text = " ".join(f"w{i}" for i in range(400))  # 400 tokens at 20 ms a step: 8 s if nobody cancels

    async def abandon_stream(s):
        async with s.post(f"{faulty.base_url}/v1/chat/completions", json=_chat(long_text, stream=True)) as r:
            assert r.status == 200
            await r.content.readline()  # the first chunk, then the client goes away

    async def abandon_plain(s):
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(f"{faulty.base_url}/v1/chat/completions", json=_chat(long_text),
                              timeout=aiohttp.ClientTimeout(total=0.3)):
                pass

    async def go(fn):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as s:
            await asyncio.gather(*(fn(s) for _ in range(100)))

    for fn in (abandon_stream, abandon_plain):
        _run(go(fn))
        t0 = time.monotonic()
        q = _idle(faulty, within=1.0)
        assert (q["active"], q["pending"]) == (0, 0), (fn.__name__, q, time.monotonic() - t0)
    assert faulty.get_json("/v1/queue/stats")["total_cancelled"] - before == 200


def _settled_rss(server, within: float = 15.0) -> int:
    """The server's resident memory once its one-time deferred work is done: /v1/models starts the catalog scan
    (else 3 s after the start; it imports huggingface_hub), then memory must hold within 1 MB for a second."""
    assert server.get_json("/v1/models")["data"]
    pid, deadline = server.proc.pid, time.monotonic() + within
    samples = [rss_tree(pid)]
    while time.monotonic() < deadline:
        time.sleep(0.25)
        samples.append(rss_tree(pid))
        if len(samples) >= 5 and max(samples[-5:]) - min(samples[-5:]) < 2**20:
            break
    return samples[-1]


def test_a_client_that_stops_reading_holds_neither_memory_nor_the_others(faulty):
    big = " ".join(f"word{i}" for i in range(3000))
    body = json.dumps(_chat(big, stream=True, max_tokens=3000)).encode()
    pid = faulty.proc.pid
    rss0 = _settled_rss(faulty)
    sock = socket.create_connection(("127.0.0.1", faulty.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:  # it never reads; meanwhile a normal request is as fast as ever
        time.sleep(0.5)
        t0 = time.monotonic()
        status, out = faulty.post_json("/v1/chat/completions", _chat("quick one"))
        assert status == 200 and out["choices"][0]["message"]["content"] == "quick one"
        assert time.monotonic() - t0 < 2.0
        time.sleep(2)
        assert rss_tree(pid) - rss0 < 64 * 2**20
    finally:
        sock.close()
    assert _idle(faulty, within=2.0)["active"] == 0  # closing the socket cancels its sequence


def test_a_wedged_engine_thread_is_reported_and_the_model_comes_back(faulty):
    async def go():
        async with aiohttp.ClientSession() as s:
            hang = asyncio.ensure_future(_stream(s, faulty.base_url, _chat("one two HANG three four five")))
            other = asyncio.ensure_future(_stream(s, faulty.base_url, _chat(WORDS)))
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(hang, other), 30)
            return results, time.monotonic() - t0

    (hang, other), took = _run(go())
    for r in (hang, other):  # both were stuck in the wedged step: a 503 error event, not a hang
        assert r["error"]["code"] == "model_failed" and "stuck" in r["error"]["message"], r
    assert took < 15
    status, health = faulty.get_status("/health")
    isolation = faulty.get_json("/v1/engines")["isolation"]
    if isolation == "thread":  # a thread cannot be stopped: the model stays down, said so, 503 at once
        assert status == 503 and health["state"] == "wedged" and "stuck" in health["reason"]
        t0 = time.monotonic()
        code, body = faulty.post_json("/v1/chat/completions", _chat("hello"))
        assert code == 503 and body["error"]["code"] == "model_failed" and time.monotonic() - t0 < 1
    else:  # the worker stopped itself; the next request reloads the model in a fresh one
        deadline = time.monotonic() + 5
        while health["state"] == "ready" and time.monotonic() < deadline:  # the worker's exit is seen just after
            time.sleep(0.05)
            health = faulty.get_json("/health")
        assert health["state"] in ("crashed", "loading") and "stuck" in health["reason"]
        code, body = faulty.post_json("/v1/chat/completions", _chat("hello again"))
        assert code == 200 and body["choices"][0]["message"]["content"] == "hello again"
        assert faulty.get_status("/health")[0] == 200


def test_graceful_shutdown_finishes_running_work_and_refuses_new():
    with run_octo("m", "--engine", "echo", "-o", "token_delay_ms=20", "--shutdown-timeout", "10") as server:
        async def go():
            async with aiohttp.ClientSession() as s:
                running = asyncio.ensure_future(_stream(s, server.base_url, _chat(WORDS * 3)))
                await asyncio.sleep(0.2)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with s.post(f"{server.base_url}/v1/chat/completions", json=_chat("new")) as r:
                    refused = (r.status, await r.json())
                return await running, refused

        running, (status, body) = _run(go())
        assert running["finish"] == "stop" and running["text"] == WORDS * 3 and running["error"] is None
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        assert server.proc.wait(10) == 0


def test_graceful_shutdown_cancels_what_outlives_the_timeout():
    with run_octo("m", "--engine", "echo", "-o", "token_delay_ms=50", "--shutdown-timeout", "0.5") as server:
        async def go():
            async with aiohttp.ClientSession() as s:
                running = asyncio.ensure_future(_stream(s, server.base_url, _chat(WORDS * 20)))
                await asyncio.sleep(0.3)
                server.proc.send_signal(signal.SIGTERM)
                return await running

        t0 = time.monotonic()
        r = _run(go())
        assert r["error"]["code"] == "server_shutting_down" and "shutting down" in r["error"]["message"]
        assert time.monotonic() - t0 < 5
        assert server.proc.wait(10) == 0
