"""Python and C calls per request of the gateway (echo engine, non-streamed chat at concurrency 8), on every thread.

A count is the same on a busy host as on a quiet one, unlike requests/s or CPU time, so it shows a per-request
cost that lands even where ``bench/overhead.py`` cannot tell it from the noise. Each server runs its CLI under a
profile hook (``sys.setprofile`` and ``threading.setprofile``) that counts function and C-function calls only while
the measured requests run (after a warm-up: first calls that import or build caches do not count); the calls are
grouped by package and module (``by_layer``), and per function where one is called at least once in 20 requests
(``by_function``, C functions as ``C:name``). ``--compare REV...`` counts octo at earlier revisions too
(bench/revtree.py). Part of ``bench/run.py gateway``.

    .venv/bin/python bench/callcount.py [--requests 3000] [--compare REV ...] [--top 25] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from overhead import load, octo_cmd, start  # noqa: E402
from revtree import short_sha, worktree  # noqa: E402
from serverproc import free_port  # noqa: E402

COUNTER = r'''
import collections, json, os, runpy, signal, sys, threading
sys.path.insert(0, os.getcwd())
counts, on = collections.Counter(), [False]
def hook(frame, event, arg):
    if on[0]:
        if event == "call":
            counts[frame.f_code.co_filename + ":" + frame.f_code.co_name] += 1
        elif event == "c_call":
            counts["C:" + getattr(arg, "__qualname__", type(arg).__name__)] += 1
def begin(*_):
    counts.clear()
    on[0] = True
def end(*_):
    on[0] = False
    with open(os.environ["OCTO_CALLCOUNT_OUT"], "w") as f:
        json.dump(counts, f)
signal.signal(signal.SIGUSR1, begin)
signal.signal(signal.SIGUSR2, end)
sys.setprofile(hook)
threading.setprofile(hook)
sys.argv = ["octo", *sys.argv[1:]]
runpy.run_module("octo.cli", run_name="__main__")
'''


def layer(key: str) -> str:
    """The package or octo module a counted function belongs to."""
    if key.startswith("C:"):
        return "C functions"
    path = key.rsplit(":", 1)[0]
    m = re.search(r"/(octo|engines)/(.+?)\.py$", path)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    m = re.search(r"site-packages/([^/]+)", path)
    return m.group(1) if m else Path(path).name.removesuffix(".py")


async def count(cwd: Path, requests: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        cmd = [sys.executable, "-c", COUNTER, *octo_cmd(port, "auto", "thread")[3:]]
        proc = start(cmd, port, cwd, env={**os.environ, "OCTO_CALLCOUNT_OUT": str(out)})
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            await load(url, 8, 1000)  # warm-up: imports, caches, first-call and start-up work
            proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            await load(url, 8, requests)
            proc.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not out.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            counts = json.loads(out.read_text())
        finally:
            proc.terminate()
            proc.wait(10)
    layers: collections.Counter = collections.Counter()
    for key, n in counts.items():
        layers[layer(key)] += n
    return {"python_calls": round(sum(n for k, n in counts.items() if not k.startswith("C:")) / requests, 1),
            "c_calls": round(layers["C functions"] / requests, 1),
            "by_layer": {k: round(n / requests, 2) for k, n in layers.most_common() if k != "C functions"},
            "by_function": {_short(k): round(n / requests, 2) for k, n in counts.items() if n >= requests / 20}}


def _short(key: str) -> str:
    """A counted function's key without the checkout's path (``octo/runtime/model.py:prepare``, ``C:len``)."""
    m = re.search(r"/((?:octo|engines|site-packages)/.+)$", key)
    return m.group(1) if m else key


async def main(args) -> dict:
    targets = {"octo": REPO, **{f"octo@{short_sha(rev)}": worktree(rev) for rev in args.compare}}
    results = {}
    for name, cwd in targets.items():
        results[name] = r = await count(cwd, args.requests)
        print(f"{name:14s} {r['python_calls']:6.1f} Python calls a request, {r['c_calls']:6.1f} C calls", flush=True)
        for key, n in list(r["by_layer"].items())[:args.top]:
            print(f"    {n:7.2f}  {key}")
    return {"requests": args.requests, "concurrency": 8, "servers": results}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV", help="git revisions counted beside")
    ap.add_argument("--top", type=int, default=25, help="layers printed per server")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "callcount.json"))
    a = ap.parse_args()
    res = asyncio.run(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")
