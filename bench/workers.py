"""What the engine-worker boundary costs: octo's llama.cpp engine in a worker process vs in the gateway process.

Two `octo serve` processes on the same synthetic Qwen2.5-0.5B-shaped Q4_K_M GGUF, identical flags but
``--isolation process`` (the default for llama.cpp) and ``--isolation thread`` (the model inside the gateway, as
before workers existed). Rounds alternate the two servers at each load so that drift on a shared host hits both.

* decode tok/s aggregate over N concurrent greedy streams (N = 1, 8, 16), measured differentially as in
  bench/llamacpp.py (two max_tokens, end-of-generation tokens banned, every stream checked for "length");
* time to first token with 1 and 8 concurrent streams (distinct ~20-token prompts, streaming completions): the time
  to the first SSE chunk of each stream, p50 over the streams, median over ``--ttft-reps`` rounds, and the mean over
  every stream of every round (``ttft_row``: at 8 streams the p50 follows how the prompts fell into steps).

    flock /tmp/octo-bench.lock .venv/bin/python bench/workers.py     # part of bench/run.py streams
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_llamacpp", REPO / "bench" / "llamacpp.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)
MODES = ("process", "thread")


async def ttft_streams(base: str, n: int, tag: str) -> list[float]:
    """The times to their first SSE chunk of ``n`` concurrent streams, sorted."""
    import aiohttp

    async def one(session, i: int) -> float:
        body = {"prompt": lc.prompt(i, tag), "max_tokens": 8, "temperature": 0, "stream": True,
                "logit_bias": lc.no_eos_bias()}
        t0 = time.perf_counter()
        first = None
        async with session.post(f"{base}/v1/completions", json=body) as r:
            async for raw in r.content:
                if raw.startswith(b"data:") and first is None:
                    first = time.perf_counter() - t0
        return first

    async with aiohttp.ClientSession() as s:
        return sorted(await asyncio.gather(*(one(s, i) for i in range(n))))


def ttft_row(runs: dict[str, list[list[float]]]) -> dict:
    """Each mode's median over the rounds of a round's p50 over its streams, and the mean over every stream of every
    round. With several streams the p50 depends on how their prompts fell into the engine's first steps (all in one,
    or a first few alone and the rest in the next: whoever arrives before the engine starts), which can differ by
    hundreds of milliseconds from one round to the next; the mean weighs both groups."""
    p50 = {m: statistics.median(statistics.median(r) for r in v) for m, v in runs.items()}
    mean = {m: statistics.fmean(t for r in v for t in r) for m, v in runs.items()}
    return {"process_p50_ms": round(1000 * p50["process"], 1), "thread_p50_ms": round(1000 * p50["thread"], 1),
            "delta_ms": round(1000 * (p50["process"] - p50["thread"]), 1),
            "process_mean_ms": round(1000 * mean["process"], 1), "thread_mean_ms": round(1000 * mean["thread"], 1),
            "mean_delta_ms": round(1000 * (mean["process"] - mean["thread"]), 1),
            "runs": {m: [[round(t, 4) for t in r] for r in v] for m, v in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttft-reps", type=int, default=9, help="rounds of the time-to-first-token loads (noisier)")
    ap.add_argument("--flash", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "workers.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    ports = {m: lc.free_port() for m in MODES}
    rows: dict = {"decode": {}, "ttft": {}}
    with lc.server(lc.octo_cmd(path, ports["process"], args, 16) + ["--isolation", "process"], ports["process"],
                   "/health", "octo-process") as proc_base, \
            lc.server(lc.octo_cmd(path, ports["thread"], args, 16) + ["--isolation", "thread"], ports["thread"],
                      "/health", "octo-thread") as thread_base:
        bases = {"process": proc_base, "thread": thread_base}
        for base in bases.values():  # warm-up
            asyncio.run(lc.load(base, 2, 8, "warm"))
        lc.settle()  # (only the worker-process server starts a spare worker: not in its first round)
        for n in args.streams:
            runs: dict[str, list[float]] = {m: [] for m in MODES}
            for k in range(args.reps):
                for m in MODES if k % 2 == 0 else reversed(MODES):
                    rate, _ = lc.decode_rate(bases[m], n, args, f"{m}{n}{k}")
                    runs[m].append(rate)
                    print(f"{n:2d} streams {m:7s} {rate:7.1f} tok/s", file=sys.stderr, flush=True)
            med = {m: statistics.median(v) for m, v in runs.items()}
            rows["decode"][str(n)] = {"process_tok_s": round(med["process"], 2),
                                      "thread_tok_s": round(med["thread"], 2),
                                      "ratio": round(med["process"] / med["thread"], 3), "runs": runs}
        for n in (1, 8):
            runs = {m: [] for m in MODES}
            for k in range(args.ttft_reps):
                for m in MODES if k % 2 == 0 else reversed(MODES):
                    runs[m].append(asyncio.run(ttft_streams(bases[m], n, f"t{m}{n}{k}")))
            rows["ttft"][f"{n}_streams"] = ttft_row(runs)
    report = {"model": {"path": path, "shape": args.shape, "quant": args.quant}, "threads": args.threads,
              "host": lc.host_info(args), **rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for n, r in rows["decode"].items():
        print(f"{n:>2} streams: process {r['process_tok_s']:7.1f} tok/s, thread {r['thread_tok_s']:7.1f} tok/s, "
              f"ratio {r['ratio']:.3f}")
    for n, t in rows["ttft"].items():
        print(f"TTFT p50 at {n.replace('_', ' ')}: process {t['process_p50_ms']} ms, thread {t['thread_p50_ms']} ms "
              f"({t['delta_ms']:+} ms); mean {t['process_mean_ms']} / {t['thread_mean_ms']} ms "
              f"({t['mean_delta_ms']:+} ms)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
