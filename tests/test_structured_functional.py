"""Structured output, constrained tool calls and logprobs through the official openai SDK against a real
`octo serve` on each text engine (llama.cpp, ONNX Runtime GenAI, MLX) with synthetic random-weight models: whatever
the weights, a json_schema answer parses and validates, a required or named tool choice is a valid call whose
arguments validate against the function's parameters, and the deltas of a streamed call reassemble to a valid call.
The constraint lives once in the shared scheduler (octo.text.constrain); each engine only applies the mask."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from serverproc import run_octo  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "kind": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


def _onnx():
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    for mod in ("torch", "transformers", "onnx_ir"):
        pytest.importorskip(mod)
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="int4"))


def _mlx():
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from octo.synth.mlx import build_mlx

    return str(build_mlx("tiny"))


BUILDERS = {"llamacpp": _gguf, "onnx": _onnx, "mlx": _mlx}


@pytest.fixture(scope="module", params=list(BUILDERS))
def server(request):
    artifact = BUILDERS[request.param]()
    with run_octo(artifact, "--engine", request.param, "--max-batch", "8") as s:
        s.engine = request.param
        s.model = s.openai().models.list().data[0].id
        yield s


def _check_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_is_a_valid_call(server, temperature):
    c = server.openai()
    r = c.chat.completions.create(model=server.model, messages=MSG, tools=TOOLS, tool_choice="required",
                                  temperature=temperature, seed=3, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)


def test_named_tool_choice_streams_a_valid_call(server):
    c = server.openai()
    stream = c.chat.completions.create(model=server.model, messages=MSG, tools=TOOLS, temperature=0.8, seed=11,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False, stream=True, max_tokens=200)
    calls, finish = {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0]["name"] == "get_time" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_time"])


def test_eight_concurrent_json_schema_streams_validate(server):
    async def one(c, i):
        stream = await c.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Person {i}?"}], temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                    "schema": PERSON}},
            stream=True, max_tokens=300)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with server.async_openai() as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    for text, finish in asyncio.run(main()):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_on_completions(server):
    r = server.openai().completions.create(model=server.model, prompt="A person as JSON:", max_tokens=300,
                                           temperature=0.9, seed=5, extra_body={"response_format": {
                                               "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_anthropic_output_config_format_validates(server):
    """Anthropic's structured output (``output_config.format``) goes through the same constraint layer."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    m = client.messages.create(model=server.model, max_tokens=300,
                               messages=[{"role": "user", "content": "A person as JSON"}],
                               extra_body={"temperature": 0.9,  # this SDK's create() no longer takes it by name
                                           "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


def test_min_tokens_holds_back_the_end(server):
    """The end-of-sequence tokens made near certain (logit_bias +100): without min_tokens the answer is empty, with
    it exactly min_tokens long (the end is masked until then, then comes at once), on chat and completions."""
    from octo.synth.tokenizer import load_tokenizer

    tok = load_tokenizer()
    bias = {str(tok.token_to_id(t)): 100 for t in ("<|im_end|>", "<|endoftext|>")}
    client = server.openai()
    r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=50, logit_bias=bias)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "stop"
    for n in (1, 6):
        r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=50, logit_bias=bias,
                                           extra_body={"min_tokens": n})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "stop", r
        c = client.completions.create(model=server.model, prompt="Once upon", max_tokens=50, logit_bias=bias,
                                      extra_body={"min_tokens": n})
        assert c.usage.completion_tokens == n and c.choices[0].finish_reason == "stop", c
    # ignore_eos: the end never comes, whatever its bias; max_tokens ends it
    r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=9, logit_bias=bias,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length", r
    c = client.completions.create(model=server.model, prompt="Once upon", max_tokens=9, logit_bias=bias,
                                  extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 9 and c.choices[0].finish_reason == "length", c


def test_json_object_parses(server):
    """Any JSON object: on random weights a free string rarely ends, so the closing quote and brace are favoured
    (logit_bias); the grammar still decides everything else (an object first, keys quoted, values well formed)."""
    from octo.synth.tokenizer import load_tokenizer

    tok = load_tokenizer()
    bias = {str(tok.token_to_id(c)): 6 for c in ('"', "}")}
    r = server.openai().chat.completions.create(model=server.model, messages=MSG, max_tokens=400, temperature=0.9,
                                                seed=2, logit_bias=bias, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_chat_logprobs_shape_and_greedy_agreement(server):
    r = server.openai().chat.completions.create(model=server.model, messages=MSG, logprobs=True, top_logprobs=3,
                                                temperature=0, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1.0 + 1e-4
        assert abs(t.logprob - lps[0]) < 1e-4  # greedy: the sampled token is the most likely one
        assert t.bytes == t.top_logprobs[0].bytes


def test_completion_logprobs(server):
    r = server.openai().completions.create(model=server.model, prompt="Hello there", max_tokens=4, temperature=0,
                                           logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_completion_echo_logprobs_cover_the_prompt(server):
    """What lm-evaluation-harness's loglikelihood tasks send: echo + logprobs, the prompt's tokens scored."""
    prompt = "The harbor light turned"
    r = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0,
                                           logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1
    assert "".join(lp.tokens[:n_prompt]) == prompt and r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[:n_prompt + 1] == [len("".join(lp.tokens[:i])) for i in range(n_prompt + 1)]
    # the same prompt again: the prefix cache must not skip positions whose logprobs are asked for
    again = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0,
                                               logprobs=1, echo=True)
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
