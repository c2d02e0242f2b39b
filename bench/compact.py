"""KV compaction in llama.cpp's unified pool, measured in lockstep: N short greedy streams (16-token prompts, 144
tokens each) on three engines in one process, one step of each in turn (their order alternating), so that a host
whose speed drifts slows all three alike: the unified pool without compaction (``-o kv_compact=false``), with it
(the default), and per-sequence streams (``kv_unified=false``, what llama-server runs with ``-np N``). Decode tok/s per
engine and per 16-step window (the cells in use grow from 16 to 160 a sequence), and how many compaction passes ran.

    flock /tmp/octo-bench.lock .venv/bin/python bench/compact.py --streams 8 16   # bench/results/compact.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from llamacpp import run_levels  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402

VARIANTS = {"unified": {"kv_unified": "true", "kv_compact": "false"},
            "unified+compaction": {"kv_unified": "true"},
            "streams": {"kv_unified": "false"}}


def level(path: str, n: int, reps: int, args) -> dict:
    from octo.engines.llamacpp import LlamaCppEngine

    engines = {}
    for name, opts in VARIANTS.items():
        e = LlamaCppEngine(EngineConfig(max_batch=n, options={**opts, "n_threads": str(args.threads),
                                                              "flash_attn": "on"}))
        e.load(path, name)
        engines[name] = e
    windows = args.long // 16
    took = {name: [0.0] * windows for name in engines}
    try:
        for rep in range(reps):
            state = {}
            for name, e in engines.items():
                seqs = [Sequence(i, [(31 * i + 7 * k + 101 * rep) % 5000 + 10 for k in range(16)],
                                 SamplingParams(temperature=0)) for i in range(n)]
                for s in seqs:
                    e.add_sequence(s)
                state[name] = (seqs, e.step([Feed(s, s.tokens, True) for s in seqs]))  # the prompts: untimed
            for step in range(windows * 16):
                for name in (list(engines) if step % 2 == 0 else list(engines)[::-1]):
                    seqs, outs = state[name]
                    for s, o in zip(seqs, outs, strict=True):
                        s.tokens.append(o)
                    t0 = time.perf_counter()
                    outs = engines[name].step([Feed(s, s.tokens[-1:], True) for s in seqs])
                    took[name][step // 16] += time.perf_counter() - t0
                    state[name] = (seqs, outs)
            for name, e in engines.items():
                for s in state[name][0]:
                    e.remove_sequence(s)
            rates = {k: round(n * 16 * windows * (rep + 1) / sum(v), 2) for k, v in took.items()}
            print(n, rep, rates, file=sys.stderr, flush=True)
        tok_s = {k: round(n * 16 * windows * reps / sum(v), 2) for k, v in took.items()}
        return {
            "reps": reps,
            "decode_tok_s": tok_s,
            "over_streams": {k: round(v / tok_s["streams"], 3) for k, v in tok_s.items()},
            "step_ms_per_window": {k: [round(x / reps / 16 * 1e3, 1) for x in v] for k, v in took.items()},
            "compaction_passes": engines["unified+compaction"].cells.compactions,
        }
    finally:
        for e in engines.values():
            e.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reps", type=int, nargs="+", default=[4, 3], help="repetitions per level (the last repeats)")
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "compact.json"))
    args = ap.parse_args()
    run_levels(args, level, args.reps, "step_ms_per_window")


if __name__ == "__main__":
    main()
