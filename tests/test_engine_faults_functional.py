"""A faulty engine plugin costs only the request it fails (real `octo serve` processes, in the gateway and in a worker).

Every method of the engine contract besides ``step`` and ``token_bytes`` (tests/test_faults_functional.py) misbehaves
on purpose when a prompt or input holds a fault word (tests/plugins/faulty.py): it raises, answers the wrong type,
an impossible token id, a wrong length, NaN, or never returns. The faulted request gets a clear error in the API's
shape; requests running beside it complete; the queue returns to idle.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
from serverproc import REPO, run_octo
from test_faults_functional import WORDS, _chat, _idle, _stream

PLUGINS = str(REPO / "tests" / "plugins")
SERVE = ("m", "--engine", "faulty", "--plugins-dir", PLUGINS)


@pytest.fixture(scope="module", params=["thread", "process"])
def faulty(request):
    with run_octo(*SERVE, "--isolation", request.param, "-o", "token_delay_ms=10") as server:
        yield server


def _beside_healthy(server, bad: dict) -> tuple[dict, list[dict]]:
    """Stream ``bad`` with three healthy streams running beside it."""
    async def go():
        async with aiohttp.ClientSession() as s:
            bodies = [bad] + [_chat(f"{WORDS} {i}") for i in range(3)]
            return await asyncio.wait_for(asyncio.gather(*(_stream(s, server.base_url, b) for b in bodies)), 20)

    first, *good = asyncio.run(go())
    for i, r in enumerate(good):
        assert r["error"] is None and r["finish"] == "stop" and r["text"] == f"{WORDS} {i}", r
    return first, good


@pytest.mark.parametrize("fault,says", [
    ("TOKFAIL", "cannot tokenize"), ("TOKNONE", "NoneType"), ("TOKNEG", "token id -3"),
    ("RENDERFAIL", "cannot render"), ("RENDERNONE", "NoneType"), ("ADDFAIL", "cannot add this sequence"),
    ("NEGTOK", "token id -1"), ("STRTOK", "not a token id"), ("EMPTYTOK", "step contract")])
def test_an_engine_method_that_fails_fails_its_request_alone(faulty, fault, says):
    bad, _ = _beside_healthy(faulty, _chat(f"one two {fault} three four five"))
    err = bad["error"]  # a 500 before the stream, or an error event in it: never a hang
    assert err["code"] == "engine_error" and err["type"] == "server_error" and says in err["message"], bad
    assert "Traceback" not in err["message"] and bad.get("finish") is None
    status, body = faulty.post_json("/v1/chat/completions", _chat(f"again {fault} please"))
    assert status == 500 and body["error"]["code"] == "engine_error"
    assert (_idle(faulty)["active"], _idle(faulty)["pending"]) == (0, 0)
    assert faulty.get_status("/health")[0] == 200


def test_logprobs_the_engine_gets_wrong_fail_that_request_alone(faulty):
    bad, _ = _beside_healthy(faulty, _chat("one two LPBAD three four five", logprobs=True, top_logprobs=1))
    assert bad["error"]["code"] == "engine_error" and bad.get("finish") is None, bad
    assert _idle(faulty)["active"] == 0


def test_kv_cache_full_from_an_engine_without_a_pool_fails_the_step_not_forever(faulty):
    # preempting frees nothing when the engine has no shared KV pool: before, two such sequences took turns being
    # preempted and resumed forever
    async def go():
        async with aiohttp.ClientSession() as s:
            bodies = [_chat(f"one two KVFULL three {i}") for i in range(2)]
            return await asyncio.wait_for(asyncio.gather(*(_stream(s, faulty.base_url, b) for b in bodies)), 10)

    for r in asyncio.run(go()):
        assert r["error"]["code"] == "kv_cache_full" and r.get("finish") is None, r  # a 500, or an error event
    assert _idle(faulty)["active"] == 0
    assert faulty.post_json("/v1/chat/completions", _chat("still here"))[0] == 200


@pytest.mark.parametrize("fault", ["SAVEFAIL", "SAVEBAD", "SAVEWRONG", "SAVENEG", "FREEFAIL", "RESTOREOVER",
                                   "REMOVEFAIL"])
def test_a_prefix_cache_call_that_fails_never_costs_a_request(faulty, fault):
    text = f"seven eight nine {fault} ten eleven"
    for _ in range(3):  # the second and third look the prefix up, restore it, replace the entry (free the old)
        status, body = faulty.post_json("/v1/chat/completions", _chat(text))
        assert status == 200 and body["choices"][0]["message"]["content"] == text, body
        assert body["choices"][0]["finish_reason"] == "stop"
    assert _idle(faulty)["active"] == 0
    assert faulty.post_json("/v1/chat/completions", _chat("still here"))[0] == 200
    cache = faulty.get_json("/v1/cache/stats")
    assert cache["bytes"] >= 0, cache  # a handle the index would mis-count or mis-serve is not kept


@pytest.mark.parametrize("fault,says", [
    ("EMBEDFAIL", "cannot embed"), ("EMBEDNAN", "not finite"), ("EMBEDDIM", "3 dimensions"),
    ("EMBEDFEW", "1 vectors for 2 inputs"), ("EMBEDNONE", "NoneType")])
def test_embeddings_the_engine_gets_wrong_are_a_500_not_a_bad_answer(faulty, fault, says):
    client = faulty.openai(max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.embeddings.create(model="m", input=[f"a {fault} b", "c d"])
    err = e.value.body
    assert e.value.status_code == 500 and err["code"] == "engine_error" and says in err["message"], err
    good = client.embeddings.create(model="m", input=["c d", "e f"])
    assert [len(d.embedding) for d in good.data] == [64, 64]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_engine_call_between_steps_that_never_returns_is_a_wedge(isolation):
    # it returns after 6.5 s (the test's server can then stop), detected as stuck after 5 s
    with run_octo(*SERVE, "--isolation", isolation, "-o", "token_delay_ms=5", "-o", "slow_s=6.5") as server:
        t0 = time.monotonic()
        status, body = server.post_json("/v1/chat/completions", _chat("one two REMOVEHANG three"))
        assert status == 503 and body["error"]["code"] == "model_failed" and "stuck" in body["error"]["message"]
        assert time.monotonic() - t0 < 8
        if isolation == "thread":  # a thread cannot be stopped: the model says it is down
            status, health = server.get_status("/health")
            assert status == 503 and health["state"] == "wedged"
        else:  # the worker stopped itself; the next request reloads the model
            deadline = time.monotonic() + 5
            while server.get_json("/health")["state"] == "ready" and time.monotonic() < deadline:
                time.sleep(0.05)  # the worker's exit is seen just after
            status, body = server.post_json("/v1/chat/completions", _chat("hello again"))
            assert status == 200 and body["choices"][0]["message"]["content"] == "hello again"


def test_an_engine_loop_that_fails_every_iteration_takes_the_model_down():
    with run_octo(*SERVE, "--isolation", "thread", "-o", "kv_room=fail") as server:
        for _ in range(4):  # every request fails at once (no spinning until the queue time-out), then for good
            status, body = server.post_json("/v1/chat/completions", _chat("hello"))
            assert status in (500, 503) and body["error"]["code"] in ("engine_error", "model_failed"), body
        status, health = server.get_status("/health")
        assert status == 503 and health["state"] == "failed" and "count its KV cells" in health["reason"]


def test_model_info_that_cannot_serve_is_refused_at_load():
    out = subprocess.run([sys.executable, "-m", "octo.cli", "serve", *SERVE, "--isolation", "thread",
                          "-o", "info=bad", "--port", "1"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode != 0 and "no usable model info" in out.stderr + out.stdout


def test_a_tokenizer_that_never_returns_costs_the_worker_not_the_server():
    # in a worker, the chat template and tokenizer run on its event loop: the request is never admitted, so the
    # gateway answers 504 itself at the queue time-out; blocked past that (at least 5 s), the worker goes and the
    # next request reloads the model (the gateway answers /health all along)
    with run_octo(*SERVE, "--isolation", "process", "--queue-timeout", "1", "-o", "slow_s=30") as server:
        t0 = time.monotonic()
        status, body = server.post_json("/v1/chat/completions", _chat("one two TOKSLOW three"))
        assert status == 504 and body["error"]["code"] == "queue_timeout", body
        assert time.monotonic() - t0 < 4
        while server.get_json("/health")["state"] == "ready" and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert "blocked" in server.get_json("/health")["reason"]
        status, body = server.post_json("/v1/chat/completions", _chat("hello again"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello again"


def test_a_tokenizer_that_never_returns_in_the_gateway_is_a_503_not_a_dead_server():
    # in the gateway (--isolation thread) the chat template and tokenizer run off the event loop, timed (at least
    # 5 s): past that the request is a 503, the model says it is wedged and refuses requests at once while the call
    # runs on; every other route answers meanwhile, and the model serves again once the call returns
    with run_octo(*SERVE, "--isolation", "thread", "--queue-timeout", "1", "-o", "slow_s=9") as server:
        async def go():
            async with aiohttp.ClientSession() as s:
                async def health_while() -> list[float]:
                    took = []
                    for _ in range(10):
                        t = time.monotonic()
                        async with s.get(server.url("/health")) as r:
                            await r.read()
                        took.append(time.monotonic() - t)
                        await asyncio.sleep(0.4)
                    return took

                async def slow() -> tuple[int, dict]:
                    async with s.post(server.url("/v1/chat/completions"), json=_chat("one two TOKSLOW three")) as r:
                        return r.status, await r.json()

                return await asyncio.gather(slow(), health_while())

        t0 = time.monotonic()
        (status, body), health = asyncio.run(go())
        assert status == 503 and body["error"]["code"] == "model_failed" and "stuck" in body["error"]["message"]
        assert 4.5 < time.monotonic() - t0 < 8 and max(health) < 1.0, health  # the loop never stopped
        status, health = server.get_status("/health")
        assert status == 503 and health["state"] == "wedged"
        t = time.monotonic()
        status, body = server.post_json("/v1/chat/completions", _chat("hello"))
        assert status == 503 and body["error"]["code"] == "model_failed" and time.monotonic() - t < 1
        deadline = time.monotonic() + 15  # the stuck call returns after 9 s: serving again
        while server.get_status("/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = server.post_json("/v1/chat/completions", _chat("hello again"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello again"
