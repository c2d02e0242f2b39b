"""octo at two git revisions under the same llama.cpp decode load, alternating: does a change cost speed?

    flock /tmp/octo-bench.lock .venv/bin/python bench/revisions.py --base 966ee5d [--streams 1 8] [--reps 3]

The base revision is checked out into a git worktree under ``.cache/revisions/`` (git-ignored), with
``octo/engines`` linked to its ``engines/`` folder, and served from that folder (``python -m octo.cli.main`` puts its
working directory first on ``sys.path``, ahead of the editable install of this checkout). Both servers use this
venv, the same synthetic Qwen2.5-0.5B Q4_K_M GGUF and 2 threads; the load and the differential decode rate are
bench/llamacpp.py's (N greedy streams, ``(LONG - SHORT)`` tokens each, end-of-sequence banned). For each stream count
the two run alternately ``--reps`` times; the median ratio head / base is reported. Writes
``bench/results/revisions.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import llamacpp as lb  # noqa: E402  (bench/llamacpp.py: its load, servers and command lines)
from revtree import worktree  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "revisions.json"))
    args = ap.parse_args()
    args.flash = True
    from octo.synth.gguf import build_gguf

    path = str(build_gguf("qwen2.5-0.5b", ftype="q4_k_m"))
    trees = {"head": REPO, "base": worktree(args.base)}
    report = {"bench": "revisions", "base": args.base,
              "head": subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip(),
              "dirty": bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                                    cwd=REPO, text=True).strip()),
              "model": path, "short": args.short, "long": args.long, "streams": {}}
    for n in args.streams:
        runs: dict[str, list[float]] = {"head": [], "base": []}
        for _ in range(args.reps):
            for name, tree in trees.items():
                port = lb.free_port()
                lb.REPO = tree  # the server's working directory: which octo it imports
                with lb.server(lb.octo_cmd(path, port, args, max(n, 1)), port, "/health", f"octo-{name}") as base:
                    lb.decode_rate(base, n, args, f"w{n}")  # warm-up
                    rate, _ = lb.decode_rate(base, n, args, f"r{n}")
                runs[name].append(round(rate, 2))
                print(f"[revisions] {n} streams {name}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        ratios = [h / b for h, b in zip(runs["head"], runs["base"], strict=True)]
        report["streams"][str(n)] = {"runs": runs, "head_tok_s": statistics.median(runs["head"]),
                                     "base_tok_s": statistics.median(runs["base"]),
                                     "ratio_median": round(statistics.median(ratios), 3)}
    lb.REPO = REPO
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({n: s["ratio_median"] for n, s in report["streams"].items()}))


if __name__ == "__main__":
    main()
