"""The llama.cpp engine at two git revisions, alternating, at the engine level: does a change cost decode speed?

    flock /tmp/octo-bench.lock .venv/bin/python bench/revisions_engine.py --base main [--streams 1 8] [--reps 3]

bench/revisions.py compares whole servers over HTTP; on a busy host its differential rate swings past zero. This
one loads ``LlamaCppEngine`` directly (no server, no idle probes: the layout is pinned to the unified pool) in a
child process per run, served from each revision's folder (bench/revtree.py), decodes ``--steps`` greedy steps of
N sequences and reports tok/s by wall time and by the process's CPU time (one thread: the CPU time does not count
waiting for a core, which is most of the noise on a shared host). Runs alternate head, base, base, head; the
median of each is reported with the ratio head / base, and the greedy tokens of both must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from revtree import worktree  # noqa: E402

CHILD = """
import json, sys, time
from octo.engine import EngineConfig, Feed, SamplingParams, Sequence
from octo.engines.llamacpp import LlamaCppEngine
path, n, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
e = LlamaCppEngine(EngineConfig(max_batch=max(n, 2), options={"n_threads": threads, "kv_unified": "true",
                                                                 "n_ctx": "1024"}))
e.load(path, "bench")
seqs = [Sequence(i, e.tokenize(f"Once upon a time number {i} there was"), SamplingParams(temperature=0))
        for i in range(n)]
for s in seqs:
    e.add_sequence(s)
outs = e.step([Feed(s, list(s.tokens), True) for s in seqs])
for k in range(3 + steps):
    if k == 3:
        t0, c0 = time.perf_counter(), time.process_time()
    for s, o in zip(seqs, outs):
        s.tokens.append(o)
    outs = e.step([Feed(s, s.tokens[-1:], True) for s in seqs])
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"tok_s": n * steps / wall, "cpu_tok_s": n * steps / cpu, "tokens": [s.tokens for s in seqs]}))
"""


def run(tree: Path, path: str, n: int, steps: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(n), str(steps), str(threads)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--ftype", default="q4_k_m")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.model, ftype=args.ftype))
    trees = {"head": REPO, "base": worktree(args.base)}
    report = {}
    for n in args.streams:
        runs: dict[str, list[dict]] = {"head": [], "base": []}
        for _ in range(args.reps):
            for name in ("head", "base", "base", "head"):
                runs[name].append(run(trees[name], path, n, args.steps, args.threads))
        tokens = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
        row = {}
        for key in ("tok_s", "cpu_tok_s"):
            h, b = (statistics.median(r[key] for r in runs[name]) for name in ("head", "base"))
            row[key] = {"head": round(h, 1), "base": round(b, 1), "ratio": round(h / b, 3)}
        row["same_tokens"] = len(tokens) == 1
        report[str(n)] = row
        print(f"[revisions_engine] {n} streams: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
