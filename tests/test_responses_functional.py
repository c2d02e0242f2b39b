"""The Responses API (`/v1/responses`) against a real `octo serve` on the echo engine, through the official openai SDK
and raw HTTP: every response and every streamed event validates against OpenAI's published OpenAPI schemas
(tests/data, scripts/openapi_subset.py); tool calls (scripted: echo repeats a Hermes call), previous_response_id
(with a prefix-cache hit, and across a server restart: responses live in SQLite under OCTO_HOME), GET / DELETE,
store false, truncation, and 400s naming what is not supported."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("jsonschema")

from openapi_check import check, check_event  # noqa: E402
from serverproc import run_octo  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return str(tmp_path_factory.mktemp("octo-home"))


@pytest.fixture(scope="module")
def server(home):
    with run_octo("test-model", "--engine", "echo", env={"OCTO_HOME": home}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def post(server, body, stream=False):
    url = f"http://127.0.0.1:{server.port}/v1/responses"
    if not stream:
        r = httpx.post(url, json=body, timeout=60)
        return r.status_code, r.json()
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name
                events.append(ev)
    return 200, events


def test_text_response_validates(server, client):
    status, body = post(server, {"model": "test-model", "input": "hello there", "instructions": "be brief",
                                 "metadata": {"k": "v"}})
    assert status == 200
    check("Response", body)
    assert body["status"] == "completed" and body["metadata"] == {"k": "v"}
    r = client.responses.create(model="test-model", input="hello there")
    assert r.output_text == "hello there"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 2


def test_stream_events_validate_and_come_in_order(server):
    _, events = post(server, {"model": "test-model", "input": CALL, "tools": TOOLS}, stream=True)
    for ev in events:
        check_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [k for k, _ in itertools.groupby(e["type"] for e in events)]  # deltas may come in several events
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    _, whole = post(server, {"model": "test-model", "input": CALL, "tools": TOOLS})
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final["output"]]
    assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole["output"]]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}


def test_tool_loop_with_previous_response_id(client):
    first = client.responses.create(model="test-model", input=CALL, tools=TOOLS)
    call = [o for o in first.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = client.responses.create(model="test-model", previous_response_id=first.id, tools=TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert "sunny" in second.output_text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the stored conversation is a prefix-cache hit


def test_sdk_stream_helper(client):
    with client.responses.stream(model="test-model", input="streamed words here") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "streamed words here"


def test_store_false_get_and_delete(server, client):
    kept = client.responses.create(model="test-model", input="keep me")
    assert client.responses.retrieve(kept.id).output_text == "keep me"
    gone = client.responses.create(model="test-model", input="forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    r = httpx.delete(f"http://127.0.0.1:{server.port}/v1/responses/{kept.id}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="test-model", input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


def test_previous_response_survives_a_restart(home):
    with run_octo("test-model", "--engine", "echo", env={"OCTO_HOME": home}) as s:
        first = s.openai().responses.create(model="test-model", input="remember the lighthouse")
    with run_octo("test-model", "--engine", "echo", env={"OCTO_HOME": home}) as s:
        c = s.openai()
        assert c.responses.retrieve(first.id).output_text == "remember the lighthouse"
        second = c.responses.create(model="test-model", previous_response_id=first.id, input="and the harbor")
        assert second.output_text == "and the harbor"
        assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turn is in the prompt


def test_truncation_auto_drops_the_oldest_turns():
    with run_octo("test-model", "--engine", "echo", "-o", "n_ctx=40", "--isolation", "process") as s:
        c = s.openai()
        long_input = [{"role": "user", "content": " ".join(["word"] * 12)} for _ in range(4)]
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(model="test-model", input=long_input)
        assert info.value.body["code"] == "context_length_exceeded"
        r = c.responses.create(model="test-model", input=long_input, truncation="auto", max_output_tokens=4)
        assert r.status in ("completed", "incomplete") and r.output_text.startswith("word")


def test_what_codex_sends_is_accepted(server):
    status, body = post(server, {"model": "test-model", "input": "hi there", "store": False,
                                 "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
                                 "client_metadata": {"session_id": "s1"}, "parallel_tool_calls": True})
    assert status == 200, body
    check("Response", body)
    assert [o["type"] for o in body["output"]] == ["message"]  # no reasoning items to include


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{**TOOLS[0], "name": "bad name"}]}]},
     "tools[0].tools[0].name"),
    ({"input": "x", "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "x": 1}}},
     "text.format.x"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tools": [{**TOOLS[0], "name": "bad name"}]}, "tools[0].name"),
    ({}, "input"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    status, out = post(server, {"model": "test-model", **body})
    assert status == 400, out
    assert out["error"]["param"] == param, out


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one", "strict": False,
                        "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}]}


@pytest.mark.parametrize("stream", [False, True])
def test_codex_default_request_is_served(server, stream):
    """What Codex 0.169 sends with its default settings: a reasoning summary (a model without reasoning has none to
    give), a namespace tool (its functions are offered under their flat names, and a call names its namespace) and
    the built-in web_search (not offered: a warning header says so)."""
    call = ('<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "go", "n": 1e5}}\n'
            '</tool_call>')
    body = {"model": "test-model", "input": [{"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": call}]}],
            "tools": [*TOOLS, NAMESPACE, {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"]}
    url = f"http://127.0.0.1:{server.port}/v1/responses"
    with httpx.stream("POST", url, json={**body, "stream": stream}, timeout=60) as r:
        r.read()
    assert r.status_code == 200, r.text
    assert "tools[2] (web_search)" in r.headers["x-octo-warning"]
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        final = events[-1]["response"]
    else:
        final = r.json()
    assert final["reasoning"]["summary"] == "auto"
    check("Response", final)
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [(c["name"], c.get("namespace")) for c in calls] == [("spawn_agent", "multi_agent_v1")]
    assert calls[0]["arguments"] == '{"message": "go", "n": 1e5}'  # the model's text, not re-serialised
    # the next turn sends the call back with its namespace, and its output
    turn = {**body, "input": [*body["input"], {k: v for k, v in calls[0].items() if k != "status"},
                              {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "done"}]}
    status, out = post(server, turn)
    assert status == 200 and "done" in out["output"][0]["content"][0]["text"], out


PARALLEL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_parallel_calls_then_outputs_in_any_order(server, client):
    """Clients send parallel calls back as OpenAI documents them: all calls, then the outputs (in any order)."""
    first = client.responses.create(model="test-model", input=PARALLEL, tools=TOOLS, store=False)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    history = [{"role": "user", "content": PARALLEL},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls]]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"sunny in {city}"}
               for c, city in zip(calls, ["Paris", "Rome"], strict=True)]
    for order in (outputs, outputs[::-1]):
        r = client.responses.create(model="test-model", input=[*history, *order], tools=TOOLS, store=False)
        text = r.output_text
        assert text.index("sunny in Paris") < text.index("sunny in Rome"), text  # in the calls' order
    # with a message between the calls and an output, as long as each call is answered
    r = client.responses.create(model="test-model", input=[*history, outputs[1], {"role": "user", "content": "and"},
                                                           outputs[0]], tools=TOOLS, store=False)
    assert "sunny in Paris" in r.output_text
    status, out = post(server, {"model": "test-model", "input": [*history, outputs[0]], "tools": TOOLS})
    assert status == 400 and out["error"]["param"] == "input[2]", out  # the Rome call is never answered
    assert calls[1].call_id in out["error"]["message"]
    stray = {"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}
    status, out = post(server, {"model": "test-model", "input": [*history, *outputs, stray], "tools": TOOLS})
    assert status == 400 and out["error"]["param"] == "input[5].call_id", out
    status, out = post(server, {"model": "test-model", "input": [history[0], outputs[0], *history[1:], outputs[1]],
                                "tools": TOOLS})
    assert status == 400 and out["error"]["param"] == "input[1].call_id", out  # an output before its call
