"""KV pressure through a real `octo serve`: requests that each fit the context alone all finish, whatever runs beside
them, when together they need far more KV cells than the shared pool holds (the scheduler preempts and resumes).

echo with ``-o kv_cells=N`` is a scripted engine with a llama.cpp-like shared pool: its output is known, so every
stream must be exactly its message, with no token lost or repeated across preemptions. The llama.cpp case is the
issue's scenario on the tiny synthetic model: two long generations (and one with n=2) in a pool that holds one.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from serverproc import run_octo

MESSAGES = [" ".join(f"m{i}w{j}" for j in range(40)) for i in range(8)]  # each ~45 prompt + 40 reply tokens


async def _stream(session, base: str, body: dict) -> dict:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    async with session.post(f"{base}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            assert "error" not in data, data
            for ch in data["choices"]:
                texts.setdefault(ch["index"], []).append(ch["delta"].get("content") or "")
                if ch.get("finish_reason"):
                    finish[ch["index"]] = ch["finish_reason"]
    return {i: ("".join(t), finish.get(i)) for i, t in texts.items()}


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("preempt", ["swap", "recompute"])
def test_streams_needing_four_times_the_pool_all_finish_exactly(isolation, preempt):
    with run_octo("m", "--engine", "echo", "-o", "kv_cells=180", "-o", "token_delay_ms=2", "--isolation", isolation,
                  "--preempt", preempt) as server:
        async def go():
            async with aiohttp.ClientSession() as s:
                plain = [{"model": "m", "messages": [{"role": "user", "content": m}]} for m in MESSAGES]
                both = {"model": "m", "messages": [{"role": "user", "content": MESSAGES[0]}], "n": 2}
                return await asyncio.gather(*(_stream(s, server.base_url, b) for b in [*plain, both]))

        *streams, pair = asyncio.run(go())
        for message, out in zip(MESSAGES, streams, strict=True):
            assert out == {0: (message, "stop")}
        assert pair == {0: (MESSAGES[0], "stop"), 1: (MESSAGES[0], "stop")}
        q = server.get_json("/v1/queue/stats")
        assert q["total_preemptions"] > 0 and q["total_resumed"] == q["total_preemptions"]
        assert (q["active"], q["pending"], q["preempted"]) == (0, 0, 0)
        # a request that cannot fit even alone is a 400 before any work
        status, body = server.post_json("/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": MESSAGES[0]}], "max_tokens": 150})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_llamacpp_long_generations_beyond_the_shared_pool_all_finish():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from octo.synth.gguf import build_gguf

    path = str(build_gguf("tiny", ftype="q8_0"))
    with run_octo(path, "--engine", "llamacpp", "-o", "n_ctx=512", "-o", "kv_cells=512") as server:
        client = server.openai()
        eos = server.get_json("/v1/engines")
        assert eos  # the model is up
        from octo.synth.tokenizer import special_ids

        ban = {str(special_ids()[t]): -100 for t in ("<|im_end|>", "<|endoftext|>")}

        async def go():
            aclient = server.async_openai()
            one = [aclient.chat.completions.create(model="tiny-q8_0", max_tokens=400, temperature=0, logit_bias=ban,
                                                   messages=[{"role": "user", "content": f"Story number {i}"}])
                   for i in range(2)]
            pair = aclient.chat.completions.create(model="tiny-q8_0", max_tokens=450, temperature=0.7, seed=3, n=2,
                                                   logit_bias=ban, messages=[{"role": "user", "content": "Go on"}])
            return await asyncio.gather(*one, pair)

        *singles, pair = asyncio.run(go())
        for r in [*singles, pair]:
            for ch in r.choices:
                assert ch.finish_reason == "length"
            assert r.usage.completion_tokens == len(r.choices) * (400 if r is not pair else 450)
        assert server.get_json("/v1/queue/stats")["total_preemptions"] >= 1
        assert client.chat.completions.create(model="tiny-q8_0", max_tokens=4,
                                              messages=[{"role": "user", "content": "ok"}]).choices
