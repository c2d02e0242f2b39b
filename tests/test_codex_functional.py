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
import time

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
KEEPALIVE = 1.0  # --stream-keepalive: short, so that even a fast host's prefill shows several
GAP_SLACK = 5.0  # what a busy host may add to a keep-alive's interval
LONG_RUN_S = 2400  # a real prompt's prefill on 2 busy cores (the 0.5B model: tests/agentwire.py)


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


# -- Codex's real prompt on a real model: a long prefill, the stream stays alive --------------------------------------
@pytest.mark.slow
def test_codex_default_run_on_a_real_model_keeps_its_stream(tmp_path):
    """Codex with its default settings on a synthetic GGUF through llama.cpp (tests/agentwire.py: ``demo``, or the
    Qwen2.5-0.5B shape with ``OCTO_AGENT_TEST_MODEL=qwen2.5-0.5b``): its real prompt (its system prompt and tools,
    about 22,000 tokens of this tokenizer) prefills for a minute or more, and octo's repeated
    ``response.in_progress`` events keep Codex's stream alive throughout (on the 0.5B model the prefill outlasts Codex's
    300 s SSE idle timeout, which would otherwise drop the stream and send the whole request again: "Reconnecting...
    1/5"). The model's end-of-turn token is as likely as its favourite word, so its random answer ends after a few
    tokens and the task completes. A pass-through proxy records the wire: the request answered once, keep-alives
    before the first output at most ``--stream-keepalive`` apart (with slack for a busy host)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from agentwire import SERVE_CONTEXT, agent_model, first_output, gaps_before, no_repeats, tap

    codex = codex_binary()
    if codex is None or shutil.which("node") is None:
        pytest.skip("Codex CLI (scripts/system-deps.sh) or node not found")
    model = agent_model()
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with run_octo(str(model), "--engine", "llamacpp", "--stream-keepalive", str(KEEPALIVE), *SERVE_CONTEXT,
                  timeout=600) as server:
        name = server.openai().models.list().data[0].id
        with tap(server.base_url) as (url, seen):
            (home / "config.toml").write_text(CONFIG.replace("test-model", name).replace(
                "http://127.0.0.1:{port}", url))
            env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL",
                                                                     "CODEX_API_KEY")}
            env.update({"CODEX_HOME": str(home), "NO_COLOR": "1"})
            t0 = time.monotonic()
            cmd = [*codex, "exec", "--strict-config", "--skip-git-repo-check", "--json", "-C", str(work), "Say hello."]
            proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=LONG_RUN_S)
            took = time.monotonic() - t0
        log = server.log()
    posts = [r for r in seen if r["method"] == "POST"]
    detail = (f"codex exit {proc.returncode} after {took:.0f} s\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n"
              f"{proc.stderr[-3000:]}\nwire: {[(r['path'], r['status'], len(r['events'])) for r in seen]}\n"
              f"octo log:\n{log[-3000:]}")
    assert proc.returncode == 0 and "Reconnecting" not in proc.stderr, detail
    kinds = [json.loads(line)["type"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, detail
    assert no_repeats(posts)[0][:2] == ("/v1/responses", 200), detail  # never the same request again
    rec = posts[0]
    done = [json.loads(line[5:]) for line in rec["answer"].decode().splitlines()
            if line.startswith("data:") and '"response.completed"' in line]
    assert done and done[0]["response"]["usage"]["input_tokens"] > 15000, detail  # Codex's real prompt
    first = first_output(rec, ("response.created", "response.in_progress"))
    assert first is not None and first > 3 * KEEPALIVE, (first, detail)  # a prefill long enough to show them
    beats = [k for t, k in rec["events"] if t < first and k == "response.in_progress"]
    assert len(beats) >= 3, (beats, detail)
    assert max(gaps_before(rec, first)) < KEEPALIVE + GAP_SLACK, (gaps_before(rec, first), detail)
