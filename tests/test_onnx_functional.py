"""`octo serve FOLDER --engine onnx` as a real process, driven by the official openai SDK: streaming equals
non-streaming, concurrent requests equal single ones, a disconnected stream leaves the batch, the prefix cache
reuses a conversation's KV (and the reply equals the uncached one), response_format and logprobs work (and a bad
logit_bias is a 400 naming it), and the og.Generator batch-window backend serves too. Uses the tiny synthetic
onnxruntime-genai folder."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'octo[onnx]')")
for _mod in ("torch", "transformers", "onnx_ir"):
    pytest.importorskip(_mod, reason=f"{_mod} is needed by onnxruntime-genai's model builder")
openai = pytest.importorskip("openai")

from serverproc import (  # noqa: E402
    QUESTIONS,
    check_stop_string_and_max_tokens,
    run_octo,
)
from serverproc import chat_messages as _msgs  # noqa: E402


@pytest.fixture(scope="module")
def folder() -> str:
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="int4"))


@pytest.fixture(scope="module")
def server(folder):
    with run_octo(folder, "--engine", "onnx", "--max-batch", "4") as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.openai().models.list().data[0].id




def _local_reply(folder: str, messages: list[dict], max_tokens: int) -> str:
    """The same request run in-process on a fresh engine (no prefix cache): the reference reply."""
    from test_onnx import generate, make_engine

    e = make_engine(folder)
    prompt = e.tokenize(e.render_chat(messages))
    out = generate(e, [prompt], max_tokens)[0]
    eos = [i for i, t in enumerate(out) if t in e.info.eos_token_ids]
    out = out[:eos[0]] if eos else out
    text = b"".join(e.token_bytes(t) for t in out).decode("utf-8", "replace")
    e.unload()
    return text


def test_engine_is_onnx(server):
    body = server.get_json("/v1/engines")
    rows = {r["name"]: r for r in body["data"]}
    assert body["active"] == "onnx" and rows["onnx"]["active"] and rows["onnx"]["available"]
    assert "onnxruntime" in rows["onnx"]["reason"]
    assert server.get_json("/v1/queue/stats")["batching"] == "continuous"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}])
def test_streaming_equals_non_streaming(server, model, sampling):
    client = server.openai()
    r = client.chat.completions.create(model=model, messages=_msgs(QUESTIONS[0]), max_tokens=24, **sampling)
    full = r.choices[0].message.content
    chunks = client.chat.completions.create(model=model, messages=_msgs(QUESTIONS[0]), max_tokens=24,
                                            stream=True, **sampling)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full and full
    r = client.completions.create(model=model, prompt="The old lighthouse", max_tokens=24, **sampling)
    chunks = client.completions.create(model=model, prompt="The old lighthouse", max_tokens=24, stream=True,
                                       **sampling)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert r.usage.completion_tokens == 24


def test_greedy_reply_equals_engine_in_process(server, model, folder):
    r = server.openai().chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                                max_tokens=20, temperature=0)
    assert r.choices[0].message.content == _local_reply(folder, [{"role": "user", "content": "Hi there"}], 20)


def test_concurrent_requests_equal_single(server, model):
    client = server.openai()
    single = [client.chat.completions.create(model=model, messages=_msgs(q), max_tokens=20, temperature=0)
              .choices[0].message.content for q in QUESTIONS]

    async def together():
        aclient = server.async_openai()
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model=model, messages=_msgs(q), max_tokens=20 + 5 * i, temperature=0) for i, q in enumerate(QUESTIONS)))
        return [r.choices[0].message.content for r in rs]

    together_out = asyncio.run(together())
    assert [t.startswith(s) for t, s in zip(together_out, single, strict=True)] == [True] * 4


def test_disconnected_stream_leaves_the_batch(server, model):
    before = server.get_json("/v1/queue/stats")["total_cancelled"]

    async def go():
        aclient = server.async_openai()
        stream = await aclient.chat.completions.create(model=model, messages=_msgs(QUESTIONS[2]), max_tokens=1500,
                                                       stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.get_json("/v1/queue/stats")
        if stats["active"] == 0 and stats["total_cancelled"] > before:
            break
        time.sleep(0.05)
    assert stats["active"] == 0 and stats["total_cancelled"] == before + 1


def test_prefix_cache_reuses_a_conversation(server, model, folder):
    client = server.openai()
    before = server.get_json("/v1/cache/stats")
    first = _msgs("A first question about ships?")
    r1 = client.chat.completions.create(model=model, messages=first, max_tokens=8, temperature=0)
    turn2 = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And the lamp?"}]
    r2 = client.chat.completions.create(model=model, messages=turn2, max_tokens=16, temperature=0)
    after = server.get_json("/v1/cache/stats")
    assert after["enabled"] and after["hits"] > before["hits"] and after["bytes"] > 0
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 40 and after["tokens_reused"] - before["tokens_reused"] >= cached
    assert r2.choices[0].message.content == _local_reply(folder, turn2, 16)


def test_response_format_logprobs_echo_and_bad_logit_bias(server, model):
    """Constrained output (the shared llguidance layer hands the engine a mask), with logprobs; completions echo +
    logprobs (prompt logprobs); a logit_bias outside the vocabulary is a 400 naming it."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    client = server.openai()
    r = client.chat.completions.create(
        model=model, messages=_msgs("hi"), max_tokens=300, temperature=0, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    reply = json.loads(r.choices[0].message.content)
    assert set(reply) == {"name", "ok"} and isinstance(reply["ok"], bool) and len(reply["name"]) <= 8
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    c = client.completions.create(model=model, prompt="The old lighthouse stood", max_tokens=3, echo=True,
                                  logprobs=2, temperature=0)
    lps = c.choices[0].logprobs.token_logprobs
    assert lps[0] is None and all(v is not None and v <= 0 for v in lps[1:]) and len(lps) >= 5
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=_msgs("hi"), logit_bias={"999999": 5})
    assert "logit_bias" in str(e.value)


def test_stop_string_and_max_tokens(server, model):
    check_stop_string_and_max_tokens(server, model)


def test_generator_backend_serves_in_windows(folder, server, model):
    reference = server.openai().chat.completions.create(model=model, messages=_msgs(QUESTIONS[1]), max_tokens=16,
                                                        temperature=0).choices[0].message.content
    with run_octo(folder, "--engine", "onnx", "-o", "backend=generator", "--max-batch", "2") as s:
        assert s.get_json("/v1/queue/stats")["batching"] == "window"
        name = s.openai().models.list().data[0].id

        async def together():
            aclient = s.async_openai()
            rs = await asyncio.gather(*(aclient.chat.completions.create(
                model=name, messages=_msgs(q), max_tokens=16, temperature=0) for q in QUESTIONS[:3]))
            return [r.choices[0].message.content for r in rs]

        assert asyncio.run(together())[1] == reference
        assert s.get_json("/v1/cache/stats")["hits"] == 0


def test_og_engine_backend_serves(folder, server, model):
    reference = server.openai().chat.completions.create(model=model, messages=_msgs(QUESTIONS[1]), max_tokens=16,
                                                        temperature=0).choices[0].message.content
    with run_octo(folder, "--engine", "onnx", "-o", "backend=engine", "--max-batch", "4") as s:
        engines = s.get_json("/v1/engines")
        row = next(e for e in engines["data"] if e["name"] == "onnx")
        assert row["batching"] == "continuous" and row["model"]["batching"] == "continuous:og.Engine"
        assert "og.Engine" in row["model"]["backend"]
        name = s.openai().models.list().data[0].id

        async def together():
            aclient = s.async_openai()
            rs = await asyncio.gather(*(aclient.chat.completions.create(
                model=name, messages=_msgs(q), max_tokens=16, temperature=0) for q in QUESTIONS[:3]))
            return [r.choices[0].message.content for r in rs]

        assert asyncio.run(together())[1] == reference
        stream = s.openai().chat.completions.create(model=name, messages=_msgs(QUESTIONS[1]), max_tokens=16,
                                                    temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference
        with pytest.raises(openai.BadRequestError) as e:  # no per-turn seed without paged attention
            s.openai().chat.completions.create(model=name, messages=_msgs(QUESTIONS[0]), max_tokens=4, seed=1)
        assert e.value.body["param"] == "seed"
        assert s.get_json("/v1/cache/stats")["hits"] == 0
