"""An MLX model's start: ``octo serve FOLDER --engine mlx`` from spawn to its first streamed token, and its engine
worker's resident memory, for this checkout and an earlier revision in alternating rounds.

    flock /tmp/octo-bench.lock .venv/bin/python bench/mlx_start.py [--rounds 3] [--base 310633a]

mlx-lm's tokenizer module imports transformers, which imports torch wherever it is installed; MLX never calls it.
Since session 14 the engine worker that serves MLX alone hides torch before those imports (``EngineConfig.own_process``
and ``Engine.prepare_own_process``): this measures what that does to the start and to the worker's memory, and
whether libtorch is mapped in the worker. Each case starts with the worker ``octo serve`` spawns before its own imports
(the default), and with ``OCTO_SPARE_WORKER=0`` (a worker started for the model, as a start-up selection's candidate
gets). The tiny synthetic MLX folder (``octo.synth.mlx``); writes ``bench/results/mlx_start.json``.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from llamacpp import free_port  # noqa: E402
from revtree import short_sha, worktree  # noqa: E402
from startup import first_token, spawn, stop  # noqa: E402


def one_start(folder: str, cwd: Path, spare: bool) -> dict:
    """Spawn to first token (s), the worker's resident memory (MB) and whether libtorch is mapped in it."""
    import urllib.request

    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", folder, "--engine", "mlx", "--port", str(port)]
    t0 = time.perf_counter()
    proc = spawn(cmd, {} if spare else {"OCTO_SPARE_WORKER": "0"}, cwd)
    try:
        seconds = asyncio.run(first_token(f"http://127.0.0.1:{port}", "mlx", t0))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            entry = json.load(r)["data"][0]
        pid = entry["worker"]["pid"]
        torch = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        return {"seconds": round(seconds, 3), "rss_mb": round(entry["memory"]["measured_bytes"] / 1e6, 1),
                "torch_loaded": torch}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default="310633a", metavar="REV")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "mlx_start.json"))
    args = ap.parse_args()
    from octo.synth.mlx import build_mlx

    folder = str(build_mlx("tiny"))
    trees = {"octo": REPO, f"octo@{short_sha(args.base)}": worktree(args.base)}
    samples: dict[str, list[dict]] = {}
    for cwd in trees.values():  # untimed: compiled modules cached, as after a user's first start
        one_start(folder, cwd, True)
    for r in range(args.rounds):
        for name, cwd in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            for spare in (True, False):
                key = name + ("" if spare else " (OCTO_SPARE_WORKER=0)")
                samples.setdefault(key, []).append(one_start(folder, cwd, spare))
                print(f"round {r + 1}: {key}: {samples[key][-1]}", flush=True)
    median = {k: {"seconds": statistics.median(s["seconds"] for s in v),
                  "rss_mb": statistics.median(s["rss_mb"] for s in v),
                  "torch_loaded": sorted({s["torch_loaded"] for s in v})} for k, v in samples.items()}
    report = {"host": {"cpus": os.cpu_count(), "machine": platform.machine()}, "rounds": args.rounds,
              "base": short_sha(args.base), "samples": samples, "median": median}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(median, indent=2))


if __name__ == "__main__":
    main()
