"""The OpenAI Agents SDK (`openai-agents`) running an agent with a function tool against a real `octo serve` through
`/v1/responses`. The echo engine is the scripted model: it repeats the last user message, so the user's message holds
a Hermes tool call; the SDK calls the tool, sends its output back (it becomes the last user turn: the echo template
has no tool role), and the run finishes with the model's text."""

from __future__ import annotations

import asyncio
import os

import pytest

agents = pytest.importorskip("agents", reason="openai-agents is not installed")
openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_agent_runs_a_function_tool_through_responses(echo_server):
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{echo_server.port}/v1", api_key="none")
    model = agents.OpenAIResponsesModel(model="test-model", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model)

    async def run():
        try:
            return await agents.Runner.run(agent, CALL, max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == ["Paris"]
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"
    assert "sunny in Paris" in result.final_output
