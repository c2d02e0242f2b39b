"""Does the start-up micro-benchmark pick the engine that `octo bench` finds fastest, and how long does it take?

On a synthetic model of a real shape (default Qwen2.5-0.5B, 4-bit weights for every engine), one run:
1. the start-up selection (`octo.runtime.selection.select`) over all available engines, from an empty cache;
2. the same selection again, from the cache (nothing benchmarked, only the winner loaded);
3. the selection again with --rebench, files in the page cache and libraries imported (right after a download);
4. the long benchmark (`octo bench` workers, one engine at a time), whose winner is the best decode tok/s.
Writes JSON with both winners, their agreement and the selection times.

    python bench/selection.py [--shape qwen2.5-0.5b] [--seconds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# bench/ holds mlx.py, onnx.py and whisper.py: keep it off sys.path so the real packages import
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seconds", type=float, default=3.0, help="start-up budget per engine (--bench-seconds)")
    ap.add_argument("--bench-seconds", type=float, default=4.0, help="octo bench decode time per batch size")
    ap.add_argument("--mlx-weights", choices=["4bit", "float32"], default="4bit",
                    help="MLX artifact: 4-bit like the others (what `octo serve MODEL:4bit` offers it), or float32, "
                         "its fastest form on a CPU (4-bit MLX matmuls are slower there)")
    ap.add_argument("--isolation", choices=["process", "thread"], default="process",
                    help="candidates in worker processes (octo serve's default for these engines) or in-process")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "selection.json"))
    args = ap.parse_args()

    import asyncio
    import os

    from octo.cli.bench import QUANTS
    from octo.config import ServerConfig
    from octo.plugins import engine_registry
    from octo.runtime.loader import candidate
    from octo.runtime.selection import host_fingerprint, select
    from octo.synth import build_for

    reg = engine_registry()
    engines = [e for e in ("llamacpp", "onnx", "mlx") if e in reg and reg[e].detect().available]
    quants = dict(QUANTS["4bit"])
    if args.mlx_weights == "float32":
        quants["mlx"] = None
    artifacts = {e: str(build_for(args.shape, e, quants[e])) for e in engines}

    config = ServerConfig(model=args.shape, max_batch=8, isolation=args.isolation)

    def run(**kw):
        async def go():
            cands = {e: candidate(reg[e], artifacts[e], args.shape, config, print) for e in engines}
            t0 = time.perf_counter()
            winner, cand, results, reason = await select(cands, seconds=args.seconds, **kw)
            seconds = time.perf_counter() - t0
            await cand.discard()
            return winner, results, reason, seconds
        return asyncio.run(go())

    os.environ["OCTO_BENCH_DIR"] = tempfile.mkdtemp(prefix="octo-selection-")
    winner, results, reason, fresh_s = run(rebench=True)
    winner2, _, _, cached_s = run()
    t_bench_only = sum(r["seconds"] for r in results.values())
    t_loads = fresh_s - t_bench_only  # loading (imports, reading the files) and set-up
    # 3. `--rebench` on a host where the files are in the page cache and the libraries imported (right after a
    # download or a build): the selection machinery itself, without cold disk reads
    winner3, results3, _, warm_s = run(rebench=True)

    long = {}
    for e in engines:
        spec = json.dumps({"engine": e, "artifact": artifacts[e], "batches": [1, 4], "seconds": args.bench_seconds,
                           "options": {}, "prompt": 32})
        out = subprocess.run([sys.executable, "-m", "octo.cli.bench", spec], capture_output=True, text=True)
        ok = out.returncode == 0
        long[e] = json.loads(out.stdout.strip().splitlines()[-1]) if ok else {"error": out.stderr[-500:]}
    best = {e: max(r["decode_tok_s"] for r in v["rows"]) for e, v in long.items() if "rows" in v}
    bench_winner = max(best, key=best.get) if best else None
    report = {"shape": args.shape, "isolation": args.isolation, "weights": {e: quants[e] or "float32" for e in engines},
              "host": host_fingerprint(), "engines": engines,
              "startup": {"winner": winner, "reason": reason, "seconds_fresh": round(fresh_s, 2),
                          "seconds_benchmarking": round(t_bench_only, 2),
                          "seconds_outside_benchmarks": round(t_loads, 2),
                          # what selecting adds to a start: everything but the winner's own load, which serving needs
                          "seconds_added_by_selection": round(fresh_s - (results[winner].get("load_seconds") or 0), 2),
                          "seconds_cached": round(cached_s, 2),
                          "cached_winner": winner2, "results": results,
                          "rebench_warm": {"winner": winner3, "seconds": round(warm_s, 2),
                                           "seconds_benchmarking": round(sum(r["seconds"] for r in
                                                                             results3.values()), 2),
                                           "results": results3}},
              "octo_bench": {"winner": bench_winner, "best_decode_tok_s": best, "runs": long},
              "agree": winner == bench_winner}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"start-up winner {winner} ({fresh_s:.1f} s fresh, {cached_s:.2f} s cached, {warm_s:.1f} s rebench with warm "
          f"files, winner load included); "
          f"octo bench winner {bench_winner}; agree={winner == bench_winner}; wrote {args.out}")


if __name__ == "__main__":
    main()
