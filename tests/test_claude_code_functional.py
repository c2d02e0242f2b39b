"""Claude Code (Anthropic's coding agent, `claude -p`) completing one non-interactive task against a real `octo serve`
through `/v1/messages`. The echo engine is the scripted model: the task prompt holds a Hermes call of Claude Code's
`Bash` tool, Claude Code runs the command and sends its output back as a `tool_result`, and the echo model answers
with that result as text, which ends the turn.

What Claude Code 2.1 sends and octo honours: a system turn inside `messages` (beta mid-conversation-system), `thinking:
{"type": "adaptive"}` (a model with no reasoning mode answers directly), `output_config.effort` "high" (the default),
a `clear_thinking_20251015` context edit (earlier thinking is never re-sent to the model), `metadata.user_id` as a
JSON string, 24 tools with 2020-12 JSON schemas, and `max_tokens` 32,000 whatever the model: beyond the context
window octo generates to the window's end (`model_context_window_exceeded`), as Anthropic's API does. The context
here (32,768) is smaller than Claude Code's prompt (~11,000 tokens) + 32,000, so that path is taken.

Claude Code comes from npm: `scripts/system-deps.sh` (run by `make test`) installs the pinned version into `.cache/npm`;
the test skips when neither that nor a `claude` in PATH is found. As root it refuses `--dangerously-skip-permissions`
unless `IS_SANDBOX=1` says it runs in a sandbox (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from serverproc import REPO, run_octo

LOCAL_CLAUDE = REPO / ".cache" / "npm" / "bin" / "claude"  # where scripts/system-deps.sh puts it
MARK = "octo-was-here"
CALL = {"name": "Bash", "arguments": {"command": f"echo {MARK} | tee out.txt", "description": "Write a file"}}
PROMPT = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


def claude_binary() -> str | None:
    """npm's bin link, the package's own binary (an npm that left no bin link), or a `claude` in PATH."""
    package = LOCAL_CLAUDE.parent.parent / "lib" / "node_modules" / "@anthropic-ai" / "claude-code" / "bin"
    package = package / "claude.exe"
    for found in (LOCAL_CLAUDE, package):
        if found.exists():
            return str(found)
    return shutil.which("claude")


def test_claude_code_runs_a_bash_command_through_messages(tmp_path):
    claude = claude_binary()
    if claude is None:
        pytest.skip(f"Claude Code not found (neither {LOCAL_CLAUDE} nor `claude` in PATH): scripts/system-deps.sh "
                    "installs it with npm")
    if shutil.which("node") is None:
        pytest.skip("Claude Code is installed but `node` is not in PATH")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with run_octo("test-model", "--engine", "echo", "-o", "n_ctx=32768", "--log-level", "debug") as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
        env.update({"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "IS_SANDBOX": "1",
                    "ANTHROPIC_BASE_URL": server.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": "dummy",
                    "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"})
        cmd = [claude, "-p", PROMPT, "--model", "test-model", "--dangerously-skip-permissions",
               "--output-format", "json"]
        proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=180)
        log = server.log()
    detail = f"claude exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nocto log:\n{log[-4000:]}"
    assert proc.returncode == 0, detail
    assert (work / "out.txt").read_text() == MARK + "\n", detail
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["subtype"] == "success" and not result["is_error"], detail
    assert result["num_turns"] == 2, detail  # the tool call, then the answer to its result
    # the echo model's last answer is the command's output, so the tool_result went through octo
    assert MARK in result["result"], detail
    # the second turn's prompt starts with the first one's: the prefix cache served it
    assert result["usage"]["cache_read_input_tokens"] > 5000, detail
