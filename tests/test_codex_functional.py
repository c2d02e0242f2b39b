"""Codex CLI (OpenAI's coding agent, `codex exec`) completing one non-interactive task against a real `octo serve`
through `/v1/responses`. The echo engine is the scripted model: the task prompt holds a Hermes call of Codex's shell
tool (`exec_command`), Codex runs the command in its sandbox and sends the output back as a `function_call_output`,
and the echo model answers with that output as text, which ends the turn.

Codex runs with its DEFAULT settings: the config only names a custom provider (`base_url`, `wire_api =
"responses"`). So every turn is `stream: true, store: false` with `include: ["reasoning.encrypted_content"]` and
`reasoning: {"summary": "auto"}` (accepted: octo's models produce no reasoning, so there is nothing to include or
summarise), `prompt_cache_key`, `parallel_tool_calls`, `client_metadata` (its session identifiers, logged at debug
level), a `namespace` tool of sub-agent functions (offered to the model under their flat names) and the built-in
`web_search` tool (not offered to the model: octo cannot run it; an `x-octo-warning` header says so). docs/agents.md
has the decision per field.

Codex comes from npm: `scripts/system-deps.sh` (run by `make test`) installs the pinned version into `.cache/npm`; the
test skips when neither that nor a `codex` in PATH is found."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from serverproc import REPO, run_octo

LOCAL_CODEX = REPO / ".cache" / "npm" / "bin" / "codex"  # where scripts/system-deps.sh puts it
MARK = "octo-was-here"
CALL = {"name": "exec_command", "arguments": {"cmd": f"echo {MARK} | tee out.txt"}}  # Codex's shell tool
PROMPT = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
CONFIG = """\
model = "test-model"
model_provider = "octo"

[model_providers.octo]
name = "octo"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
"""


def codex_binary() -> list[str] | None:
    """The command that runs Codex: npm's bin link, its package's launcher run by node (an npm that left no bin
    link), or a `codex` in PATH."""
    if LOCAL_CODEX.exists():
        return [str(LOCAL_CODEX)]
    script = LOCAL_CODEX.parent.parent / "lib" / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    if script.exists() and shutil.which("node"):
        return [shutil.which("node"), str(script)]
    found = shutil.which("codex")
    return [found] if found else None


def test_codex_exec_runs_a_shell_command_through_responses(tmp_path):
    codex = codex_binary()
    if codex is None:
        pytest.skip(f"Codex CLI not found (neither {LOCAL_CODEX} nor `codex` in PATH): scripts/system-deps.sh "
                    "installs it with npm")
    if shutil.which("node") is None:
        pytest.skip("Codex CLI is installed but `node` is not in PATH")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with run_octo("test-model", "--engine", "echo", "--log-level", "debug") as server:
        (home / "config.toml").write_text(CONFIG.format(port=server.port))
        env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
        for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY"):
            env.pop(key, None)
        cmd = [*codex, "exec", "--strict-config", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json",
               "-C", str(work), PROMPT]
        proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=180)
        log = server.log()
    detail = f"codex exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nocto log:\n{log[-4000:]}"
    assert proc.returncode == 0, detail
    assert (work / "out.txt").read_text() == MARK + "\n", detail
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, detail
    done = [e["item"] for e in events if e["type"] == "item.completed"]
    commands = [it for it in done if it["type"] == "command_execution"]
    assert len(commands) == 1 and commands[0]["exit_code"] == 0 and MARK in commands[0]["command"], detail
    # the echo model's last answer is the tool output, so the function_call_output went through octo
    messages = [it for it in done if it["type"] == "agent_message"]
    assert messages and MARK in messages[-1]["text"], detail
    assert "client_metadata" in log, detail
