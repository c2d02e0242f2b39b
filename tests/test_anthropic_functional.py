"""Anthropic Messages parity through the official ``anthropic`` SDK against a real `octo serve` on the echo engine (in
the gateway and in a worker process): tools and the tool loop (tool_use -> tool_result -> next turn), streamed
tool_use blocks whose input_json_delta fragments reassemble to the non-streamed input, count_tokens, thinking,
cache_control, prefill, and bad inputs as 400s in Anthropic's error shape. The echo model repeats the last user
message, so a message holding a call in the Hermes format is a scripted tool_use answer (the echo engine has no chat
template: tools go to the system prompt in the Hermes format)."""

from __future__ import annotations

import json

import pytest

from octo.scheduler.jobs import Result
from octo.serving.anthropic import tool_use_id
from octo.serving.anthropic_answer import Options, StreamBlocks
from octo.text.reasoning import ThinkSplitter, split_thinking

anthropic = pytest.importorskip("anthropic")

MODEL = "test-model"
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, TIME]


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


SCRIPT = "Let me check. " + call_text("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def client(echo_server):
    return anthropic.Anthropic(base_url=echo_server.base_url, api_key="none", max_retries=0)


def ask(client, content, **kw):
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 200)
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def bad_request(fn, *args, **kw) -> str:
    """The message of the 400 ``fn`` gets, checking Anthropic's error shape."""
    with pytest.raises(anthropic.BadRequestError) as e:
        fn(*args, **kw)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], body
    return body["error"]["message"]


# -- tools ----------------------------------------------------------------------------------------------------------
def test_tool_use_answer(client):
    m = ask(client, SCRIPT)
    assert m.id.startswith("msg_") and len(m.id) == 28
    assert m.stop_reason == "tool_use"
    text, call = m.content
    assert text.type == "text" and text.text == "Let me check."
    assert call.type == "tool_use" and call.id.startswith("toolu_") and len(call.id) == 30
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    plain = ask(client, "no call here")
    assert plain.stop_reason == "end_turn" and [b.type for b in plain.content] == ["text"]


def test_tool_loop(client):
    question = {"role": "user", "content": call_text("get_weather", {"city": "Oslo"})}
    first = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[question])
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]  # no empty text block
    call = first.content[0]
    history = [question, {"role": "assistant", "content": first.content}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "minus four"}]}
    second = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[*history, result])
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    answer = second.content[0].text  # the echo model repeats the tool result turn it was shown
    assert "minus four" in answer and '"name": "get_weather"' in answer and "Error" not in answer
    failed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                           "content": [{"type": "text", "text": "no such city"}]}]}
    third = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[*history, failed])
    assert "Error: no such city" in third.content[0].text


def test_streamed_tool_use_reassembles(client):
    whole = ask(client, SCRIPT)
    with client.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS,
                                messages=[{"role": "user", "content": SCRIPT}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == [(0, "text"), (1, "tool_use")] and stops == [0, 1]
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert fragments and json.loads("".join(fragments)) == whole.content[1].input
    tool_start = next(e for e in events if e.type == "content_block_start" and e.index == 1)
    assert tool_start.content_block.input == {} and tool_start.content_block.id == final.content[1].id
    assert final.stop_reason == "tool_use" and final.id.startswith("msg_")
    assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == \
        [("text", "Let me check.", None, None), ("tool_use", None, "get_weather", {"city": "Paris"})]
    # an answer that starts with a call has no text block: the tool_use block is block 0
    with client.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS,
                                messages=[{"role": "user", "content": call_text("get_time", {})}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"] == [(0, "tool_use")]
    assert final.content[0].name == "get_time" and final.content[0].input == {}


def test_disable_parallel_tool_use(client):
    two = call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {})
    assert [b.name for b in ask(client, two).content] == ["get_weather", "get_time"]
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    assert [b.name for b in ask(client, two, tool_choice=choice).content] == ["get_weather"]
    with client.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS, tool_choice=choice,
                                messages=[{"role": "user", "content": two}]) as stream:
        final = stream.get_final_message()
    assert [b.name for b in final.content] == ["get_weather"] and final.stop_reason == "tool_use"


def test_tool_choice_none_and_auto(client):
    m = ask(client, SCRIPT, tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and "<tool_call>" in m.content[0].text  # not parsed: the text stays
    assert ask(client, SCRIPT, tool_choice={"type": "auto"}).stop_reason == "tool_use"


# -- count_tokens, usage, cache_control -----------------------------------------------------------------------------
def test_count_tokens_matches_usage(client):
    system = " ".join(f"rule{i}" for i in range(30))
    msgs = [{"role": "user", "content": "count these words"}]
    n = client.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=msgs).input_tokens
    m = client.messages.create(model=MODEL, max_tokens=20, system=system, tools=TOOLS, messages=msgs)
    assert n > 30 and m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    bare = client.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens
    assert bare < n  # the tools are part of the prompt


def test_stream_reports_cached_tokens(client):
    system = " ".join(f"lighthouse{i}" for i in range(60))
    first = client.messages.create(model=MODEL, max_tokens=20, system=system,
                                   messages=[{"role": "user", "content": "first question"}])
    assert first.content[0].text == "first question"
    with client.messages.stream(model=MODEL, max_tokens=20, system=system,
                                messages=[{"role": "user", "content": "second question"}]) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    usage = start.message.usage
    assert usage.cache_read_input_tokens >= 60
    n = client.messages.count_tokens(model=MODEL, system=system,
                                     messages=[{"role": "user", "content": "second question"}]).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == n
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == n and final.usage.output_tokens == 2


def test_cache_control_everywhere(client):
    eph = {"type": "ephemeral"}
    m = client.messages.create(model=MODEL, max_tokens=50, cache_control=eph,
                               system=[{"type": "text", "text": "be brief", "cache_control": eph}],
                               tools=[{**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                               messages=[{"role": "user", "content": call_text("get_weather", {"city": "Rome"})}])
    call = m.content[0]
    m = client.messages.create(model=MODEL, max_tokens=50, cache_control=eph, tools=[WEATHER], messages=[
        {"role": "user", "content": [{"type": "text", "text": "weather?", "cache_control": eph}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input,
                                           "cache_control": eph}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny",
                                      "cache_control": eph},
                                     {"type": "text", "text": "thanks", "cache_control": eph}]}])
    assert m.stop_reason == "end_turn" and "thanks" in m.content[0].text
    n = client.messages.count_tokens(model=MODEL, cache_control=eph,
                                     messages=[{"role": "user", "content": "x"}]).input_tokens
    assert n > 0


# -- thinking, prefill ----------------------------------------------------------------------------------------------
def test_thinking_on_a_model_without_reasoning_answers_directly(client):
    """Every thinking setting is accepted on a model with no reasoning mode: it answers directly (no thinking
    block, its text streamed as it comes); the budget's own rules still hold."""
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        m = ask(client, "plain words", max_tokens=2000, thinking=thinking)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == "plain words"
    with client.messages.stream(model=MODEL, max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                                messages=[{"role": "user", "content": "one two three four"}]) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert len(deltas) > 1 and "".join(deltas) == "one two three four"
    assert "budget_tokens" in bad_request(ask, client, "plain words", max_tokens=2000,
                                          thinking={"type": "enabled", "budget_tokens": 10})
    assert client.messages.count_tokens(model=MODEL, thinking={"type": "enabled", "budget_tokens": 1024},
                                        messages=[{"role": "user", "content": "x"}]).input_tokens > 0


def test_what_claude_code_sends(client):
    """Claude Code's requests: a system turn inside ``messages`` (rendered where it stands), adaptive thinking (a
    model with no reasoning mode answers directly), ``output_config.effort`` "high" (the default) and a
    ``clear_thinking`` context edit (earlier thinking is never re-sent), ``metadata.user_id`` as a JSON string."""
    msgs = [{"role": "user", "content": "first words"}, {"role": "system", "content": "be brief"}]
    base = client.messages.count_tokens(model=MODEL, messages=msgs[:1]).input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens > base + 1  # the system turn counts
    m = client.messages.create(
        model=MODEL, max_tokens=50, messages=msgs, thinking={"type": "adaptive"},
        metadata={"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        extra_body={"output_config": {"effort": "high"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "first words"
    assert "output_config.effort" in bad_request(ask, client, "x", extra_body={"output_config": {"effort": "low"}})
    assert "context_management.edits[0]" in bad_request(
        ask, client, "x", extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})
    assert "verbosity" in bad_request(ask, client, "x",
                                      extra_body={"output_config": {"verbosity": "low"}})
    # echo cannot constrain its output: a 400 naming the field, not a silently unconstrained answer
    assert "output_config" in bad_request(ask, client, "x", extra_body={"output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}})


def test_max_tokens_beyond_the_window_runs_to_its_end(client):
    """Anthropic's newer models take a max_tokens past the context window and stop at its end with
    ``model_context_window_exceeded`` (Claude Code asks for 32,000 whatever the model): octo does the same; a prompt
    that does not fit alone is still a 400."""
    n_ctx = 8192  # the echo engine's default context
    short = " ".join(f"w{i}" for i in range(40))
    m = client.messages.create(model=MODEL, max_tokens=200_000, messages=[{"role": "user", "content": short}],
                               timeout=60)  # a timeout: the SDK refuses a long max_tokens without one
    assert m.stop_reason == "end_turn" and m.content[0].text == short  # fits: the echo ends by itself
    long = " ".join(f"w{i}" for i in range(n_ctx // 2 + 50))  # its echo runs past the window
    for kw in ({}, {"stream": True}):
        if kw:
            with client.messages.stream(model=MODEL, max_tokens=32_000,
                                        messages=[{"role": "user", "content": long}]) as stream:
                m = stream.get_final_message()
        else:
            m = client.messages.create(model=MODEL, max_tokens=32_000, messages=[{"role": "user", "content": long}],
                                       timeout=60)
        assert m.stop_reason == "model_context_window_exceeded", m.stop_reason
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == n_ctx
        assert long.startswith(m.content[0].text)
    m = client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": long}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    huge = " ".join("x" for _ in range(n_ctx + 10))
    assert "context" in bad_request(client.messages.create, model=MODEL, max_tokens=10,
                                    messages=[{"role": "user", "content": huge}])


def test_prefill_is_continued(client):
    question = {"role": "user", "content": "alpha beta gamma"}
    prefix = "The answer is"
    base = client.messages.count_tokens(model=MODEL, messages=[question]).input_tokens
    filled = client.messages.count_tokens(model=MODEL, messages=[question, {"role": "assistant", "content": prefix}])
    # the assistant turn stays open: its text follows the generation prompt, with no end-of-turn marker after it
    assert filled.input_tokens == base + len(prefix.split())
    prefill = {"role": "assistant", "content": [{"type": "text", "text": prefix}]}
    m = client.messages.create(model=MODEL, max_tokens=50, messages=[question, prefill])
    assert m.content[0].text == "alpha beta gamma" and m.stop_reason == "end_turn"  # only the continuation
    empty = client.messages.count_tokens(model=MODEL, messages=[question, {"role": "assistant", "content": ""}])
    assert empty.input_tokens == base


# -- bad input --------------------------------------------------------------------------------------------------------
def test_bad_inputs_are_anthropic_400s(client):
    user = [{"role": "user", "content": "x"}]
    assert "bash_20250124" in bad_request(client.messages.create, model=MODEL, max_tokens=10, messages=user,
                                          tools=[{"type": "bash_20250124", "name": "bash"}])
    assert "web_search_20250305" in bad_request(
        client.messages.create, model=MODEL, max_tokens=10, messages=user,
        tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}])
    assert "missing" in bad_request(ask, client, "x", tool_choice={"type": "tool", "name": "missing"})
    assert "tool_choice" in bad_request(client.messages.create, model=MODEL, max_tokens=10, messages=user,
                                        tool_choice={"type": "any"})  # no tools to choose from
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
    assert "toolu_nope" in bad_request(client.messages.create, model=MODEL, max_tokens=10, messages=orphan)
    unanswered = [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "get_time",
                                                     "input": {}}]},
                  {"role": "user", "content": "never mind"}]
    assert "toolu_a" in bad_request(client.messages.create, model=MODEL, max_tokens=10, tools=TOOLS,
                                    messages=unanswered)
    assert "name" in bad_request(client.messages.create, model=MODEL, max_tokens=10, messages=user, tools=TOOLS,
                                 tool_choice={"type": "tool"})
    assert "image" in bad_request(client.messages.create, model=MODEL, max_tokens=10, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": "AAAA"}}]}])
    assert "tool_choice" in bad_request(client.messages.count_tokens, model=MODEL, messages=user,
                                        extra_body={"tool_choice": {"type": "sometimes"}})
    assert "foo" in bad_request(client.messages.count_tokens, model=MODEL, messages=user, extra_body={"foo": 1})


# -- the pieces, without a server --------------------------------------------------------------------------------------
def test_think_splitter_streams_as_whole():
    text = "<think>\nweigh the options\n</think>\n\nThe answer."
    assert split_thinking(text) == ("weigh the options\n", "The answer.")
    assert split_thinking("The answer.") == (None, "The answer.")
    assert split_thinking("opened by the template</think>rest") == ("opened by the template", "rest")
    s = ThinkSplitter()
    pieces = [p for ch in text for p in s.feed(ch)] + s.finish()
    assert "".join(p for k, p in pieces if k == "thinking") == "weigh the options\n"
    assert "".join(p for k, p in pieces if k == "text") == "The answer."


def test_stream_blocks_number_in_order():
    blocks = StreamBlocks(Options(thinking=True))
    evs = blocks.thinking("hmm") + blocks.text("ok ")
    evs += blocks.tool({"tool_calls": [{"index": 0, "id": "call_" + "a" * 24, "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})
    evs += blocks.tool({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]})
    evs += blocks.finish(Result("ok", "tool_calls", 5, 3, 0, [], tool_calls=[{}]))
    starts = [(d["index"], d["content_block"]["type"]) for name, d in evs if name == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [d["index"] for name, d in evs if name == "content_block_stop"] == [0, 1, 2]
    tool = next(d["content_block"] for name, d in evs if name == "content_block_start" and d["index"] == 2)
    assert tool["id"] == tool_use_id("call_" + "a" * 24) == "toolu_" + "a" * 24
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use" and evs[-1][0] == "message_stop"
    empty = StreamBlocks(Options())
    evs = empty.finish(Result("", "stop", 5, 0, 0, []))
    assert [name for name, _ in evs] == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]


def test_late_system_turns_fold_when_the_template_refuses_them():
    """A template that takes a system turn only first (many do) gets the later ones folded into it, in order."""
    from octo.errors import InvalidRequest
    from octo.serving import chatprep
    from octo.text.toolcalls import FORMATS

    class FirstSystemOnly:
        name = "strict"

        def render_chat(self, messages, add_generation_prompt=True, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise InvalidRequest("The model's chat template rejected the messages: system first", param="messages")
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    msgs = [{"role": "system", "content": "rules"}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "late one"}, {"role": "system", "content": "late two"}]
    fmt = FORMATS["hermes"]
    assert chatprep.render(FirstSystemOnly(), msgs, None, fmt) == "system:rules\n\nlate one\n\nlate two|user:hi"
    assert chatprep.render(FirstSystemOnly(), msgs[1:], None, fmt) == "system:late one\n\nlate two|user:hi"

    class RefusesAll(FirstSystemOnly):
        def render_chat(self, messages, add_generation_prompt=True, **kw):
            raise InvalidRequest("The model's chat template rejected the messages: no", param="messages")

    with pytest.raises(InvalidRequest):  # folding does not help: the template's refusal stands
        chatprep.render(RefusesAll(), msgs, None, fmt)
    with pytest.raises(InvalidRequest):  # no late system turn: nothing to fold, the refusal stands
        chatprep.render(RefusesAll(), msgs[:2], None, fmt)
