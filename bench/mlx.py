"""The MLX engine through octo's shared scheduler vs mlx-lm run directly, on the synthetic Qwen2.5-0.5B shape.

For each weight format (float32; 4-bit affine with float32 scales) and BLAS choice (MLX's bundled reference BLAS;
OpenBLAS preloaded), a child process (MLX's BLAS is fixed when MLX is first loaded) measures:

- single stream: decode tok/s of one greedy request through ``octo.scheduler.admission.Scheduler`` + the mlx engine
  (streaming events included) vs a raw ``mlx_lm.generate.generate_step`` loop (from the first token to the last);
- 8 streams: aggregate tok/s of 8 concurrent requests through the scheduler vs a raw 8-sequence
  ``BatchGenerator`` loop, over the steps in which all 8 decode (and end to end, prefill included).

Same prompt tokens, same number of new tokens, greedy, no prefix cache; octo and raw runs alternate. Run it under
the shared benchmark lock and write JSON:

    flock /tmp/octo-bench.lock .venv/bin/python bench/mlx.py [--tokens 24] [--repeats 2]
        [--configs none:bundled,none:openblas,4bit:bundled,4bit:openblas] [--openblas PATH]
        [--out FILE]

``openblas`` is ``--openblas PATH`` or the system OpenBLAS (``blas=auto``); without one those configs are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# This file is named mlx.py: keep its folder off sys.path so that ``import mlx`` finds the real package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed",
    "A good engine answers quickly, keeps its memory small, and never forgets a request that",
    "In the spring the river rose over its banks, and the farmers moved their animals to the",
    "She opened the letter carefully, read it twice, and then laughed out loud. We are going",
    "Numbers can be written in many ways: 42, 3.14159, 1,000,000, 2024-05-17, and prices",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))",
    "Ships passing in the dark could see it from far away, and they knew where the rocks were",
    "By summer the water had gone down again, leaving rich dark soil in the fields where wheat",
]


# -- child: one (folder, blas) configuration ---------------------------------------------------------
class StepClock:
    """Wraps ``engine.step``: (end time, sampled tokens, feeds) per step."""

    def __init__(self, engine) -> None:
        self.log: list[tuple[float, int, int]] = []
        self._step = engine.step
        engine.step = self

    def __call__(self, feeds):
        out = self._step(feeds)
        self.log.append((time.perf_counter(), sum(t is not None for t in out), len(feeds)))
        return out


def window_rate(marks: list[tuple[float, int]], width: int) -> float:
    """tok/s over the consecutive steps that sampled ``width`` tokens (from the end of the first one)."""
    full = [(t, n) for t, n in marks if n == width]
    if len(full) < 2:
        return float("nan")
    return sum(n for _, n in full[1:]) / (full[-1][0] - full[0][0])


async def octo_run(engine, clock: StepClock, prompts: list[list[int]], n_tokens: int) -> dict:
    from octo.engine import SamplingParams
    from octo.scheduler.admission import GenerationRequest, Scheduler

    sched = Scheduler(engine, max_batch=len(prompts), cache=None)
    sched.start(asyncio.get_running_loop())
    try:
        clock.log.clear()
        t0 = time.perf_counter()
        tickets = [
            t
            for p in prompts
            for t in sched.submit(
                GenerationRequest(p, SamplingParams(temperature=0.0), max_tokens=n_tokens, stream=True)
            )
        ]

        async def consume(t):
            async for _ in t.deltas():
                pass
            return await t.result

        results = await asyncio.gather(*(consume(t) for t in tickets))
        t1 = time.perf_counter()
    finally:
        sched.stop()
    total = sum(r.completion_tokens for r in results)
    marks = [(t, n) for t, n, _ in clock.log]
    sampling = [(t, n) for t, n in marks if n]
    return {
        "tokens": [r.completion_tokens for r in results],
        "e2e_tok_s": total / (t1 - t0),
        "decode_tok_s": window_rate(marks, len(prompts))
        if len(prompts) > 1
        else (len(sampling) - 1) / (sampling[-1][0] - sampling[0][0]),
        "ttft_s": sampling[0][0] - t0,
        "token_ids": [r.token_ids for r in results],
    }


def raw_single(model, prompt: list[int], n_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    stamps, toks = [], []
    for (y, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n_tokens), range(n_tokens), strict=False):
        stamps.append(time.perf_counter())
        toks.append(int(y))
    return {
        "tokens": [len(toks)],
        "e2e_tok_s": len(toks) / (stamps[-1] - t0),
        "decode_tok_s": (len(toks) - 1) / (stamps[-1] - stamps[0]),
        "ttft_s": stamps[0] - t0,
        "token_ids": [toks],
    }


def raw_batch(model, prompts: list[list[int]], n_tokens: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model, max_tokens=n_tokens, stop_tokens=[], completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    t0 = time.perf_counter()
    uids = gen.insert(prompts)
    out: dict[int, list[int]] = {u: [] for u in uids}
    marks = []
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        marks.append((time.perf_counter(), len(responses)))
        for r in responses:
            out[r.uid].append(r.token)
    t1 = time.perf_counter()
    gen.close()
    total = sum(len(v) for v in out.values())
    return {
        "tokens": [len(out[u]) for u in uids],
        "e2e_tok_s": total / (t1 - t0),
        "decode_tok_s": window_rate(marks, len(prompts)),
        "ttft_s": marks[0][0] - t0,
        "token_ids": [out[u] for u in uids],
    }


def child(args) -> dict:
    from octo.engines.mlx import MLXEngine

    from octo.engine import EngineConfig

    engine = MLXEngine(EngineConfig(max_batch=args.streams, options={"blas": args.blas}))
    t = time.perf_counter()
    info = engine.load(args.folder, "bench")
    load_s = time.perf_counter() - t
    clock = StepClock(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS[: args.streams]]
    # warm-up (first-call costs, allocator) for both paths
    generate_once = asyncio.run(octo_run(engine, clock, prompts[:1], 4))
    raw_single(engine.model, prompts[0], 4)
    res: dict = {"load_s": round(load_s, 2), "info": info.extra, "warmup_tokens": generate_once["tokens"]}
    runs: dict[str, list[dict]] = {"octo_single": [], "raw_single": [], "octo_batch": [], "raw_batch": []}
    for _ in range(args.repeats):
        runs["octo_single"].append(asyncio.run(octo_run(engine, clock, prompts[:1], args.tokens)))
        runs["raw_single"].append(raw_single(engine.model, prompts[0], args.tokens))
        if args.streams > 1:
            runs["raw_batch"].append(raw_batch(engine.model, prompts, args.tokens))
            runs["octo_batch"].append(asyncio.run(octo_run(engine, clock, prompts, args.tokens)))
    for name, rs in runs.items():
        if not rs:
            continue
        res[name] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("decode_tok_s", "e2e_tok_s", "ttft_s")}
        res[name]["tokens"] = rs[-1]["tokens"]
    res["same_tokens_single"] = runs["octo_single"][-1]["token_ids"] == runs["raw_single"][-1]["token_ids"]
    if runs["octo_batch"]:
        res["same_tokens_batch"] = runs["octo_batch"][-1]["token_ids"] == runs["raw_batch"][-1]["token_ids"]
    res["ratio_single_decode"] = round(res["octo_single"]["decode_tok_s"] / res["raw_single"]["decode_tok_s"], 3)
    if runs["octo_batch"]:
        res["ratio_batch_decode"] = round(res["octo_batch"]["decode_tok_s"] / res["raw_batch"]["decode_tok_s"], 3)
        res["ratio_batch_e2e"] = round(res["octo_batch"]["e2e_tok_s"] / res["raw_batch"]["e2e_tok_s"], 3)
    engine.unload()
    return res


# -- parent ------------------------------------------------------------------------------------------
def host() -> dict:
    from octo.runtime.selection import host_fingerprint

    return {"platform": platform.platform(), **host_fingerprint(), "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument(
        "--configs",
        default="none:bundled,none:openblas,4bit:bundled,4bit:openblas",
        help="comma list of QUANT:BLAS, QUANT in none/4bit, BLAS in bundled/openblas",
    )
    ap.add_argument("--openblas", default=None, help="OpenBLAS library to preload (default: the system one)")
    ap.add_argument("--blas", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "bench" / "mlx.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    from octo.engines.mlx.runtime import find_openblas

    from octo.synth.mlx import build_mlx

    openblas = args.openblas or find_openblas()
    report = {
        "host": host(),
        "shape": args.shape,
        "tokens": args.tokens,
        "streams": args.streams,
        "repeats": args.repeats,
        "runs": [],
        "skipped": [],
    }
    for config in args.configs.split(","):
        quant, blas = config.split(":")
        if blas == "openblas" and not openblas:
            report["skipped"].append(f"{config}: no OpenBLAS found (give --openblas PATH)")
            continue
        folder = build_mlx(args.shape, quant=None if quant == "none" else quant)
        b = openblas if blas == "openblas" else "bundled"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--folder",
            str(folder),
            "--blas",
            b,
            "--tokens",
            str(args.tokens),
            "--streams",
            str(args.streams),
            "--repeats",
            str(args.repeats),
        ]
        print(f"[mlx bench] {args.shape} {quant} blas={b} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"child failed for {config}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(quant=quant, blas=blas, blas_library=b, tokens=args.tokens, repeats=args.repeats)
        report["runs"].append(res)
        print(
            json.dumps(
                {
                    k: res.get(k)
                    for k in (
                        "quant",
                        "blas",
                        "octo_single",
                        "raw_single",
                        "ratio_single_decode",
                        "octo_batch",
                        "raw_batch",
                        "ratio_batch_decode",
                        "ratio_batch_e2e",
                    )
                }
            ),
            file=sys.stderr,
        )
    # runs of configurations not measured this time are kept from an earlier report on the same host and shape
    try:
        old = json.loads(args.out.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("host") == report["host"] and old.get("shape") == report["shape"]:
        done = {(r["quant"], r["blas"]) for r in report["runs"]}
        report["runs"] = [r for r in old.get("runs", []) if (r["quant"], r["blas"]) not in done] + report["runs"]
    for r in report["runs"]:
        r.setdefault("tokens", args.tokens)
        r.setdefault("repeats", args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
