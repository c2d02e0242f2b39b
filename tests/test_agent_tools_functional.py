"""Tool calls as agents need them, on every API (Chat Completions, Responses, Messages; streamed and not) against a
real `octo serve`: arguments are the model's own JSON text (numbers keep their digits; a number past a double's
range is never sent as a call), a call cut off by max_tokens is a call with the `length` / `incomplete` /
`max_tokens` stop reason and no template markup in the text, a forced tool compiles its own schema only (keywords
zod emits, such as `propertyNames`, are relaxed, not refused), errors on /v1/messages name Anthropic's paths, and
`/tokenizer_info` answers as vLLM's does. The echo engine is the scripted model (it repeats the last user message, so
a Hermes call in it is the model's call); forced tools run on the tiny random-weight GGUF, where only the constraint
can make a call."""

from __future__ import annotations

import json

import httpx
import pytest
from serverproc import run_octo

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "number"}},
           "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
MSG_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
API = ("chat", "responses", "messages")


def hermes(args_text: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args_text}}}\n</tool_call>'


@pytest.fixture(scope="module")
def echo():
    with run_octo("test-model", "--engine", "echo") as s:
        yield s


def body(api: str, prompt: str, max_tokens: int = 200) -> tuple[str, dict]:
    if api == "chat":
        return "/v1/chat/completions", {"model": "test-model", "messages": [{"role": "user", "content": prompt}],
                                        "tools": CHAT_TOOLS, "max_tokens": max_tokens}
    if api == "responses":
        return "/v1/responses", {"model": "test-model", "input": prompt, "tools": RESP_TOOLS,
                                 "max_output_tokens": max_tokens}
    return "/v1/messages", {"model": "test-model", "messages": [{"role": "user", "content": prompt}],
                            "tools": MSG_TOOLS, "max_tokens": max_tokens}


def answer(server, api: str, prompt: str, stream: bool, max_tokens: int = 200) -> tuple[str, list[str], str]:
    """(text, the calls' arguments texts, stop reason) as a client assembles them, from the raw HTTP body (no SDK
    between the bytes and the check: numbers must keep their text)."""
    path, req = body(api, prompt, max_tokens)
    url = f"http://127.0.0.1:{server.port}{path}"
    if not stream:
        r = httpx.post(url, json=req, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        if api == "chat":
            ch = out["choices"][0]
            return (ch["message"]["content"] or "", [c["function"]["arguments"] for c in ch["message"].get(
                "tool_calls") or []], ch["finish_reason"])
        if api == "responses":
            text = "".join(p["text"] for o in out["output"] if o["type"] == "message" for p in o["content"])
            return text, [o["arguments"] for o in out["output"] if o["type"] == "function_call"], out["status"]
        raw = r.text  # the input object's own text, as sent
        text = "".join(b["text"] for b in out["content"] if b["type"] == "text")
        calls = [b for b in out["content"] if b["type"] == "tool_use"]
        return text, [_input_text(raw, c["id"]) for c in calls], out["stop_reason"]
    text, calls, stop = "", [], ""
    with httpx.stream("POST", url, json={**req, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if api == "chat":
                ch = ev["choices"][0] if ev.get("choices") else {}
                text += ch.get("delta", {}).get("content") or ""
                for tc in ch.get("delta", {}).get("tool_calls") or []:
                    if tc.get("id"):
                        calls.append("")
                    calls[-1] += tc["function"].get("arguments") or ""
                stop = ch.get("finish_reason") or stop
            elif api == "responses":
                if ev["type"] == "response.output_text.delta":
                    text += ev["delta"]
                elif ev["type"] == "response.output_item.added" and ev["item"]["type"] == "function_call":
                    calls.append("")
                elif ev["type"] == "response.function_call_arguments.delta":
                    calls[-1] += ev["delta"]
                elif ev["type"] in ("response.completed", "response.incomplete"):
                    stop = ev["response"]["status"]
            else:
                if ev["type"] == "content_block_start" and ev["content_block"]["type"] == "tool_use":
                    calls.append("")
                elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "text_delta":
                    text += ev["delta"]["text"]
                elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "input_json_delta":
                    calls[-1] += ev["delta"]["partial_json"]
                elif ev["type"] == "message_delta":
                    stop = ev["delta"]["stop_reason"]
    return text, calls, stop


def _input_text(raw: str, block_id: str) -> str:
    """The text of the ``input`` of the tool_use block ``block_id`` in a response body."""
    start = raw.index('"input":', raw.index(block_id)) + len('"input":')
    end = json.JSONDecoder().raw_decode(raw, start)[1]
    return raw[start:end]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", API)
def test_arguments_are_the_models_own_text(echo, api, stream):
    args = '{"city": "Paris", "n": 1.50e5, "big": 123456789012345678901234567890}'
    text, calls, _ = answer(echo, api, hermes(args), stream)
    compact = args.replace(": ", ":").replace(", ", ",")
    assert len(calls) == 1 and calls[0] in (args, compact), calls  # Messages' non-streamed input: no spaces
    assert text == ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", API)
def test_a_number_out_of_range_is_never_a_call(echo, api, stream):
    text, calls, _ = answer(echo, api, hermes('{"city": "Paris", "n": 1e999}'), stream)
    assert calls == [] and "1e999" in text  # as written: never Infinity, never null


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", API)
def test_a_truncated_call_is_a_call(echo, api, stream):
    text, calls, stop = answer(echo, api, hermes('{"city": "Paris", "n": 1}'), stream, max_tokens=6)
    assert text == "" and "<tool_call>" not in text
    assert len(calls) == 1 and calls[0].startswith('{"city"'), calls
    assert stop == {"chat": "length", "responses": "incomplete", "messages": "max_tokens"}[api]


def test_tokenizer_info_as_vllm_serves_it(echo):
    for path in ("/tokenizer_info", "/v1/tokenizer_info"):
        r = httpx.get(f"http://127.0.0.1:{echo.port}{path}", timeout=30)
        assert r.status_code == 200, r.text
        info = r.json()
        assert {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"} <= set(info), info


# -- constrained calls on the tiny GGUF ------------------------------------------------------------------------------
CLAUDE_LIKE = [  # what zod writes for a record (propertyNames), as in Claude Code's tool set, and a plain tool
    {"name": "Env", "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                                     "properties": {"vars": {"type": "object", "propertyNames": {"minLength": 1},
                                                             "additionalProperties": {"type": "string"}}},
                                     "additionalProperties": False}},
    {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string",
                                                                                     "maxLength": 12}},
                                      "required": ["file_path"], "additionalProperties": False}},
    {"name": "Broken", "input_schema": {"type": "object", "properties": {"x": {"type": "strin"}}}},
]


@pytest.fixture(scope="module")
def gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("llguidance")
    from octo.synth.gguf import build_gguf

    with run_octo(str(build_gguf("tiny", ftype="q8_0")), "--engine", "llamacpp") as s:
        s.model = s.openai().models.list().data[0].id
        yield s


def test_forced_tool_compiles_its_own_schema_only(gguf):
    url = f"http://127.0.0.1:{gguf.port}/v1/messages"
    base = {"model": gguf.model, "max_tokens": 60, "messages": [{"role": "user", "content": "read it"}],
            "tools": CLAUDE_LIKE}
    r = httpx.post(url, json={**base, "tool_choice": {"type": "tool", "name": "Read"}}, timeout=120)
    assert r.status_code == 200, r.text  # another tool's unsupported and broken schemas do not matter
    blocks = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert blocks and blocks[0]["name"] == "Read" and isinstance(blocks[0]["input"].get("file_path"), str)
    r = httpx.post(url, json={**base, "tool_choice": {"type": "tool", "name": "Env"}}, timeout=120)
    assert r.status_code == 200, r.text  # propertyNames: relaxed (a warning in the log), not a 400
    assert [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"] == ["Env"]
    r = httpx.post(url, json={**base, "tool_choice": {"type": "tool", "name": "Broken"}}, timeout=120)
    assert r.status_code == 400, r.text
    assert "tools[2].input_schema" in r.json()["error"]["message"]  # Anthropic's path, not tools[2].function...
    assert "relaxed" in gguf.log() and "propertyNames" in gguf.log()


def test_forced_truncated_call_on_chat(gguf):
    c = gguf.openai()
    named = []
    for max_tokens in (4, 30):  # cut in the opening markup, then in the arguments
        r = c.chat.completions.create(model=gguf.model, messages=[{"role": "user", "content": "weather?"}],
                                      tools=CHAT_TOOLS, tool_choice="required", max_tokens=max_tokens)
        ch = r.choices[0]
        assert ch.finish_reason == "length" and "<tool" not in (ch.message.content or ""), ch
        named += [t.function.name for t in ch.message.tool_calls or []]
    assert named == ["get_weather"]
