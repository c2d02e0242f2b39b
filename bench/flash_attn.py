"""llama.cpp's flash attention on the CPU: what a step costs with it (``flash_attn=auto``, octo's and llama-server's
default, which turns it on) and without it (``flash_attn=off``), in process, no server.

    flock /tmp/octo-bench.lock .venv/bin/python bench/flash_attn.py      # writes bench/results/flash_attn.json

Two llama.cpp engines on the same GGUF live in this process, one per setting, and every round measures both,
alternating which goes first: a cold prefill of --context tokens in 256-token chunks; a step of 8, 57, 64 and 200 new
tokens on top of that context (what an agent's next turn sends after its restored prefix; rolled back after each);
single-sequence decode at that context; and, with short prompts, decode of 8 sequences together and of one alone.
Medians over --rounds, and the ratio off / auto of each (below 1: turning flash attention off is faster).
Model: the synthetic Qwen2.5-0.5B-shaped GGUF, Q4_K_M, --threads (2); the KV cache in f16 (a quantized KV cache
needs flash attention).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OCTO_LLAMACPP_KV_UNIFIED", "true")  # the same pool for both: no layout probe between them


def prefill(e, s, upto: int, chunk: int = 256) -> None:
    from octo.engine import Feed

    while s.n_cached < upto:
        k = min(chunk, upto - s.n_cached)
        e.step([Feed(s, s.tokens[s.n_cached:s.n_cached + k], False)])


def one_round(e, ctx: int, rng: random.Random, ids, rec) -> None:
    from octo.engine import Feed, SamplingParams, Sequence

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    s = Sequence(next(ids), toks(ctx + 200), SamplingParams())
    e.add_sequence(s)
    t = time.perf_counter()
    prefill(e, s, ctx)
    rec(f"prefill_{ctx}_s", time.perf_counter() - t)
    for ext in (8, 57, 64, 200):
        t = time.perf_counter()
        e.step([Feed(s, s.tokens[ctx:ctx + ext], True)])
        rec(f"step_{ext}_new_at_{ctx}_s", time.perf_counter() - t)
        e.kv_rollback(s, ctx)
    del s.tokens[ctx + 1:]
    t = time.perf_counter()
    for _ in range(8):
        e.step([Feed(s, s.tokens[-1:], True)])
        s.tokens.append(rng.randrange(100, 20000))
    rec(f"decode_1_at_{ctx}_s", (time.perf_counter() - t) / 8)
    e.remove_sequence(s)
    short = [Sequence(next(ids), toks(64), SamplingParams()) for _ in range(8)]
    for q in short:
        e.add_sequence(q)
    e.step([Feed(q, q.tokens[:], True) for q in short])
    for n, name in ((8, "decode_8_short_s"), (1, "decode_1_short_s")):
        for q in short[:n]:
            q.tokens.append(rng.randrange(100, 20000))
        t = time.perf_counter()
        for _ in range(16):
            e.step([Feed(q, q.tokens[-1:], True) for q in short[:n]])
            for q in short[:n]:
                q.tokens.append(rng.randrange(100, 20000))
        rec(name, (time.perf_counter() - t) / 16)
    for q in short:
        e.remove_sequence(q)


def main(args) -> dict:
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.shape, seed=0, ftype=args.quant))
    engines = {}
    for fa in ("auto", "off"):
        e = LlamaCppEngine(EngineConfig(max_batch=8, options={"n_threads": str(args.threads), "flash_attn": fa,
                                                               "n_ctx": str(args.context + 4096)}))
        e.load(path, args.shape)
        engines[fa] = e
    rng, ids = random.Random(0), iter(range(1, 1 << 30))
    runs: dict[str, dict[str, list[float]]] = {fa: {} for fa in engines}
    for rnd in range(args.rounds):
        order = list(engines.items()) if rnd % 2 == 0 else list(reversed(engines.items()))
        for fa, e in order:
            one_round(e, args.context, rng, ids, lambda k, v, fa=fa: runs[fa].setdefault(k, []).append(v))
            print(rnd, fa, {k: round(v[-1], 4) for k, v in runs[fa].items()}, flush=True)
    med = {fa: {k: round(statistics.median(v), 4) for k, v in r.items()} for fa, r in runs.items()}
    return {"host": {"cpus": os.cpu_count(), "machine": platform.machine()}, "shape": args.shape,
            "quant": args.quant, "threads": args.threads, "context": args.context, "rounds": args.rounds,
            "median_s": med, "ratio_off_to_auto": {k: round(med["off"][k] / med["auto"][k], 3) for k in med["auto"]},
            "runs": runs}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "flash_attn.json"))
    a = ap.parse_args()
    res = main(a)
    print(json.dumps({k: res[k] for k in ("median_s", "ratio_off_to_auto")}, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")
