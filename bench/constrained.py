"""The cost of constrained decoding (octo.text.constrain, llguidance) per text engine: 8 concurrent streams with a JSON
schema vs the same 8 streams unconstrained, through octo's shared scheduler in this process, on the synthetic
Qwen2.5-0.5B-shaped model (151,936-token vocabulary, random weights), greedy.

    flock /tmp/octo-bench.lock .venv/bin/python bench/constrained.py [--engines llamacpp,onnx,mlx] [--reps 3]

Decode throughput is measured differentially, as bench/llamacpp.py does: each load runs with ``SHORT`` and ``LONG``
max_tokens and the rate is ``streams * (LONG - SHORT) / (wall(LONG) - wall(SHORT))``, so prefill cancels out. The
schema (an array of at least 1,000 objects with a free string, a bounded string and an integer) cannot end before
``LONG`` tokens, so constrained sequences run as long as unconstrained ones (whose end-of-sequence tokens are
banned with logit_bias); every run checks that all tokens were generated. Unconstrained and constrained runs
alternate within each repetition, so that drift on a shared host hits both. The per-token mask time (llguidance's
bitmask for one sequence, and applying it to a float32 logits row) is timed on the constrained outputs replayed.
Writes JSON to ``--out``; part of ``bench/run.py engines``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# bench/mlx.py would shadow the mlx package: this folder is not an import root
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer"}},
    "required": ["name", "city", "age"], "additionalProperties": False}}
STREAMS = 8


def artifact(engine: str, shape: str) -> str:
    if engine == "llamacpp":
        from octo.synth.gguf import build_gguf

        return str(build_gguf(shape, ftype="q4_k_m"))
    if engine == "onnx":
        from octo.synth.onnx import build_onnx

        return str(build_onnx(shape, precision="int4"))
    from octo.synth.mlx import build_mlx

    return str(build_mlx(shape))


async def run_load(sched, engine, grammar, max_tokens: int) -> tuple[float, list[list[int]]]:
    from octo.engine import SamplingParams
    from octo.scheduler.jobs import GenerationRequest

    eos = {t: -100.0 for t in engine.info.eos_token_ids}
    tickets = []
    t0 = time.perf_counter()
    for i in range(STREAMS):
        prompt = engine.tokenize(engine.render_chat([{"role": "user", "content": f"List people, batch {i}."}]))
        sp = SamplingParams(temperature=0.0, logit_bias={} if grammar is not None else eos)
        tickets += sched.submit(GenerationRequest(prompt, sp, max_tokens, grammar=grammar))
    results = [await t.result for t in tickets]
    wall = time.perf_counter() - t0
    for r in results:
        if r.completion_tokens != max_tokens:
            raise RuntimeError(f"a stream ended after {r.completion_tokens} of {max_tokens} tokens ({r.finish_reason})")
    return wall, [r.token_ids for r in results]


def mask_times(grammar, engine, outputs: list[list[int]]) -> dict:
    from octo.logits import apply_bitmask

    fill, apply = [], []
    row = np.zeros(engine.info.n_vocab, dtype=np.float32)
    for toks in outputs:
        m = grammar.matcher()
        for tok in toks:
            t0 = time.perf_counter()
            mask = m.bitmask()
            t1 = time.perf_counter()
            apply_bitmask(row, mask)
            t2 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            if not m.accept(tok):
                raise RuntimeError("a constrained output does not replay through its grammar")
            row[:] = 0.0

    def stats(xs):
        xs = sorted(xs)
        return {"mean_ms": round(1000 * statistics.fmean(xs), 4), "median_ms": round(1000 * xs[len(xs) // 2], 4),
                "p99_ms": round(1000 * xs[int(0.99 * (len(xs) - 1))], 4), "n": len(xs)}

    return {"mask": stats(fill), "apply": stats(apply)}


async def bench_engine(name: str, shape: str, reps: int, short: int, long: int) -> dict:
    from octo.engine import EngineConfig
    from octo.plugins import engine_registry, load_plugins
    from octo.scheduler.admission import Scheduler
    from octo.text.constrain import Constraint, compile_constraint, vocab_for

    cls = engine_registry(load_plugins())[name]
    path = artifact(name, shape)
    engine = cls(EngineConfig(max_batch=STREAMS))
    engine.load(path, shape)
    t0 = time.perf_counter()
    vocab = vocab_for(engine)
    vocab_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compile_constraint(Constraint.json_schema(SCHEMA), vocab)
    compile_s = time.perf_counter() - t0
    sched = Scheduler(engine, max_batch=STREAMS, max_queue=64, queue_timeout=600, cache=None)
    sched.start()
    runs: dict[str, list[float]] = {"plain": [], "constrained": []}
    outputs: list[list[int]] = []
    try:
        await run_load(sched, engine, None, short)  # warm-up
        for _ in range(reps):
            for mode, g in (("plain", None), ("constrained", grammar)):
                w_short, _ = await run_load(sched, engine, g, short)
                w_long, outs = await run_load(sched, engine, g, long)
                runs[mode].append(STREAMS * (long - short) / (w_long - w_short))
                if g is not None:
                    outputs = outs
                print(f"[constrained] {name} {mode}: {runs[mode][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        sched.stop()
    masks = mask_times(grammar, engine, outputs)
    engine.unload()
    plain, constrained = statistics.median(runs["plain"]), statistics.median(runs["constrained"])
    return {"engine": name, "artifact": path, "tok_s_plain": round(plain, 2),
            "tok_s_constrained": round(constrained, 2), "ratio": round(constrained / plain, 3), "runs": runs,
            "vocab_build_s": round(vocab_s, 3),
            "schema_compile_s": round(compile_s, 4), "per_token": masks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="llamacpp,onnx,mlx")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "constrained.json"))
    ap.add_argument("--merge", action="store_true", help="keep the other engines' entries of an earlier --out")
    args = ap.parse_args()
    report = {"bench": "constrained", "streams": STREAMS, "shape": args.shape, "short": args.short, "long": args.long,
              "host": {"cpus": os.cpu_count(), "machine": platform.machine()}, "schema": SCHEMA, "engines": []}
    for name in args.engines.split(","):
        try:
            report["engines"].append(asyncio.run(bench_engine(name, args.shape, args.reps, args.short, args.long)))
        except Exception as exc:  # noqa: BLE001 - an engine missing here is reported, the others still run
            report["engines"].append({"engine": name, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(report["engines"][-1], indent=1), file=sys.stderr, flush=True)
    if args.merge and Path(args.out).exists():
        ran = {e["engine"] for e in report["engines"]}
        old = json.loads(Path(args.out).read_text())
        report["engines"] = [e for e in old.get("engines", []) if e["engine"] not in ran] + report["engines"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({e["engine"]: e.get("ratio", e.get("error")) for e in report["engines"]}))


if __name__ == "__main__":
    main()
