"""The client matrix of docs/agents.md: agent libraries with their default settings completing a tool loop of two
parallel calls through `/v1/responses` against a real `octo serve` (echo engine, the scripted model: the user's
message holds two Hermes calls, and the answer to the tool outputs echoes them), and lm-evaluation-harness scoring
loglikelihoods with its default tokenizer backend (it finds octo's `/tokenizer_info` and uses the server's tokenizer).

- openai-agents: `OpenAIResponsesModel`, `Runner.run` and `Runner.run_streamed`;
- langchain-openai: `ChatOpenAI(use_responses_api=True)` with `bind_tools`, streamed and not;
- the openai Node SDK (npm `openai`, installed by scripts/system-deps.sh into `.cache/npm-clients`; the test skips
  when it is not there): `responses.create` and the `responses.stream` helper. The helper's final response carries
  SDK-only `parsed_arguments` on each call, which OpenAI's API refuses in an input item (400 unknown parameter), so the
  script sends the calls back with their API fields, as code written for OpenAI does;
- lm-eval: `LocalCompletionsAPI` (`local-completions`) loglikelihood on the tiny GGUF.

Codex CLI, Claude Code, litellm, instructor and llm have their own files (test_codex_functional.py,
test_claude_code_functional.py, test_litellm_llm_functional.py, test_clients_functional.py)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess

import pytest
from serverproc import REPO, run_octo

PARALLEL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
NODE_CLIENTS = REPO / ".cache" / "npm-clients"  # where scripts/system-deps.sh installs the openai npm package


@pytest.fixture(scope="module")
def echo():
    with run_octo("test-model", "--engine", "echo") as s:
        yield s


def _answered_both(text: str) -> None:
    assert "sunny in Paris" in text and "sunny in Rome" in text, text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_two_parallel_calls(echo, stream):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed")
    openai = pytest.importorskip("openai")
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{echo.base_url}/v1", api_key="none")
        model = agents.OpenAIResponsesModel(model="test-model", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model)
        try:
            if not stream:
                return await agents.Runner.run(agent, PARALLEL, max_turns=4)
            result = agents.Runner.run_streamed(agent, PARALLEL, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert sorted(calls) == ["Paris", "Rome"]
    kinds = [item.type for item in result.new_items]
    assert kinds.count("tool_call_item") == 2 and kinds.count("tool_call_output_item") == 2, kinds
    _answered_both(result.final_output)


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_responses_api_two_parallel_calls(echo, stream):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return f"sunny in {city}"

    llm = lc.ChatOpenAI(model="test-model", base_url=f"{echo.base_url}/v1", api_key="none", use_responses_api=True,
                        streaming=stream).bind_tools([get_weather])
    messages = [HumanMessage(PARALLEL)]
    ai = llm.invoke(messages)
    assert [c["args"] for c in ai.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    messages += [ai, *[ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in ai.tool_calls]]
    final = llm.invoke(messages)
    _answered_both(final.text if isinstance(final.text, str) else final.text())


NODE_SCRIPT = r"""
import OpenAI from "openai";
const [base, stream] = [process.argv[1], process.argv[2] === "1"];
const client = new OpenAI({ baseURL: base, apiKey: "none", maxRetries: 0 });
const tools = [{ type: "function", name: "get_weather", description: "Weather of a city", strict: false,
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } }];
async function create(input) {
  if (!stream) return await client.responses.create({ model: "test-model", input, tools });
  return await client.responses.stream({ model: "test-model", input, tools }).finalResponse();
}
const input = [{ role: "user", content: process.argv[3] }];
const first = await create(input);
const calls = first.output.filter((o) => o.type === "function_call");
for (const c of calls) input.push({ type: "function_call", call_id: c.call_id, name: c.name, arguments: c.arguments });
for (const c of calls) {
  input.push({ type: "function_call_output", call_id: c.call_id, output: `sunny in ${JSON.parse(c.arguments).city}` });
}
const second = await create(input);
console.log(JSON.stringify({ calls: calls.map((c) => JSON.parse(c.arguments).city), text: second.output_text }));
"""


@pytest.mark.parametrize("stream", [False, True])
def test_openai_node_sdk_two_parallel_calls(echo, stream):
    node = shutil.which("node")
    if node is None or not (NODE_CLIENTS / "node_modules" / "openai").exists():
        pytest.skip(f"the openai npm package is not in {NODE_CLIENTS} (scripts/system-deps.sh installs it) or "
                    "node is not in PATH")
    args = [f"{echo.base_url}/v1", "1" if stream else "0", PARALLEL]
    run = subprocess.run([node, "--input-type=module", "-e", NODE_SCRIPT, *args], cwd=NODE_CLIENTS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["calls"] == ["Paris", "Rome"]
    _answered_both(out["text"])


@pytest.fixture(scope="module")
def gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from octo.synth.gguf import build_gguf

    with run_octo(str(build_gguf("tiny", ftype="q8_0")), "--engine", "llamacpp") as s:
        s.model = s.openai().models.list().data[0].id
        yield s


def test_lm_eval_loglikelihood_with_the_servers_tokenizer(gguf):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{gguf.base_url}/v1/completions", model=gguf.model, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # auto-detected through /tokenizer_info and /tokenize
    requests = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
                Instance("loglikelihood", {}, ("The capital of France is", " a large blue whale"), 1)]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(results) == 2
    for logprob, greedy in results:
        assert math.isfinite(logprob) and logprob < 0 and isinstance(greedy, bool)
