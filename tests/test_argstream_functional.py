"""A forced tool call streams its arguments as the model generates them, on every API, against a real `octo serve`
(the tiny random-weight GGUF on llama.cpp, where only the constraint makes a call): several
`response.function_call_arguments.delta` / `delta.tool_calls[].function.arguments` / `input_json_delta` events per
call in the raw SSE bytes, their concatenation exactly the final arguments (`function_call_arguments.done`,
`output_item.done`, the completed response), and real clients still complete a tool loop on it: the openai SDK's
Responses stream helper (call, then the tool output sent back) and an openai-agents streamed run (call, tool run,
its output the answer). Calls under tool_choice "auto" keep one delta per call
(tests/test_agent_tools_functional.py)."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import orjson
import pytest
from serverproc import run_tiny_gguf

# strings of bounded length: a random model always closes them; no number, which a random model could write out of a
# double's range (the call would then fail, by design: tests/test_argstream.py)
PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                          "country": {"type": "string", "maxLength": 10}},
         "required": ["city", "country"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PLACE}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PLACE}]
MSG_TOOLS = [{"name": "get_weather", "input_schema": PLACE}]


@pytest.fixture(scope="module")
def gguf():
    with run_tiny_gguf() as s:
        yield s


def sse(server, path: str, req: dict) -> list[dict]:
    """The data of every SSE event of a streamed request, read from the raw bytes."""
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}{path}", json={**req, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _is_args(text: str) -> None:
    assert isinstance(orjson.loads(text), dict), text


def test_responses_stream_arguments_as_generated(gguf):
    events = sse(gguf, "/v1/responses", {"model": gguf.model, "input": "weather?", "tools": RESP_TOOLS,
                                         "tool_choice": "required", "max_output_tokens": 300})
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3, kinds  # piece by piece, not one delta at the end
    added = kinds.index("response.output_item.added")
    assert kinds[added + 1] == "response.function_call_arguments.delta"  # the call opens before its arguments end
    args = "".join(deltas)
    _is_args(args)
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    final = events[-1]
    assert final["type"] == "response.completed", final
    calls = [o for o in final["response"]["output"] if o["type"] == "function_call"]
    assert done["arguments"] == item["arguments"] == calls[0]["arguments"] == args
    assert item["name"] == "get_weather" and item["status"] == "completed"


def test_chat_and_messages_stream_arguments_as_generated(gguf):
    events = sse(gguf, "/v1/chat/completions", {"model": gguf.model, "tools": CHAT_TOOLS, "tool_choice": "required",
                                                "messages": [{"role": "user", "content": "weather?"}],
                                                "max_tokens": 300})
    pieces = [tc["function"].get("arguments") for e in events for ch in e.get("choices") or []
              for tc in ch["delta"].get("tool_calls") or []]
    assert pieces[0] == "" and len([p for p in pieces if p]) >= 3, pieces
    _is_args("".join(pieces))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    events = sse(gguf, "/v1/messages", {"model": gguf.model, "tools": MSG_TOOLS, "tool_choice": {"type": "any"},
                                        "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 300})
    parts = [e["delta"]["partial_json"] for e in events
             if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert len(parts) >= 3, parts
    _is_args("".join(parts))
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"


def test_openai_sdk_stream_helper_completes_a_tool_loop(gguf):
    client = gguf.openai()
    seen = []
    with client.responses.stream(model=gguf.model, input="weather?", tools=RESP_TOOLS, tool_choice="required",
                                 max_output_tokens=300) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                seen.append(event.delta)
        first = stream.get_final_response()
    call = next(o for o in first.output if o.type == "function_call")
    assert len(seen) >= 3 and "".join(seen) == call.arguments
    city = json.loads(call.arguments)["city"]
    second = client.responses.create(model=gguf.model, max_output_tokens=8, tools=RESP_TOOLS, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": f"sunny in {city}"}])
    assert second.status in ("completed", "incomplete") and second.output


def test_openai_agents_streamed_run_completes_a_forced_tool_loop(gguf):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed")
    openai = pytest.importorskip("openai")
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents.set_tracing_disabled(True)
    calls, deltas = [], []

    async def get_weather(ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return "sunny"

    tool = agents.FunctionTool(name="get_weather", description="The weather of a place.", params_json_schema=PLACE,
                               on_invoke_tool=get_weather, strict_json_schema=False)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{gguf.base_url}/v1", api_key="none")
        model = agents.OpenAIResponsesModel(model=gguf.model, openai_client=client)
        settings = agents.ModelSettings(tool_choice="required", max_tokens=300)
        # the tool's output is the answer: a random model would not end a free-text turn before max_tokens, which a
        # streamed run treats as a failure (response.incomplete)
        agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[tool], model=model,
                             model_settings=settings, tool_use_behavior="stop_on_first_tool")
        try:
            result = agents.Runner.run_streamed(agent, "weather?", max_turns=3)
            async for ev in result.stream_events():
                data = getattr(ev, "data", None)
                if getattr(data, "type", "") == "response.function_call_arguments.delta":
                    deltas.append(data.delta)
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and set(calls[0]) == {"city", "country"}, calls
    assert len(deltas) >= 3 and json.loads("".join(deltas)) == calls[0]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.final_output == "sunny"


def test_a_forced_call_that_cannot_complete_fails_the_stream(gguf):
    """A stop sequence ends the output inside the forced call's arguments: what went out is a JSON prefix, and the
    stream ends with an error, never with the call presented as complete (the same path as a number out of range)."""
    events = sse(gguf, "/v1/chat/completions", {"model": gguf.model, "tools": CHAT_TOOLS, "tool_choice": "required",
                                                "messages": [{"role": "user", "content": "weather?"}],
                                                "max_tokens": 300, "stop": ['"country"']})
    pieces = "".join(tc["function"].get("arguments") or "" for e in events for ch in e.get("choices") or []
                     for tc in ch["delta"].get("tool_calls") or [])
    assert pieces.lstrip().startswith("{") and '"city"' in pieces and "country" not in pieces, pieces
    assert events[-1]["error"]["code"] == "engine_error" and "must not be run" in events[-1]["error"]["message"]
    assert not any(ch.get("finish_reason") for e in events for ch in e.get("choices") or [])

    events = sse(gguf, "/v1/messages", {"model": gguf.model, "tools": MSG_TOOLS, "tool_choice": {"type": "any"},
                                        "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 300,
                                        "stop_sequences": ['"country"']})
    kinds = [e["type"] for e in events]
    assert "input_json_delta" in str(events) and kinds[-1] == "error", kinds
    assert "message_delta" not in kinds and "must not be run" in events[-1]["error"]["message"]
