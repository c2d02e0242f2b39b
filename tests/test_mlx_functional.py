"""`octo serve FOLDER --engine mlx` as a real process, driven by the official openai SDK: streaming equals
non-streaming, batched requests equal single ones, the prefix cache hits on a shared system prompt, response_format
and logprobs work (a bad logit_bias is a 400 naming it), all in an engine worker that loaded mlx-lm without torch.
Uses the tiny synthetic MLX folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")
openai = pytest.importorskip("openai")

from serverproc import (  # noqa: E402
    QUESTIONS,
    SYSTEM,
    check_stop_string_and_max_tokens,
    run_octo,
)
from serverproc import chat_messages as _msgs  # noqa: E402


@pytest.fixture(scope="module")
def folder() -> str:
    from octo.synth.mlx import build_mlx

    return str(build_mlx("tiny"))


@pytest.fixture(scope="module")
def server(folder):
    # the worker `octo serve` starts before its own imports, prepared for MLX alone (--engine mlx), takes the model
    with run_octo(folder, "--engine", "mlx", "--max-batch", "4") as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.openai().models.list().data[0].id


def test_engine_is_mlx(server):
    body = server.get_json("/v1/engines")
    rows = {r["name"]: r for r in body["data"]}
    assert body["active"] == "mlx" and rows["mlx"]["active"] and rows["mlx"]["batching"] == "continuous"
    assert "CPU" in rows["mlx"]["reason"] or "Metal" in rows["mlx"]["reason"]


def test_worker_leaves_torch_out(server):
    """The model's engine worker serves MLX alone: torch, which mlx-lm's tokenizer module pulls in through transformers
    wherever it is installed (about two thirds of the load on a CPU), is not loaded there; every test of this module
    runs against that worker."""
    pytest.importorskip("torch")
    entry = server.get_json("/v1/models")["data"][0]
    assert entry["isolation"] == "process"
    maps = Path(f"/proc/{entry['worker']['pid']}/maps").read_text()
    assert "libmlx" in maps  # the worker that runs the model
    assert "libtorch" not in maps


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}])
def test_streaming_equals_non_streaming(server, model, sampling):
    client = server.openai()
    for kind in ("chat", "completion"):
        if kind == "chat":
            r = client.chat.completions.create(model=model, messages=_msgs(QUESTIONS[0]), max_tokens=24, **sampling)
            full = r.choices[0].message.content
            chunks = client.chat.completions.create(
                model=model, messages=_msgs(QUESTIONS[0]), max_tokens=24, stream=True, **sampling
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.completions.create(model=model, prompt="The old lighthouse", max_tokens=24, **sampling)
            full = r.choices[0].text
            chunks = client.completions.create(
                model=model, prompt="The old lighthouse", max_tokens=24, stream=True, **sampling
            )
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert r.usage.completion_tokens > 0
        assert streamed == full and full


def test_concurrent_requests_equal_single(server, model):
    client = server.openai()
    single = [
        client.chat.completions.create(model=model, messages=_msgs(q), max_tokens=20, temperature=0)
        .choices[0]
        .message.content
        for q in QUESTIONS
    ]

    async def together():
        aclient = server.async_openai()
        rs = await asyncio.gather(
            *(
                aclient.chat.completions.create(model=model, messages=_msgs(q), max_tokens=20, temperature=0)
                for q in QUESTIONS
            )
        )
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == single


def test_prefix_cache_hit_on_shared_system_prompt(server, model, folder):
    from octo.engines.mlx import MLXEngine
    from test_mlx import Driver, chat_tokens  # the in-process engine gives the cache-miss reference

    from octo.engine import EngineConfig

    client = server.openai()
    before = server.get_json("/v1/cache/stats")
    client.chat.completions.create(
        model=model, messages=_msgs("A first question about ships?"), max_tokens=8, temperature=0
    )
    r = client.chat.completions.create(
        model=model, messages=_msgs("A second one, about the lamp."), max_tokens=24, temperature=0
    )
    after = server.get_json("/v1/cache/stats")
    assert after["enabled"] and after["hits"] > before["hits"] and after["bytes"] > 0
    assert r.usage.prompt_tokens_details.cached_tokens > 40

    e = MLXEngine(EngineConfig())
    e.load(folder, "tiny")
    d = Driver(e)
    seq = d.add(chat_tokens(e, "A second one, about the lamp.", SYSTEM), 24)
    d.run()
    want = [t for t in d.generated(seq) if t not in e.info.eos_token_ids]
    assert r.choices[0].message.content == b"".join(e.token_bytes(t) for t in want).decode("utf-8", "replace")


def test_response_format_logprobs_echo_and_bad_logit_bias(server, model):
    """Constrained output (the shared llguidance layer hands the engine a mask), with logprobs; completions echo +
    logprobs (prompt logprobs); a logit_bias outside the vocabulary is a 400 naming it."""
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    client = server.openai()
    r = client.chat.completions.create(
        model=model,
        messages=_msgs("hi"),
        max_tokens=300,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
    )
    reply = json.loads(r.choices[0].message.content)
    assert set(reply) == {"name", "ok"} and isinstance(reply["ok"], bool) and len(reply["name"]) <= 8
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    c = client.completions.create(
        model=model, prompt="The old lighthouse stood", max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    lps = c.choices[0].logprobs.token_logprobs
    assert lps[0] is None and all(v is not None and v <= 0 for v in lps[1:]) and len(lps) >= 5
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=_msgs("hi"), logit_bias={"999999": 5})
    assert "logit_bias" in str(e.value)


def test_stop_string_and_max_tokens(server, model):
    check_stop_string_and_max_tokens(server, model)
