"""Claude Code (Anthropic's coding agent, `claude -p`) completing one non-interactive task against a real `octo serve`
through `/v1/messages`. The echo engine is the scripted model: the task prompt holds a Hermes call of Claude Code's
`Bash` tool, Claude Code runs the command and sends its output back as a `tool_result`, and the echo model answers
with that result as text, which ends the turn.

What Claude Code 2.1.332 sends and octo honours: tools with `defer_loading: true` and its own client-side
`ToolSearch` tool (the deferred tools stay out of the prompt: octo once answered them with a 400, and Claude Code then
sent every tool, a prompt about 60% larger), `thinking: {"type": "adaptive", "display": "omitted"}` (a model with no
reasoning mode streams its text as it comes, one `text_delta` per token), a system turn inside `messages` (beta
mid-conversation-system), `output_config.effort` "high" (the default), a `clear_thinking_20251015` context edit,
`metadata.user_id` as a JSON string, 2020-12 JSON schemas, and `max_tokens` 32,000 whatever the model: beyond the
context window octo generates to the window's end (`model_context_window_exceeded`), as Anthropic's API does.

A recording proxy between Claude Code and octo keeps what went over the wire. A second run goes through the proxy
answering deferred tools as octo did before (a 400 naming `defer_loading`): Claude Code falls back to sending every
tool, and `count_tokens` shows the deferred request is the smaller prompt.

Claude Code comes from npm: `scripts/system-deps.sh` (run by `make test`) installs the pinned version into `.cache/npm`;
the test skips when neither that nor a `claude` in PATH is found. As root it refuses `--dangerously-skip-permissions`
unless `IS_SANDBOX=1` says it runs in a sandbox (CI runs as root)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

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


class Recorder(http.server.BaseHTTPRequestHandler):
    """Forwards each request to octo and records it with its answer (``refuse_deferred``: answer a request with a
    deferred tool as octo once did, a 400 naming the field)."""

    upstream = ""
    refuse_deferred = False
    seen: list[dict] = []
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.loads(raw) if raw else {}
        deferred = [i for i, t in enumerate(body.get("tools") or []) if t.get("defer_loading")]
        if self.refuse_deferred and deferred:
            error = {"type": "invalid_request_error",
                     "message": f"Unrecognized argument in tools[{deferred[0]}]: defer_loading"}
            status, kind = 400, "application/json"
            data = json.dumps({"type": "error", "error": error}).encode()
        else:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            req = urllib.request.Request(self.upstream + self.path, data=raw, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=170) as r:
                    status, data, kind = r.status, r.read(), r.headers.get("content-type", "")
            except urllib.error.HTTPError as e:
                status, data, kind = e.code, e.read(), e.headers.get("content-type", "")
        self.seen.append({"path": self.path, "body": body, "status": status, "answer": data.decode()})
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def recording(upstream: str, refuse_deferred: bool = False):
    handler = type("Rec", (Recorder,), {"upstream": upstream, "refuse_deferred": refuse_deferred, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()


def run_claude(claude: str, base_url: str, home, work, prompt: str = PROMPT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update({"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "IS_SANDBOX": "1",
                "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "dummy",
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"})
    cmd = [claude, "-p", prompt, "--model", "test-model", "--dangerously-skip-permissions", "--output-format", "json"]
    return subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=180)


def count_tokens(base_url: str, body: dict) -> int:
    keep = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "context_management"}
    data = json.dumps({k: v for k, v in body.items() if k in keep}).encode()
    req = urllib.request.Request(base_url + "/v1/messages/count_tokens", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["input_tokens"]


def text_deltas(sse: str) -> tuple[int, int]:
    """The ``text_delta`` events of a streamed answer, and its output tokens."""
    data = [json.loads(line[5:]) for line in sse.splitlines() if line.startswith("data:")]
    deltas = sum(1 for d in data if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta")
    return deltas, next(d["usage"]["output_tokens"] for d in data if d["type"] == "message_delta")


def installed_claude() -> str:
    claude = claude_binary()
    if claude is None:
        pytest.skip(f"Claude Code not found (neither {LOCAL_CLAUDE} nor `claude` in PATH): scripts/system-deps.sh "
                    "installs it with npm")
    if shutil.which("node") is None:
        pytest.skip("Claude Code is installed but `node` is not in PATH")
    return claude


def test_claude_code_runs_a_bash_command_through_messages(tmp_path):
    claude = installed_claude()
    home, work, home2, work2 = (tmp_path / d for d in ("home", "work", "home2", "work2"))
    for d in (home, work, home2, work2):
        d.mkdir()
    with run_octo("test-model", "--engine", "echo", "-o", "n_ctx=32768", "--log-level", "debug") as server:
        with recording(server.base_url) as (url, seen):
            proc = run_claude(claude, url, home, work)
        with recording(server.base_url, refuse_deferred=True) as (url, seen_before):
            before = run_claude(claude, url, home2, work2)  # as against octo before it took defer_loading
        sent = [r for r in seen if r["path"].startswith("/v1/messages") and "count_tokens" not in r["path"]]
        fallback = [r for r in seen_before if r["status"] == 200 and r["path"].startswith("/v1/messages")
                    and "count_tokens" not in r["path"]]
        smaller = count_tokens(server.base_url, sent[0]["body"]) if sent else 0
        larger = count_tokens(server.base_url, fallback[0]["body"]) if fallback else 0
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
    # what went over the wire: every request answered (no 400 and retry), tools deferred, adaptive thinking streamed
    assert [r["status"] for r in sent] == [200] * len(sent) and len(sent) == 2, [(r["path"], r["status"]) for r in sent]
    first = sent[0]["body"]
    assert any(t.get("defer_loading") for t in first["tools"]), [t["name"] for t in first["tools"]]
    assert first["thinking"]["type"] == "adaptive" and first["stream"] is True
    deltas, tokens = text_deltas(sent[-1]["answer"])
    assert deltas == tokens > 3, sent[-1]["answer"][:2000]  # one per token, not one at the end
    # refused, Claude Code sends every tool instead: the prompt octo now spares it
    assert before.returncode == 0 and fallback, (before.stdout, before.stderr)
    assert not any(t.get("defer_loading") for t in fallback[0]["body"]["tools"])
    assert len(fallback[0]["body"]["tools"]) > len(first["tools"])
    assert smaller < larger * 0.8, (smaller, larger)


def test_claude_codes_tool_search_loads_a_deferred_tool(tmp_path):
    """The scripted model calls Claude Code's ToolSearch for a deferred tool (WebFetch); Claude Code answers with a
    ``tool_reference`` and sends the tool, still deferred: octo expands its definition where the reference stands,
    and the echo model's answer (that tool result) shows it."""
    claude = installed_claude()
    search = {"name": "ToolSearch", "arguments": {"query": "select:WebFetch"}}
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with run_octo("test-model", "--engine", "echo", "-o", "n_ctx=32768") as server:
        with recording(server.base_url) as (url, seen):
            proc = run_claude(claude, url, home, work, f"<tool_call>\n{json.dumps(search)}\n</tool_call>")
    sent = [r for r in seen if r["path"].startswith("/v1/messages") and "count_tokens" not in r["path"]]
    assert proc.returncode == 0 and len(sent) == 2, (proc.stdout, proc.stderr, [r["status"] for r in sent])
    assert [r["status"] for r in sent] == [200, 200], [r["answer"][:500] for r in sent]
    second = sent[1]["body"]
    assert any(t["name"] == "WebFetch" and t.get("defer_loading") for t in second["tools"])
    result = second["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and {"type": "tool_reference", "tool_name": "WebFetch"} in result["content"]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])["result"]
    assert "<functions>" in answer and '\\"name\\": \\"WebFetch\\"' in answer, answer[:1000]


# -- Claude Code's real prompt on a real model: a long prefill, the stream stays alive ---------------------------------
KEEPALIVE = 1.0  # --stream-keepalive: short, so that even a fast host's prefill shows several
GAP_SLACK = 5.0  # what a busy host may add to a keep-alive's interval
LONG_RUN_S = 2400  # a real prompt's prefill on 2 busy cores (the 0.5B model: tests/agentwire.py)


@pytest.mark.slow
def test_claude_code_default_run_on_a_real_model_keeps_its_stream(tmp_path):
    """Claude Code with its default settings on a synthetic GGUF through llama.cpp (tests/agentwire.py: ``demo``, or
    the Qwen2.5-0.5B shape with ``OCTO_AGENT_TEST_MODEL=qwen2.5-0.5b``): its real prompt (system prompt and tools,
    deferred ones left out: about 27,000 tokens of this tokenizer) prefills for a minute or more, and octo's ``ping``
    events keep Claude Code's stream alive throughout (its watchdogs would otherwise drop it and send the request
    again with ``stream: false``, paying the prefill twice; they allow about 10 minutes with keep-alives,
    docs/agents.md). The model's end-of-turn token is as likely as its favourite word, so its random answer ends
    after a few tokens and the task completes. A pass-through proxy records the wire: the first turn streamed, answered
    once (never sent again), pings before the first output at most ``--stream-keepalive`` apart (with slack for a
    busy host)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from agentwire import SERVE_CONTEXT, agent_model, first_output, gaps_before, no_repeats, tap

    claude = installed_claude()
    model = agent_model()
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with run_octo(str(model), "--engine", "llamacpp", "--stream-keepalive", str(KEEPALIVE), *SERVE_CONTEXT,
                  timeout=600) as server:
        name = server.openai().models.list().data[0].id
        with tap(server.base_url) as (url, seen):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
            env.update({"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "IS_SANDBOX": "1",
                        "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy", "DISABLE_TELEMETRY": "1",
                        "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"})
            cmd = [claude, "-p", "Say hello.", "--model", name, "--dangerously-skip-permissions", "--output-format",
                   "json"]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=LONG_RUN_S)
            took = time.monotonic() - t0
        log = server.log()
    posts = [r for r in seen if r["method"] == "POST" and "count_tokens" not in r["path"]]
    detail = (f"claude exit {proc.returncode} after {took:.0f} s\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n"
              f"{proc.stderr[-3000:]}\nwire: {[(r['path'], r['status'], len(r['events'])) for r in seen]}\n"
              f"octo log:\n{log[-3000:]}")
    assert proc.returncode == 0, detail
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["subtype"] == "success" and not result["is_error"], detail
    # the first turn streamed and answered once: never the watchdog's repeat with stream false (a long random answer
    # may bring a next request, never the same one again)
    assert no_repeats(posts)[0] == ("/v1/messages", 200, True), detail
    rec = posts[0]
    start = next(json.loads(line[5:]) for line in rec["answer"].decode().splitlines()
                 if line.startswith("data:") and '"message_start"' in line)
    assert start["message"]["usage"]["input_tokens"] > 20000, detail  # Claude Code's real prompt
    first = first_output(rec, ("message_start", "ping"))
    assert first is not None and first > 3 * KEEPALIVE, (first, detail)  # a prefill long enough to show them
    assert sum(1 for t, k in rec["events"] if t < first and k == "ping") >= 3, detail
    assert max(gaps_before(rec, first)) < KEEPALIVE + GAP_SLACK, (gaps_before(rec, first), detail)
