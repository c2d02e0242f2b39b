"""`octo serve demo` on a busy or quiet host: spawn to first streamed token, a host's first start and the later ones.

The demo has an artifact for three engines, so its start-up runs the engine selection (bench/selection.py). On a
busy host that selection's measurements are disturbed: a disturbed measurement is cached as provisional and measured
again while the model is idle (octo/runtime/remeasure.py), so a later start serves at once. ``--when-idle`` serves
this checkout with ``--bench-when-idle``: its first start measures nothing (it serves with the first candidate and
measures the engines while the model is idle). ``--compare REV...`` serves octo at those git revisions too
(bench/revtree.py), alternating with this checkout in every round (``ratio_first_start``, ``ratio_later_starts``:
this checkout / the revision).

A busy host: ``--spinners`` processes (default 1: another process computing on one core) spin for the whole run;
``--spinners 0`` for a quiet host. Each tree has its own ``OCTO_HOME``, where a first untimed start builds the
synthetic models, and its own engine-selection cache (``OCTO_BENCH_DIR``), empty at round 1: round 1 is this host's
first start, the later rounds are the starts after it. Writes every sample and the medians of the later rounds as
JSON. Part of ``bench/run.py startup``.

    flock /tmp/octo-bench.lock .venv/bin/python bench/busy_start.py [--rounds 4] [--spinners 1] [--compare REV ...]
        [--when-idle] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from llamacpp import free_port  # noqa: E402
from revtree import short_sha, worktree  # noqa: E402
from startup import spawn_to_token  # noqa: E402

SPIN = "import time\nwhile True:\n    pass\n"


def demo_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "octo.cli", "serve", "demo", "--port", str(port), *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--spinners", type=int, default=1)
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV", help="octo at these git revisions, beside")
    ap.add_argument("--when-idle", action="store_true", help="serve this checkout with --bench-when-idle")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "busy_start.json"))
    args = ap.parse_args()
    extra = {"octo": ["--bench-when-idle"] if args.when_idle else []}
    trees = {"octo": REPO, **{f"octo@{short_sha(rev)}": worktree(rev) for rev in args.compare}}
    homes = {name: tempfile.mkdtemp(prefix="octo-bench-home-") for name in trees}
    caches = {name: tempfile.mkdtemp(prefix="octo-bench-cache-") for name in trees}
    for name, cwd in trees.items():  # build the synthetic models (untimed, its selection cache thrown away)
        env = {"OCTO_HOME": homes[name], "OCTO_BENCH_DIR": tempfile.mkdtemp(prefix="octo-bench-build-")}
        port = free_port()
        print(f"{name}: building the demo models", flush=True)
        spawn_to_token(demo_cmd(port), "demo", port, env, cwd)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.spinners)]
    samples: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            for name, cwd in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                port = free_port()
                env = {"OCTO_HOME": homes[name], "OCTO_BENCH_DIR": caches[name]}
                t = spawn_to_token(demo_cmd(port, *extra.get(name, [])), "demo", port, env, cwd)
                samples[name].append(round(t, 3))
                print(f"round {r + 1}: {name} {t:.2f} s", flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        for d in [*homes.values(), *caches.values()]:
            shutil.rmtree(d, ignore_errors=True)
    later = {name: statistics.median(s[1:]) for name, s in samples.items() if len(s) > 1}
    others = [name for name in trees if name != "octo"]
    report = {"host": {"cpus": os.cpu_count(), "machine": platform.machine()},
              "spinners": args.spinners, "rounds": args.rounds, "compare": others, "when_idle": args.when_idle,
              "samples_s": samples, "first_start_s": {n: s[0] for n, s in samples.items()},
              "later_starts_median_s": later,
              "ratio_later_starts": {n: round(later["octo"] / later[n], 3) for n in others if later.get(n)},
              "ratio_first_start": {n: round(samples["octo"][0] / samples[n][0], 3) for n in others}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
