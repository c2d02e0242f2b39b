"""Deferred tools, the tool search and thinking on `/v1/messages`, through the official ``anthropic`` SDK against a
real `octo serve` on the echo engine (the scripted model: it repeats the last user turn, so a Hermes call written
there is its answer; its tools go to the system prompt in the Hermes format, so what the prompt holds is what
``count_tokens`` counts, word by word).

- ``defer_loading: true`` keeps a tool out of the prompt; a ``tool_reference`` (Claude Code's client-side ToolSearch
  answers with them) loads it: its definition is expanded where the reference stands, and its calls are parsed.
- The server-side tool search (``tool_search_tool_bm25_20251119``, ``tool_search_tool_regex_20251119``): the model's
  call of it runs in octo and the answer goes on in the same request, streamed and not; the blocks, sent back with the
  SDK's ``model_dump()``, keep the found tools loaded.
- The SDK's tool loop (``block.model_dump()`` rebuilding the assistant turn, and ``beta.messages.tool_runner``).
- Claude Code's request shape: adaptive thinking on a model that does not reason streams its text as it comes (one
  ``text_delta`` per token, not one at the end); on a model that reasons, thinking and text are separate blocks."""

from __future__ import annotations

import json

import pytest
from serverproc import run_octo, run_tiny_gguf

from octo.text.toolsearch import expansion

anthropic = pytest.importorskip("anthropic")

MODEL = "test-model"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
          "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "input_schema": SCHEMA}
STOCK = {"name": "get_stock", "description": "Latest price of a share",
         "input_schema": {"type": "object", "properties": {"ticker": {"type": "string"}}}}
TIME = {"name": "get_time", "description": "The time now", "input_schema": {"type": "object", "properties": {}}}
BM25 = {"type": "tool_search_tool_bm25_20251119", "name": "tool_search_tool_bm25"}
REGEX = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def deferred(tool: dict) -> dict:
    return {**tool, "defer_loading": True}


def fn(tool: dict) -> dict:
    return {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}


@pytest.fixture(scope="module")
def client(echo_server):
    return anthropic.Anthropic(base_url=echo_server.base_url, api_key="none", max_retries=0)


def count(client, **kw) -> int:
    return client.messages.count_tokens(model=MODEL, **kw).input_tokens


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", 400)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return client.messages.create(model=MODEL, messages=messages, **kw)


def streamed(client, messages, **kw):
    kw.setdefault("max_tokens", 400)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    with client.messages.stream(model=MODEL, messages=messages, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_message()


# -- deferred tools ---------------------------------------------------------------------------------------------
def test_deferred_tools_stay_out_of_the_prompt(client):
    msgs = [{"role": "user", "content": "hello"}]
    with_deferred = count(client, messages=msgs, tools=[TIME, deferred(WEATHER), deferred(STOCK)])
    assert with_deferred == count(client, messages=msgs, tools=[TIME])  # not one token of them
    assert with_deferred < count(client, messages=msgs, tools=[TIME, WEATHER, STOCK])
    m = ask(client, msgs, tools=[TIME, deferred(WEATHER)])
    assert m.content[0].text == "hello" and m.usage.input_tokens + m.usage.cache_read_input_tokens == with_deferred


def test_a_tool_reference_loads_a_deferred_tool(client):
    """Claude Code's client-side search: its ToolSearch call answered with ``tool_reference`` blocks."""
    search = {"name": "ToolSearch", "description": "Load deferred tools",
              "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    tools = [search, deferred(WEATHER), deferred(STOCK)]
    call = {"type": "tool_use", "id": "toolu_01", "name": "ToolSearch", "input": {"query": "select:get_weather"}}

    def history(result_content):
        return [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": result_content, "cache_control": {"type": "ephemeral"}}]}]

    loaded = history([{"type": "tool_reference", "tool_name": "get_weather"}])
    # the reference is the tool's definition, where it stands: the prompt's head (the tool list) does not change
    definition = expansion([fn(WEATHER)])
    as_text = history([{"type": "text", "text": definition}])
    n = count(client, messages=loaded, tools=tools)
    assert n == count(client, messages=as_text, tools=tools)
    assert n == count(client, messages=loaded, tools=[search, deferred(WEATHER)])  # get_stock is nowhere
    m = ask(client, loaded, tools=tools)  # the echo model repeats the tool result it was shown
    assert json.dumps(definition)[1:-1] in m.content[0].text and "get_stock" not in m.content[0].text
    bad = history([{"type": "tool_reference", "tool_name": "no_such_tool"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, bad, tools=tools)
    assert "no_such_tool" in e.value.body["error"]["message"]


def test_only_loaded_deferred_tools_can_be_forced():
    """On an engine that constrains its output (the tiny GGUF on llama.cpp), a forced call of a deferred tool needs
    it loaded; ``any`` chooses among the tools loaded."""
    with run_tiny_gguf() as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
        tools = [TIME, deferred(WEATHER), deferred(STOCK)]
        ref = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_time",
                                                  "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [
                   {"type": "tool_reference", "tool_name": "get_weather"}]}]}]
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=server.model, max_tokens=30, tools=tools, messages=ref[:1],
                                   tool_choice={"type": "tool", "name": "get_weather"})
        assert e.value.body["error"]["message"].startswith("tool_choice names tool 'get_weather', which is deferred")
        m = client.messages.create(model=server.model, max_tokens=60, tools=tools, messages=ref,
                                   tool_choice={"type": "tool", "name": "get_weather"})
        assert m.content[-1].type == "tool_use" and m.content[-1].name == "get_weather"
        assert isinstance(m.content[-1].input.get("city"), str) or m.stop_reason == "max_tokens"
        for _ in range(3):  # any: the random model picks get_time or get_weather, never the unloaded get_stock
            m = client.messages.create(model=server.model, max_tokens=60, tools=tools, messages=ref,
                                       tool_choice={"type": "any"}, extra_body={"temperature": 1.0})
            assert m.content[-1].type == "tool_use" and m.content[-1].name in ("get_time", "get_weather")


# -- the server-side tool search --------------------------------------------------------------------------------
def _check_search_answer(m, variant: str, arg: dict):
    kinds = [b.type for b in m.content]
    assert kinds == ["server_tool_use", "tool_search_tool_result", "text"], kinds
    use, found, text = m.content
    assert use.id.startswith("srvtoolu_") and use.name == f"tool_search_tool_{variant}" and use.input == arg
    assert found.tool_use_id == use.id and found.content.type == "tool_search_tool_search_result"
    assert [r.tool_name for r in found.content.tool_references] == ["get_weather"]
    # the generation went on with the found tool's definition in the prompt (the echo model repeats it)
    assert "<functions>" in text.text and "get_weather" in text.text and "get_stock" not in text.text
    assert m.stop_reason == "end_turn"


@pytest.mark.parametrize("variant,arg", [("bm25", {"query": "weather city"}), ("regex", {"pattern": "(?i)WEATHER"})])
def test_the_server_side_search_runs_and_the_answer_goes_on(client, variant, arg):
    search = BM25 if variant == "bm25" else REGEX
    tools = [search, TIME, deferred(WEATHER), deferred(STOCK)]
    question = call_text(f"tool_search_tool_{variant}", arg)
    m = ask(client, question, tools=tools)
    _check_search_answer(m, variant, arg)
    one_call = count(client, messages=[{"role": "user", "content": question}], tools=tools)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > one_call  # two model calls, each billed
    events, final = streamed(client, question, tools=tools)
    _check_search_answer(final, variant, arg)
    assert final.content[2].text == m.content[2].text and final.usage.output_tokens == m.usage.output_tokens
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "server_tool_use"), (1, "tool_search_tool_result"), (2, "text")]
    assert sum(1 for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta") > 10
    # sent back as the SDK dumps it (the client's next turn), the search and its result are in the prompt again: the
    # found tool's definition where the result stands, and the model's call of it a tool_use
    history = [{"role": "user", "content": question},
               {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": call_text("get_weather", {"city": "Rome"})}]
    again = ask(client, history, tools=tools)
    assert again.stop_reason == "tool_use" and again.content[-1].name == "get_weather"
    assert again.content[-1].input == {"city": "Rome"}
    no_search = [history[0], {"role": "assistant", "content": "ok"}, history[2]]
    assert count(client, messages=history, tools=tools) > count(client, messages=no_search, tools=tools) + 20


def test_a_search_that_fails_says_why(client):
    tools = [REGEX, deferred(WEATHER)]
    for pattern, code in (("(unclosed", "invalid_tool_input"), ("x" * 201, "invalid_tool_input")):
        m = ask(client, call_text("tool_search_tool_regex", {"pattern": pattern}), tools=tools)
        result = m.content[1]
        assert result.type == "tool_search_tool_result" and result.content.type == "tool_search_tool_result_error"
        assert result.content.error_code == code, result
        assert code in m.content[2].text  # the model reads the error and goes on
    m = ask(client, call_text("tool_search_tool_regex", {"wrong": "x"}), tools=tools)
    assert m.content[1].content.error_code == "invalid_tool_input"


def test_tool_search_requests_refused_where_anthropic_refuses_them(client):
    for tools, where in (([{**BM25, "defer_loading": True}, WEATHER], "tools[0].defer_loading"),
                         ([{**BM25, "name": "search"}], "tools[0].name"), ([BM25, REGEX], "tools[1]")):
        with pytest.raises(anthropic.BadRequestError) as e:
            ask(client, "x", tools=tools)
        assert where in e.value.body["error"]["message"], (where, e.value.body)
    unanswered = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "tool_search_tool_bm25", "input": {"query": "q"}}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, unanswered, tools=[BM25])
    assert "srvtoolu_1" in e.value.body["error"]["message"]
    web = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_2", "name": "web_search", "input": {"query": "q"}}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, web)
    assert "web_search" in e.value.body["error"]["message"]


# -- the SDK's tool loop ----------------------------------------------------------------------------------------
def test_tool_loop_with_model_dump(client):
    """The SDK's docs rebuild the assistant turn with ``block.model_dump()``: every field of its response models
    (``caller``, ``toolset_name``, ``citations`` as null) comes back, streamed and not."""
    question = {"role": "user", "content": "Let me see. " + call_text("get_weather", {"city": "Lima"})}
    for stream in (False, True):
        first = streamed(client, [question], tools=[WEATHER])[1] if stream else ask(client, [question], tools=[WEATHER])
        assert first.stop_reason == "tool_use"
        dumped = [b.model_dump() for b in first.content]
        assert {"caller", "toolset_name"} <= set(dumped[-1]) and "citations" in dumped[0]
        call = first.content[-1]
        history = [question, {"role": "assistant", "content": dumped},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "warm"}]}]
        second = ask(client, history, tools=[WEATHER])
        assert second.stop_reason == "end_turn" and "warm" in second.content[0].text
        # the SDK's own way: the response's blocks as they are (the SDK serialises them)
        history[1] = {"role": "assistant", "content": first.content}
        assert ask(client, history, tools=[WEATHER]).content[0].text == second.content[0].text


def test_beta_tool_runner(client):
    seen = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: City name
        """
        seen.append(city)
        return f"sunny in {city}"

    runner = client.beta.messages.tool_runner(model=MODEL, max_tokens=300, tools=[get_weather], messages=[
        {"role": "user", "content": call_text("get_weather", {"city": "Quito"})}])
    replies = list(runner)
    assert seen == ["Quito"] and [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert "sunny in Quito" in replies[-1].content[0].text


# -- thinking: split only where the model reasons ---------------------------------------------------------------
WORDS = "one two three four five six seven eight nine ten eleven twelve"


def test_adaptive_thinking_on_a_model_that_does_not_reason_streams_as_it_comes(client):
    for thinking in ({"type": "adaptive"}, {"type": "adaptive", "display": "omitted"}, {"type": "between_tools"}):
        events, final = streamed(client, WORDS, thinking=thinking)
        deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
        assert len(deltas) == len(WORDS.split()) and "".join(deltas) == WORDS, deltas  # one per token
        assert [b.type for b in final.content] == ["text"] and final.content[0].text == WORDS
        m = ask(client, WORDS, thinking=thinking)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == WORDS


@pytest.fixture(scope="module")
def reasoning_client():
    with run_octo(MODEL, "--engine", "echo", "-o", "think=1", "--isolation", "process") as server:
        yield anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


def test_a_model_that_reasons_streams_thinking_and_text_apart(reasoning_client):
    said = f"<think> {WORDS} </think> the answer is here"
    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}):
        events, final = streamed(reasoning_client, said, thinking=thinking, max_tokens=2000)
        starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
        assert starts == [(0, "thinking"), (1, "text")]
        thinking_deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0]
        text_deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1]
        assert len(thinking_deltas) >= len(WORDS.split()) - 1 and len(text_deltas) == 4  # token by token
        assert final.content[0].thinking.strip() == WORDS and final.content[1].text == "the answer is here"
        m = ask(reasoning_client, said, thinking=thinking, max_tokens=2000)
        assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in m.content] == \
            [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in final.content]
    omitted = ask(reasoning_client, said, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [("thinking", ""), ("text", None)]
    plain = ask(reasoning_client, said)  # thinking not asked for: the text as the model wrote it
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text.startswith("<think>")


def test_the_stream_keeps_alive_while_the_search_result_prefills():
    """The model call that goes on after a search prefills the search result (here the found tool's long
    description, 25 ms a word): ``ping`` events keep the stream alive meanwhile, as before the first token."""
    import time

    import httpx
    from serverproc import REPO

    long = {**WEATHER, "description": " ".join(f"detail{i}" for i in range(160)), "defer_loading": True}
    serve = ("slow", "--engine", "slowprefill", "--plugins-dir", str(REPO / "tests" / "plugins"),
             "--stream-keepalive", "0.3", "-o", "prefill_ms=25", "-o", "prefill_chunk=8")
    with run_octo(*serve) as server:
        body = {"model": "slow", "max_tokens": 400, "stream": True, "tools": [BM25, long], "messages": [
            {"role": "user", "content": call_text("tool_search_tool_bm25", {"query": "weather"})}]}
        seen = []
        with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    seen.append((time.monotonic(), line[7:]))
    names = [name for _, name in seen]
    starts = [i for i, name in enumerate(names) if name == "content_block_start"]  # server_tool_use, result, text
    assert len(starts) == 3, names
    after = names[starts[1] + 2:starts[2]]  # from the search result's end to the text's start
    assert after.count("ping") >= 3, names  # about 4 s of prefill, a ping each 0.3 s
    gaps = [b - a for (a, _), (b, _) in zip(seen, seen[1:], strict=False)]
    assert max(gaps) < 2.0, gaps
