"""Tool calling through the official openai SDK against a real `octo serve` on the echo engine (in the gateway and
in a worker process): the echo model repeats the last user message, so a message holding a call in the Hermes format
is a scripted model answer. Auto tool choice parses it into ``message.tool_calls`` (text around it stays content),
streams it as OpenAI does (id, type and name first, then argument fragments), and the deltas reassemble to the
non-streamed call; a full tool loop runs through the SDK. Constrained tool choices run on the real engines
(tests/test_structured_functional.py)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


SCRIPT = "Let me check. " + call_text("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def client(echo_server):
    return echo_server.openai()


def ask(client, content, **kw):
    return client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": content}],
                                          tools=TOOLS, **kw)


def test_auto_tool_call_is_parsed_and_text_is_kept(client):
    r = ask(client, SCRIPT)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_deltas_reassemble_to_the_call(client):
    whole = ask(client, SCRIPT).choices[0].message
    stream = ask(client, SCRIPT, stream=True)
    content, calls, finish, first_tool_delta = "", {}, None, None
    for chunk in stream:
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                first_tool_delta = first_tool_delta or tc
                assert tc.id and tc.type == "function" and tc.function.name  # id, type and name come first
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert content == whole.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


def test_parallel_calls(client):
    text = call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {})
    r = ask(client, text)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert r.choices[0].message.content is None
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    text = call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {})
    r = ask(client, text, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    names = [tc.function.name for ch in ask(client, text, parallel_tool_calls=False, stream=True)
             for tc in ch.choices[0].delta.tool_calls or [] if tc.function.name]
    assert names == ["get_weather"]


def test_text_answer_with_tools_is_a_plain_message(client):
    r = ask(client, "no tools needed here")
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "no tools needed here"


def test_tool_choice_none_does_not_parse(client):
    r = ask(client, SCRIPT, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert "<tool_call>" in r.choices[0].message.content


def test_malformed_call_stays_content(client):
    bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>"
    r = ask(client, bad)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert "get_weather" in r.choices[0].message.content


def test_full_tool_loop(client):
    messages = [{"role": "user", "content": SCRIPT}]
    first = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    second = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS)
    msg = second.choices[0].message
    # the echo engine repeats the last user turn: this template has no tool role, so the result came as one
    assert msg.tool_calls is None and "sunny, 21 C" in msg.content and "get_weather" in msg.content
    assert second.choices[0].finish_reason == "stop"


def test_logprobs_on_chat_and_stream(client):
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "one two three"}],
                                       logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert "".join(t.token for t in lp) == r.choices[0].message.content
    assert all(t.logprob == 0.0 and bytes(t.bytes).decode() == t.token for t in lp)  # echo: a point mass
    stream = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "one two"}],
                                            logprobs=True, stream=True)
    tokens = [t.token for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert "".join(tokens) == "one two"


def test_completions_logprobs(client):
    r = client.completions.create(model="test-model", prompt="a b c", logprobs=1, max_tokens=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["a", " b", " c"] and lp.token_logprobs == [0.0, 0.0, 0.0]
    assert lp.text_offset == [0, 1, 3]


def test_echo_cannot_constrain(client):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "x", tool_choice="required")
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"


def test_chat_bodies_validate_against_openai_schema(echo_server):
    """Non-streamed and streamed chat bodies with tool calls and logprobs against OpenAI's published schemas."""
    import httpx
    from openapi_check import check

    url = f"http://127.0.0.1:{echo_server.port}/v1/chat/completions"
    body = {"model": "test-model", "messages": [{"role": "user", "content": SCRIPT}], "tools": TOOLS,
            "logprobs": True, "top_logprobs": 2}
    check("CreateChatCompletionResponse", httpx.post(url, json=body, timeout=60).json())
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    for c in chunks:
        check("CreateChatCompletionStreamResponse", c)
    cmpl = httpx.post(url.replace("chat/completions", "completions"),
                      json={"model": "test-model", "prompt": "a b", "logprobs": 2, "max_tokens": 3}, timeout=60).json()
    check("CreateCompletionResponse", cmpl)
