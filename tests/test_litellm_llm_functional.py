"""litellm (openai/ and anthropic/ providers) and Simon Willison's `llm` CLI against a real `octo serve` (echo engine,
the scripted model: it repeats the last user message, so a Hermes call in it is a scripted tool call).

Both clients pin the openai SDK below 3 (litellm 1.106, llm 0.32), while the OpenAI Agents SDK this suite also runs
needs openai 3: they cannot share one environment, so they live in their own venv under `.cache/clients-venv`
(git-ignored), made on first use (`pip install litellm mcp llm`: this litellm imports mcp without requiring it); the
tests skip, saying why, when it cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "clients-venv"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def py() -> str:
    python = VENV / "bin" / "python"
    if not (VENV / "bin" / "llm").exists() or not any((VENV / "lib").glob("python*/site-packages/mcp")):
        try:
            if not python.exists():
                subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=300)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "litellm", "mcp",
                            "llm"], check=True, capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"could not make the litellm/llm venv in {VENV}: {exc}")
    return str(python)


LITELLM = r'''
import json, sys
import litellm
base, model, provider = sys.argv[1], sys.argv[2], sys.argv[3]
litellm.telemetry = False
kw = {"model": f"{provider}/{model}", "api_key": "none", "max_tokens": 64,
      "api_base": base + ("/v1" if provider == "openai" else "")}
out = {}
r = litellm.completion(messages=[{"role": "user", "content": "hello from litellm"}], **kw)
out["text"] = r.choices[0].message.content
chunks = litellm.completion(messages=[{"role": "user", "content": "streamed words"}], stream=True, **kw)
out["stream"] = "".join((c.choices[0].delta.content or "") for c in chunks)
r = litellm.completion(messages=[{"role": "user", "content": sys.argv[4]}], tools=json.loads(sys.argv[5]), **kw)
calls = r.choices[0].message.tool_calls or []
out["calls"] = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
out["finish"] = r.choices[0].finish_reason
print(json.dumps(out))
'''


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm(py, echo_server, provider):
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    run = subprocess.run([py, "-c", LITELLM, f"http://127.0.0.1:{echo_server.port}", "test-model", provider, CALL,
                          json.dumps(TOOLS)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["text"] == "hello from litellm"
    assert out["stream"] == "streamed words"
    assert out["calls"] == [["get_weather", {"city": "Paris"}]]
    assert out["finish"] == "tool_calls"


def test_llm_cli(py, echo_server, tmp_path):
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: octo-test\n  model_name: test-model\n  api_base: http://127.0.0.1:{echo_server.port}/v1\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "none"}
    llm = str(Path(py).parent / "llm")
    for extra in ([], ["--no-stream"]):
        run = subprocess.run([llm, "-m", "octo-test", *extra, "hello there from llm"], capture_output=True, text=True,
                             timeout=120, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == "hello there from llm"
