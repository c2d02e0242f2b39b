"""Admission queue (503 + Retry-After, 504), disconnects freeing slots, and API keys, on a real server."""

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest
from serverproc import run_octo


def words(n):
    return " ".join(f"w{i}" for i in range(n))


def body(n_words, stream=False, **kw):
    return {"model": "m", "messages": [{"role": "user", "content": words(n_words)}], "stream": stream, **kw}


def stats(server):
    return json.loads(urllib.request.urlopen(server.url("/v1/queue/stats")).read())


async def test_overload_gives_503_with_retry_after_and_nothing_else():
    with run_octo("m", "--engine", "echo", "--max-batch", "1", "--max-queue", "1",
                  "-o", "token_delay_ms=40") as server:
        async with aiohttp.ClientSession() as s:
            async def one(stream):
                async with s.post(server.url("/v1/chat/completions"), json=body(5, stream)) as r:
                    text = await r.text()
                    return r.status, r.headers.get("Retry-After"), text

            results = await asyncio.gather(*(one(i % 2 == 1) for i in range(8)))
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 503}, results
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1
        for status, retry, text in results:
            if status == 503:
                assert retry is not None and int(retry) >= 1
                assert json.loads(text)["error"]["code"] == "queue_full"
            else:
                assert "w0 w1 w2 w3 w4" in text or "w4" in text
        q = stats(server)
        assert q["total_rejected"] == statuses.count(503) and q["max_depth"] == 1


async def test_queue_timeout_is_504():
    with run_octo("m", "--engine", "echo", "--max-batch", "1", "--queue-timeout", "0.3",
                  "-o", "token_delay_ms=100") as server:
        async with aiohttp.ClientSession() as s:
            slow = asyncio.create_task(s.post(server.url("/v1/chat/completions"), json=body(15)))
            await asyncio.sleep(0.2)
            async with s.post(server.url("/v1/chat/completions"), json=body(2, stream=True)) as r:
                assert r.status == 504
                assert (await r.json())["error"]["code"] == "queue_timeout"
            (await slow).release()
        assert stats(server)["total_timeouts"] == 1


async def test_abandoned_stream_frees_the_only_slot():
    with run_octo("m", "--engine", "echo", "--max-batch", "1", "-o", "token_delay_ms=100") as server:
        async with aiohttp.ClientSession() as s:
            r = await s.post(server.url("/v1/chat/completions"), json=body(200, stream=True))
            assert r.status == 200
            await r.content.readline()  # the stream has started
            r.close()  # client goes away after ~1 token of a 20 s answer
        t0 = time.monotonic()
        client = server.openai()
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a b"}])
        assert out.choices[0].message.content == "a b"
        assert time.monotonic() - t0 < 3.0
        q = stats(server)
        assert q["active"] == 0 and q["total_cancelled"] == 1


def test_api_key():
    with run_octo("m", "--engine", "echo", api_key="s3cret") as server:
        assert urllib.request.urlopen(server.url("/health")).status == 200
        for path in ("/v1/models", "/v1/engines"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(server.url(path))
            assert e.value.code == 401 and json.loads(e.value.read())["error"]["type"] == "authentication_error"
        assert server.openai().models.list().data[0].id == "m"
        bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


def test_refuses_public_bind_without_key():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "octo.cli", "serve", "m", "--engine", "echo", "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--api-key" in out.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_event_loop_choice(loop):
    with run_octo("m", "--engine", "echo", "--loop", loop) as server:
        reply = server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "a b"}])
        assert reply.choices[0].message.content == "a b"
        assert f"{loop} loop" in server.log()
