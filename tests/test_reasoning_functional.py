"""Reasoning output (``reasoning_content``) through the official openai SDK against a real `octo serve` on the echo
engine as a scripted reasoning model (``-o think=1``: its chat template reasons, so the ``<think>...</think>`` it echoes
is its reasoning): parsed by default, streamed as ``reasoning_content`` deltas, the markers never in ``content``, a
tool call after the reasoning still parsed; ``--reasoning-format none`` leaves the text whole; a model whose template
does not reason is never split. The splitter itself is tested piece by piece below."""

from __future__ import annotations

import json

import pytest
from serverproc import run_octo

from octo.text.reasoning import ThinkSplitter, prompt_opens_thinking, split_thinking

openai = pytest.importorskip("openai")

MODEL = "test-model"
SAID = "<think> first I plan </think> then I answer"


@pytest.fixture(scope="module")
def server():
    with run_octo(MODEL, "--engine", "echo", "-o", "think=1") as s:
        yield s


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_reasoning_content_apart(server):
    m = chat(server.openai(), SAID).choices[0].message
    assert m.content == "then I answer" and m.model_extra["reasoning_content"] == "first I plan "
    m = chat(server.openai(), "no thinking here").choices[0].message
    assert m.content == "no thinking here" and m.model_extra.get("reasoning_content") is None


def test_reasoning_streams_as_deltas(server):
    reasoning, content = [], []
    for chunk in chat(server.openai(), SAID, stream=True):
        for c in chunk.choices:
            if (c.delta.model_extra or {}).get("reasoning_content"):
                reasoning.append(c.delta.model_extra["reasoning_content"])
            content.append(c.delta.content or "")
    assert len(reasoning) >= 2  # one delta per token, as they come
    assert "".join(reasoning) == "first I plan " and "".join(content) == "then I answer"


def test_tool_call_after_reasoning(server):
    call = {"name": "get_time", "arguments": {"zone": "UTC"}}
    said = f"<think> I need the time </think> <tool_call> {json.dumps(call)} </tool_call>"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
    for stream in (False, True):
        r = chat(server.openai(), said, tools=tools, stream=stream)
        if stream:
            chunks = list(r)
            reasoning = "".join((c.delta.model_extra or {}).get("reasoning_content") or ""
                                for ch in chunks for c in ch.choices)
            args = "".join(tc.function.arguments or "" for ch in chunks for c in ch.choices
                           for tc in (c.delta.tool_calls or []))
            assert reasoning == "I need the time " and json.loads(args) == call["arguments"]
        else:
            m = r.choices[0].message
            assert m.model_extra["reasoning_content"] == "I need the time "
            assert m.tool_calls[0].function.name == "get_time" and not m.content


def test_reasoning_format_none_and_plain_models():
    with run_octo(MODEL, "--engine", "echo", "-o", "think=1", "--reasoning-format", "none") as s:
        m = chat(s.openai(), SAID).choices[0].message
        assert m.content == SAID and m.model_extra.get("reasoning_content") is None
    with run_octo(MODEL, "--engine", "echo") as s:  # its template does not reason: nothing is split
        m = chat(s.openai(), SAID).choices[0].message
        assert m.content == SAID and m.model_extra.get("reasoning_content") is None


def test_splitter_pieces():
    assert split_thinking("<think>plan</think>answer", False) == ("plan", "answer")
    assert split_thinking("plan</think>answer", False) == (None, "plan</think>answer")  # not opened: text
    assert split_thinking("plan</think>answer", True) == ("plan", "answer")  # the prompt opened it
    assert split_thinking("plan</think>answer") == ("plan", "answer")  # unknown: the close decides
    s = ThinkSplitter(False)
    assert s.feed("hello ") == [("text", "hello ")]  # not held: a stream flows at once
    s = ThinkSplitter(True)
    assert s.feed("a </thi") == [("thinking", "a ")] and s.feed("nk> b") == [("text", "b")]
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") and not prompt_opens_thinking("x <think>y")
