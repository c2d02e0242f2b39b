"""Does an open dashboard slow the API? Latency of sequential non-streaming chat requests against one
`octo serve test-model --engine echo --isolation process`, alternating blocks: A with no dashboard open; B with 5
open `GET /v1/dashboard/live` feeds (curl processes); C as B plus the page, a script and /v1/models fetched every
second (more than the page itself does: it polls /v1/models every 3 s on the Models view). Writes JSON to
``--out``. Run under `flock /tmp/octo-bench.lock`; part of ``bench/run.py gateway``.

    flock /tmp/octo-bench.lock .venv/bin/python bench/dashboard.py [--blocks 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from serverproc import run_octo  # noqa: E402

BODY = json.dumps({"model": "test-model", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "a b c d e f g"}]}).encode()
PER_BLOCK = 60


def chat(url: str) -> float:
    t = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    return time.perf_counter() - t


def clients(url: str, mode: str) -> list[subprocess.Popen]:
    """The dashboard's traffic, in other processes (never competing for this process's GIL)."""
    if mode == "A":
        return []
    procs = [subprocess.Popen(["curl", "-sN", url + "/v1/dashboard/live"], stdout=subprocess.DEVNULL)
             for _ in range(5)]
    if mode == "C":
        procs.append(subprocess.Popen(["bash", "-c", f"while :; do curl -s {url}/ {url}/dashboard/app.js "
                                                     f"{url}/v1/models >/dev/null; sleep 1; done"]))
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8, help=f"blocks of each kind ({PER_BLOCK} requests a block)")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "dashboard.json"))
    args = ap.parse_args()
    with run_octo("test-model", "--engine", "echo", "--isolation", "process") as s:
        url = s.base_url
        for _ in range(30):
            chat(url)
        res: dict[str, list[float]] = {"A": [], "B": [], "C": []}
        for _ in range(args.blocks):
            for mode in ("A", "B", "C"):
                procs = clients(url, mode)
                if procs:
                    time.sleep(1.5)  # the feeds are connected and sampling
                res[mode] += [chat(url) for _ in range(PER_BLOCK)]
                for p in procs:
                    p.terminate()
                    p.wait()
                time.sleep(1.0)

    def summary(v: list[float]) -> dict[str, float]:
        v = sorted(v)
        return {"n": len(v), "p50_ms": round(1000 * statistics.median(v), 3),
                "p90_ms": round(1000 * v[int(0.9 * len(v))], 3)}

    out = {"setup": __doc__.split("\n\n")[0].replace("\n", " "),
           "no_dashboard": summary(res["A"]), "five_live_feeds": summary(res["B"]),
           "five_live_feeds_and_page_reloads": summary(res["C"])}
    base = out["no_dashboard"]["p50_ms"]
    out["ratio_p50_live_feeds"] = round(out["five_live_feeds"]["p50_ms"] / base, 3)
    out["ratio_p50_feeds_and_reloads"] = round(out["five_live_feeds_and_page_reloads"]["p50_ms"] / base, 3)
    print(json.dumps(out, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
