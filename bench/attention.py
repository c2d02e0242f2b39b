"""Does a sequence's decode pay for cells other sequences hold? llama.cpp engine, in process, no server.

    flock /tmp/octo-bench.lock .venv/bin/python bench/attention.py      # writes bench/results/attention.json

4 sequences with --context (2,000) tokens each decode --steps tokens together, with and without 4 more idle
prefixes of the same length held in the KV (prefix-cache entries, as an agent server keeps them), for each KV
layout: ``kv_unified=true`` (one pool; entries are shared cells in it, until the engine moves idle ones to RAM) and
``kv_unified=false`` (a stream per sequence; entries are RAM snapshots). ``idle_cells_in_pool`` says how many cells
of the idle entries were still in the pool while the 4 sequences decoded. Alternating A/B --reps times; the median
decode tok/s of each is reported with
the ratio idle-prefixes / none. Model: the synthetic Qwen2.5-0.5B-shaped GGUF, Q4_K_M, --threads (2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(path: str, unified: bool, idle: int, args) -> float:
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig, Feed, SamplingParams, Sequence

    opts = {"n_threads": str(args.threads), "kv_unified": str(unified).lower(), "n_ctx": str(args.context + 256)}
    if unified:
        opts["kv_cells"] = str((args.context + 256) * 8)
    e = LlamaCppEngine(EngineConfig(max_batch=8, options=opts))
    e.load(path, "m")
    try:
        toks = [(7 * j) % 5000 + 10 for j in range(args.context)] + [5]
        first = Sequence(99, list(toks), SamplingParams(temperature=0))
        e.add_sequence(first)
        for k in range(0, args.context, 512):
            e.step([Feed(first, toks[k:min(k + 512, args.context)], False)])
        snap = e.cells.snapshot(first)  # a copy in RAM: restoring it writes cells of their own
        e.remove_sequence(first)

        def filled(i: int) -> Sequence:
            s = Sequence(i, list(toks), SamplingParams(temperature=0))
            e.add_sequence(s)
            e.kv_restore(s, snap, args.context)
            assert s.n_cached == args.context
            return s

        handles = []
        for i in range(idle):  # idle prefixes kept as the prefix cache keeps them
            s = filled(100 + i)
            handles.append(e.kv_save(s))
            e.remove_sequence(s)
        seqs = [filled(i) for i in range(4)]
        feeds = [Feed(s, [5], True) for s in seqs]
        e.step(feeds)  # warm
        t0 = time.perf_counter()
        for _ in range(args.steps):
            e.step(feeds)
        rate = 4 * args.steps / (time.perf_counter() - t0)
        in_pool = sum(h.cells for h in handles if h is not None)
        for s in seqs:
            e.remove_sequence(s)
        for h in handles:
            e.kv_free(h)
        return rate, in_pool
    finally:
        e.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "attention.json"))
    args = ap.parse_args()
    from octo.engines.llamacpp.native import LogTap

    from octo.synth.gguf import build_gguf

    LogTap.install()
    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    runs: dict[str, list[float]] = {}
    pool: dict[str, int] = {}
    for _ in range(args.reps):
        for unified in (True, False):
            for idle in (0, 4):
                key = f"{'unified' if unified else 'streams'}_idle{idle}"
                rate, pool[key] = run(path, unified, idle, args)
                runs.setdefault(key, []).append(round(rate, 2))
                print(key, runs[key][-1], "idle cells in the pool:", pool[key], flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    summary = {"decode_tok_s": med,
               "ratio_idle4_over_none": {lay: round(med[f"{lay}_idle4"] / med[f"{lay}_idle0"], 3)
                                         for lay in ("unified", "streams")},
               "ratio_unified_over_streams": round(med["unified_idle0"] / med["streams_idle0"], 3),
               "idle_cells_in_pool": pool}
    out = {"summary": summary, "runs": runs, "config": vars(args)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
