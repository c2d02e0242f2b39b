"""The onnx engine's og.Engine backend (``-o backend=engine``) vs onnxruntime-genai's raw ``og.Generator``.

Both in this process on the same synthetic Qwen2.5-0.5B int4 folder and thread count, greedy, alternating runs:
* raw: an N-prompt ``og.Generator`` loop (bench/onnx.py's ``Raw``), the ceiling;
* engine: octo's ``OnnxEngine`` with ``backend=engine`` driven through the engine contract the way the shared
  scheduler drives it (one ``step`` per iteration over every sequence), i.e. ``og.Engine`` requests and turns.

Decode rate is differential, ``N * (LONG - SHORT) / (t(LONG) - t(SHORT))``, so prefill cancels out. On a CPU folder
the library runs og.Engine as a fixed batch (continuous batching needs a paged-attention CUDA/WebGPU build), so
this measures what the backend costs on CPU, not the continuous batching it brings on a GPU.

    flock /tmp/octo-bench.lock .venv/bin/python bench/og_engine.py   # writes bench/results/og_engine.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]  # bench/onnx.py vs onnx


def _bench_onnx():
    spec = importlib.util.spec_from_file_location("bench_onnx", REPO / "bench" / "onnx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_rate(engine, prompts: list[list[int]], short: int, long: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s between token SHORT and LONG of N sequences stepped together, and their tokens."""
    from octo.engine import Feed, SamplingParams, Sequence

    seqs = [Sequence(900 + i, list(p), SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_sequence(s)
    outs: list[list[int]] = [[] for _ in seqs]
    stamps: dict[int, float] = {}
    try:
        while min(len(o) for o in outs) < long:
            feeds = [Feed(s, s.tokens[s.n_cached:], True) for s in seqs if len(outs[seqs.index(s)]) < long]
            for f, tok in zip(feeds, engine.step(feeds), strict=True):
                if tok is not None:
                    f.seq.tokens.append(tok)
                    outs[seqs.index(f.seq)].append(tok)
            done = min(len(o) for o in outs)
            for mark in (short, long):
                if done >= mark and mark not in stamps:
                    stamps[mark] = time.perf_counter()
    finally:
        for s in seqs:
            engine.remove_sequence(s)
    return len(seqs) * (long - short) / (stamps[long] - stamps[short]), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "og_engine.json"))
    args = ap.parse_args()

    from octo.engines.onnx import OnnxEngine

    from octo.engine import EngineConfig
    from octo.synth.onnx import build_onnx

    bo = _bench_onnx()
    folder = str(build_onnx(args.shape, precision="int4"))
    raw = bo.Raw(folder, args.threads)
    engine = OnnxEngine(EngineConfig(max_batch=args.streams,
                                     options={"backend": "engine", "threads": str(args.threads)}))
    engine.load(folder, args.shape)
    rates: dict[str, dict[str, list[float]]] = {"raw_og_generator": {}, "octo_og_engine": {}}
    same: dict[str, bool] = {}
    for n in (1, args.streams):
        prompts = [raw.tokenize(bo.prompt(i, f"e{n}")) for i in range(n)]
        raw.generate(prompts, args.short)  # warm-up, both
        engine_rate(engine, prompts, 2, args.short)
        for _ in range(args.reps):  # alternate raw / engine
            stamps, raw_out = raw.generate(prompts, args.long)
            rates["raw_og_generator"].setdefault(str(n), []).append(
                n * (args.long - args.short) / (stamps[args.long - 1] - stamps[args.short - 1]))
            rate, outs = engine_rate(engine, prompts, args.short, args.long)
            rates["octo_og_engine"].setdefault(str(n), []).append(rate)
            same[str(n)] = outs == raw_out
        print(f"{n} streams: raw {statistics.median(rates['raw_og_generator'][str(n)]):.1f} tok/s, og.Engine backend "
              f"{statistics.median(rates['octo_og_engine'][str(n)]):.1f} tok/s, same tokens: {same[str(n)]}",
              file=sys.stderr, flush=True)
    result = {"model": {"shape": args.shape, "precision": "int4", "path": folder},
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "backend": engine.info.extra["backend"],
              "decode_tok_s": {k: {n: round(statistics.median(v), 2) for n, v in d.items()} for k, d in rates.items()},
              "same_greedy_tokens_as_raw": same}
    raw_r, eng_r = result["decode_tok_s"]["raw_og_generator"], result["decode_tok_s"]["octo_og_engine"]
    result["ratios"] = {f"og_engine_vs_raw_{n}": round(eng_r[n] / raw_r[n], 3) for n in raw_r}
    engine.unload()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]))


if __name__ == "__main__":
    main()
