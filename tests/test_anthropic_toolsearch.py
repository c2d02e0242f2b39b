"""The tool search behind Anthropic's deferred tools, without a server: Okapi BM25 against scores worked out by hand,
the regex variant's bounds (pattern length, invalid patterns, a pattern that backtracks without end), what a
request with deferred tools offers and renders (octo.serving.anthropic.chat_input), and an answer that searches
until it pauses (octo.serving.anthropic_answer.Turn)."""

from __future__ import annotations

import math
import time

import pytest

from octo.errors import InvalidRequest
from octo.protocol.anthropic import AnthropicRequest
from octo.scheduler.jobs import Result
from octo.serving import anthropic_tools
from octo.serving.anthropic import chat_input
from octo.serving.anthropic_answer import Options, Turn
from octo.text import toolsearch

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}}}
STOCK = {"name": "getStockPrice", "description": "Latest price of a share",
         "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}}}}
ALERTS = {"name": "weather_alerts", "description": "Storm warnings", "parameters": {"type": "object"}}
CATALOG = [WEATHER, STOCK, ALERTS]


# -- BM25 -------------------------------------------------------------------------------------------------------
def test_bm25_scores_match_the_formula_worked_by_hand():
    docs = [["get", "weather", "city"], ["get", "time"], ["weather", "alerts", "weather"]]
    # N = 3, avgdl = 8/3; "weather" is in 2 documents: idf = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln(1.6)
    # doc 0: f = 1, |D| = 3: K1 * (1 - B + B * 3 / (8/3)) = 1.2 * 1.09375 = 1.3125 -> ln(1.6) * 2.2 / 2.3125
    # doc 2: f = 2: ln(1.6) * 2 * 2.2 / 3.3125
    scores = toolsearch.bm25_scores(docs, ["weather"])
    assert scores[0] == pytest.approx(0.447138588, abs=1e-8)
    assert scores[1] == 0.0
    assert scores[2] == pytest.approx(0.624306708, abs=1e-8)
    # a term in no document adds nothing; distinct query terms add up; a repeated one counts once
    assert toolsearch.bm25_scores(docs, ["weather", "zebra", "weather"]) == scores
    both = toolsearch.bm25_scores(docs, ["time", "weather"])
    idf_time = math.log(1 + (3 - 1 + 0.5) / 1.5)
    assert both[1] == pytest.approx(idf_time * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 2 / (8 / 3))), abs=1e-8)
    assert both[0] == pytest.approx(scores[0]) and toolsearch.bm25_scores([], ["x"]) == []


def test_bm25_search_ranks_tools_by_their_text():
    assert toolsearch.terms("getStockPrice of get_weather") == ["get", "stock", "price", "of", "get", "weather"]
    assert toolsearch.bm25_search(CATALOG, "weather city") == ["get_weather", "weather_alerts"]
    assert toolsearch.bm25_search(CATALOG, "stock price") == ["getStockPrice"]
    assert toolsearch.bm25_search(CATALOG, "ticker") == ["getStockPrice"]  # argument names count
    assert toolsearch.bm25_search(CATALOG, "nothing matches") == []
    docs = [toolsearch.terms(" ".join(toolsearch.fields(t))) for t in CATALOG]
    scores = toolsearch.bm25_scores(docs, ["storm", "weather"])
    best = max(range(3), key=scores.__getitem__)
    assert scores[best] > 0 and toolsearch.bm25_search(CATALOG, "storm weather", limit=1) == [CATALOG[best]["name"]]
    for bad in ("", "   ", 7, "x" * 1001):
        with pytest.raises(toolsearch.SearchFailed) as e:
            toolsearch.bm25_search(CATALOG, bad)
        assert e.value.code == "invalid_tool_input"


# -- regex ------------------------------------------------------------------------------------------------------
def test_regex_search_reads_names_descriptions_and_arguments():
    assert toolsearch.regex_search(CATALOG, "weather") == ["get_weather", "weather_alerts"]
    assert toolsearch.regex_search(CATALOG, "(?i)STORM") == ["weather_alerts"]
    assert toolsearch.regex_search(CATALOG, "^City name$") == ["get_weather"]  # an argument's description
    assert toolsearch.regex_search(CATALOG, "get_.*") == ["get_weather"]
    assert toolsearch.regex_search(CATALOG, ".", limit=2) == ["get_weather", "getStockPrice"]


@pytest.mark.parametrize("pattern", ["(unclosed", "x" * 201, "", None, "*"])
def test_regex_search_refuses_bad_patterns(pattern):
    with pytest.raises(toolsearch.SearchFailed) as e:
        toolsearch.regex_search(CATALOG, pattern)
    assert e.value.code == "invalid_tool_input"


def test_a_pattern_that_backtracks_without_end_runs_out_of_time():
    victim = {"name": "victim", "description": "a" * 40 + "!", "parameters": {}}
    t0 = time.monotonic()
    with pytest.raises(toolsearch.SearchFailed) as e:
        toolsearch.regex_search([victim], "(a|aa)+$", budget_s=0.2)
    assert e.value.code == "execution_time_exceeded"
    assert time.monotonic() - t0 < 5  # bounded by the budget (generous: the host is busy)


def test_expansion_is_one_function_line_each():
    text = toolsearch.expansion([WEATHER, ALERTS])
    lines = text.splitlines()
    assert lines[0] == "<functions>" and lines[-1] == "</functions>" and len(lines) == 4
    assert lines[1] == ('<function>{"description": "Current weather of a city", "name": "get_weather", '
                        '"parameters": {"type": "object", "properties": {"city": {"type": "string", '
                        '"description": "City name"}}}}</function>')


# -- a request's tools ------------------------------------------------------------------------------------------
def tool(fn, **kw):
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"], **kw}


def request(tools, messages=None, **kw):
    messages = messages or [{"role": "user", "content": "hi"}]
    return AnthropicRequest.model_validate({"model": "m", "max_tokens": 50, "tools": tools, "messages": messages,
                                            **kw})


def test_deferred_tools_are_not_offered_until_referenced():
    tools = [tool(WEATHER), tool(STOCK, defer_loading=True), tool(ALERTS, defer_loading=True)]
    inp = chat_input(request(tools))
    assert [t["function"]["name"] for t in inp.prompt_tools] == ["get_weather"]
    assert inp.names == ["get_weather"]
    history = [{"role": "user", "content": "find stocks"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "x"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                   {"type": "text", "text": "found:"}, {"type": "tool_reference", "tool_name": "getStockPrice"}]}]}]
    inp = chat_input(request(tools, history))
    assert [t["function"]["name"] for t in inp.prompt_tools] == ["get_weather"]  # the prompt's head is unchanged
    assert inp.names == ["get_weather", "getStockPrice"]  # but the loaded tool may be called
    tool_msg = inp.messages[-1]
    assert tool_msg["role"] == "tool" and tool_msg["content"] == "found:\n" + toolsearch.expansion(
        [{"name": "getStockPrice", "description": STOCK["description"], "parameters": STOCK["parameters"]}])
    bad = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "tool_reference", "tool_name": "nope"}]}]}]
    with pytest.raises(InvalidRequest) as e:
        chat_input(request(tools, bad))
    assert e.value.param == "messages[2].content[0].content[0].tool_name"
    with pytest.raises(InvalidRequest) as e:  # forcing a tool nobody loaded
        chat_input(request(tools, tool_choice={"type": "tool", "name": "weather_alerts"}))
    assert e.value.param == "tool_choice.name" and "deferred" in e.value.message


def test_the_search_tool_is_offered_as_a_function():
    search = {"type": "tool_search_tool_bm25_20251119", "name": "tool_search_tool_bm25"}
    inp = chat_input(request([search, tool(WEATHER, defer_loading=True)]))
    (fn,) = [t["function"] for t in inp.prompt_tools]
    assert fn["name"] == "tool_search_tool_bm25" and fn["parameters"]["required"] == ["query"]
    for bad, param in (({**search, "name": "tool_search_tool_regex"}, "tools[0].name"),
                       ({**search, "defer_loading": True}, "tools[0].defer_loading")):
        with pytest.raises(InvalidRequest) as e:
            chat_input(request([bad]))
        assert e.value.param == param
    examples = tool(WEATHER, input_examples=[{"city": "Oslo"}])
    (fn,) = [t["function"] for t in chat_input(request([examples])).prompt_tools]
    assert fn["description"] == 'Current weather of a city\n\nInput examples:\n{"city": "Oslo"}'


def test_without_the_regex_package_the_search_is_not_offered(monkeypatch):
    monkeypatch.setattr(toolsearch, "regex_available", lambda: False)
    search = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}
    req = request([search, tool(WEATHER), tool(STOCK, defer_loading=True)])
    inp = chat_input(req)
    assert [t["function"]["name"] for t in inp.prompt_tools] == ["get_weather"] and inp.names == ["get_weather"]
    assert Options.of(req).search is None  # a call of that name stays text


def test_an_answer_that_keeps_searching_pauses():
    search = {"type": "tool_search_tool_bm25", "name": "tool_search_tool_bm25"}
    req = request([search, tool(WEATHER, defer_loading=True)])
    turn = Turn(req, Options.of(req))
    call = {"id": "call_" + "a" * 24, "type": "function",
            "function": {"name": "tool_search_tool_bm25", "arguments": '{"query": "weather"}'}}
    for i in range(anthropic_tools.MAX_SEARCHES):
        calls = turn.add(Result("", "tool_calls", 20, 5, 4, [], tool_calls=[call]))
        assert [c["type"] for c in calls] == ["server_tool_use"] and calls[0]["id"].startswith("srvtoolu_")
        (found,) = turn.searched(calls)
        assert found["content"]["tool_references"] == [{"type": "tool_reference", "tool_name": "get_weather"}]
        follow = turn.follow_up()
        assert (follow is None) == (i == anthropic_tools.MAX_SEARCHES - 1)
    assert turn.paused and turn.usage["input_tokens"] == 16 * anthropic_tools.MAX_SEARCHES
    assert turn.usage["cache_read_input_tokens"] == 4 * anthropic_tools.MAX_SEARCHES
    # a call cut off by max_tokens, or a client tool beside the search: the answer ends there
    turn = Turn(req, Options.of(req))
    assert turn.add(Result("", "length", 20, 5, 0, [], tool_calls=[call])) == []
    other = {**call, "id": "call_" + "b" * 24, "function": {"name": "get_weather", "arguments": "{}"}}
    assert Turn(req, Options.of(req)).add(Result("", "tool_calls", 20, 5, 0, [], tool_calls=[call, other])) == []


def test_tool_changes_in_a_system_turn():
    """Beta mid-conversation-tool-changes (announced by Claude Code): a ``tool_addition`` loads a tool from there on
    (its definition where the block stands), a ``tool_removal`` withdraws one (a line says so; no longer callable)."""
    tools = [tool(WEATHER), tool(STOCK, defer_loading=True)]

    def system(*blocks):
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": [{"type": "text", "text": "tools changed"}, *blocks]},
                {"role": "user", "content": "go on"}]

    add = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "getStockPrice"}}
    inp = chat_input(request(tools, system(add)))
    assert inp.names == ["get_weather", "getStockPrice"]
    assert [t["function"]["name"] for t in inp.prompt_tools] == ["get_weather"]
    stock = {"name": "getStockPrice", "description": STOCK["description"], "parameters": STOCK["parameters"]}
    assert {"role": "system", "content": "tools changed\n" + toolsearch.expansion([stock])} in inp.messages
    remove = {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}
    inp = chat_input(request(tools, system(remove)))
    assert inp.names == [] and inp.tools is None
    assert {"role": "system", "content": "tools changed\nThe tool get_weather is no longer available."} \
        in inp.messages
    assert chat_input(request(tools, system(remove, {**add, "tool": {**add["tool"], "name": "get_weather"}}))).names \
        == ["get_weather"]  # added back
    for bad, param in ((dict(add, tool={"type": "tool_definition", "definition": {}}), "content[1].tool"),
                       (dict(remove, tool={"type": "tool_reference", "name": "nope"}), "content[1].tool.name")):
        with pytest.raises(InvalidRequest) as e:
            chat_input(request(tools, system(bad)))
        assert e.value.param == f"messages[2].{param}", e.value.param
    with pytest.raises(InvalidRequest) as e:  # only in system turns
        chat_input(request(tools, [{"role": "user", "content": [add]}]))
    assert e.value.param == "messages[0].content[0]"
