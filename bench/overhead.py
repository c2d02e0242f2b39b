"""Gateway overhead: octo (echo engine, no token delay) vs a bare aiohttp server returning fixed JSON.

Both servers run as separate processes on loopback and on the same event loop implementation (octo's
default, uvloop when installed; `--loop asyncio` for both on asyncio's own loop); the load generator (this
process) alternates the servers' rounds at each concurrency so that machine noise hits them alike. Writes JSON
with requests/s, p50 and p99 per server and concurrency, the ratio octo / bare, and each server's CPU per request
(its processes in all, and its event loop's thread alone: the rest of an octo is its engine thread), and an octo's
engine steps a request (how its requests batch: a change in when the engine thread wakes shows here first).

On a host with few cores the ratio also depends on the load generator's own CPU a request (C, reported as
``client_cpu_us_per_request``) and on what a wake-up of another thread costs there (``host.thread_round_trip_us``,
measured at the start). The bare server is held back by the load generator (its CPU a request is far below C);
octo by its GIL: its event loop's and engine thread's Python share one, so it serves at most 1 / (its CPU a request)
requests a second (``gil_bound_rps``, which the measured rates follow), and octo plus C must also fit on the cores.
So each result also says how much CPU a request octo may spend for 0.9x of bare (``octo_cpu_budget_us_for_0_9x``,
:func:`budget_for`).

``--compare REV...`` serves octo at those git revisions too (bench/revtree.py), in the same rounds: a change that
costs the gateway speed shows as a ratio below the revision's. Part of ``bench/run.py gateway``.

    flock /tmp/octo-bench.lock .venv/bin/python bench/overhead.py [--requests 2000] [--rounds 3] [--loop auto]
        [--isolation thread|process] [--concurrency 1,8,64] [--compare REV ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from revtree import short_sha, worktree  # noqa: E402
from serverproc import free_port  # noqa: E402

BODY = {"model": "bench", "messages": [{"role": "user", "content": "hello there general kenobi"}]}

BARE_SERVER = r'''
import sys, time
from aiohttp import web
PAYLOAD = (b'{"id":"chatcmpl-0","object":"chat.completion","created":0,"model":"bench",'
           b'"system_fingerprint":"bare","choices":[{"index":0,"message":{"role":"assistant",'
           b'"content":"hello there general kenobi","refusal":null},"logprobs":null,"finish_reason":"stop"}],'
           b'"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}')
async def chat(request):
    await request.read()
    return web.Response(body=PAYLOAD, content_type="application/json")
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
loop = None
if sys.argv[2] == "uvloop":
    import uvloop
    loop = uvloop.new_event_loop()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, loop=loop)
'''


def budget_for(rps: float, client_us: float, cores: int | None = None) -> float:
    """The CPU a request (µs) octo may spend to serve ``rps`` here: its event loop's and engine thread's Python share
    one GIL, so it serves at most 1 / (its CPU a request) requests a second (``gil_bound_rps``, which the measured
    rates follow); and with the load generator spending ``client_us`` a request, both fit on the cores. The bare
    server is held back by the load generator instead (its CPU a request is far below the client's)."""
    cores = cores or os.cpu_count() or 1
    return round(min(1e6 / rps, cores * 1e6 / rps - client_us), 1)


def thread_round_trip_us(n: int = 5000) -> dict:
    """One thread wakes another through a queue and is woken back, ``n`` times: the wall time and this thread's CPU
    of one round trip (what each hand-off between octo's event loop and its engine thread costs on this host)."""
    import queue
    import threading

    there, back = queue.SimpleQueue(), queue.SimpleQueue()

    def echo() -> None:
        while there.get() is not None:
            back.put(1)

    th = threading.Thread(target=echo)
    th.start()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        there.put(1)
        back.get()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    there.put(None)
    th.join()
    return {"wall": round(1e6 * wall / n, 1), "cpu": round(1e6 * cpu / n, 1)}


def start(cmd: list[str], port: int, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start: {cmd}")


async def load(url: str, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    errors = 0
    payload = json.dumps(BODY).encode()
    headers = {"Content-Type": "application/json"}
    counter = iter(range(total))
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker():
            nonlocal errors
            for _ in counter:
                t0 = time.perf_counter()
                async with session.post(url, data=payload, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    return {"requests": total, "errors": errors, "seconds": elapsed, "rps": total / elapsed,
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


def _stat_seconds(path: str) -> float:
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread (the gateway's event loop) so far; the rest of a process's CPU is
    its other threads (the engine thread, thread pools)."""
    return _stat_seconds(f"/proc/{pid}/task/{pid}/stat")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live child processes (an engine worker) so far."""
    total = 0.0
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        total += _stat_seconds(f"/proc/{p}/stat")
    return total


def engine_steps(url: str) -> int | None:
    """The engine steps an octo server has run so far (its /v1/queue/stats; None for the bare server): steps a
    request show how requests batch (at concurrency 8 on the echo engine, 5 tokens each: 0.62 at best)."""
    try:
        with urllib.request.urlopen(url.replace("/v1/chat/completions", "/v1/queue/stats"), timeout=5) as r:
            return int(json.load(r)["steps"])
    except (OSError, ValueError, KeyError):
        return None


def loop_name(choice: str) -> str:
    """The loop octo's `--loop` picks for ``choice`` (auto: uvloop when installed)."""
    if choice != "auto":
        return choice
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def octo_cmd(port: int, loop: str, isolation: str) -> list[str]:
    cmd = [sys.executable, "-m", "octo.cli", "serve", "bench", "--engine", "echo", "--max-batch", "64",
           "--max-queue", "4096", "--port", str(port), "--log-level", "warning", "--loop", loop]
    return cmd + (["--isolation", isolation] if isolation != "thread" else [])  # older revisions lack the flag


async def main(args) -> dict:
    loop = loop_name(args.loop)
    servers: dict[str, tuple[list[str], int, Path]] = {}
    port = free_port()
    servers["octo"] = (octo_cmd(port, loop, args.isolation), port, REPO)
    for rev in args.compare:
        port = free_port()
        servers[f"octo@{short_sha(rev)}"] = (octo_cmd(port, loop, args.isolation), port, worktree(rev))
    port = free_port()
    servers["bare"] = ([sys.executable, "-c", BARE_SERVER, str(port), loop], port, REPO)
    procs = [start(cmd, port, cwd) for cmd, port, cwd in servers.values()]
    targets = {name: f"http://127.0.0.1:{port}/v1/chat/completions" for name, (_, port, _) in servers.items()}
    pids = dict(zip(targets, (p.pid for p in procs), strict=True))
    results: dict = {"host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                              "python": platform.python_version(), "thread_round_trip_us": thread_round_trip_us()},
                     "loop": loop, "isolation": args.isolation, "requests_per_round": args.requests,
                     "rounds": args.rounds, "concurrency": {}}
    rt = results["host"]["thread_round_trip_us"]
    print(f"host: a thread round trip costs {rt['wall']:.0f} us wall, {rt['cpu']:.0f} us CPU of the waker", flush=True)
    try:
        for url in targets.values():  # warm-up
            await load(url, 8, 200)
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {name: [] for name in targets}
            names = list(targets)
            for i in range(args.rounds):  # alternate A and B, each round in another order (none always first)
                for name in names[i % len(names):] + names[:i % len(names)]:
                    url = targets[name]
                    cpu0, loop0 = cpu_seconds(pids[name]), loop_cpu_seconds(pids[name])
                    client0, steps0 = time.process_time(), engine_steps(url) if name != "bare" else None
                    runs[name].append(await load(url, c, args.requests))
                    steps1 = engine_steps(url) if steps0 is not None else None
                    runs[name][-1]["steps"] = (steps1 - steps0) / args.requests if steps1 is not None else None
                    runs[name][-1]["client_cpu_us"] = 1e6 * (time.process_time() - client0) / args.requests
                    runs[name][-1]["cpu_us"] = 1e6 * (cpu_seconds(pids[name]) - cpu0) / args.requests
                    runs[name][-1]["loop_cpu_us"] = 1e6 * (loop_cpu_seconds(pids[name]) - loop0) / args.requests
            row = {}
            for name, rs in runs.items():
                row[name] = {"rps": statistics.median(r["rps"] for r in rs),
                             "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                             "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                             "cpu_us_per_request": round(statistics.median(r["cpu_us"] for r in rs), 1),
                             "loop_cpu_us_per_request": round(statistics.median(r["loop_cpu_us"] for r in rs), 1),
                             "client_cpu_us_per_request": round(statistics.median(r["client_cpu_us"] for r in rs), 1),
                             "errors": sum(r["errors"] for r in rs)}
            for name, rs in runs.items():  # per-round ratios: their spread is the noise
                if name != "bare":
                    ratios = sorted(r["rps"] / b["rps"] for r, b in zip(rs, runs["bare"], strict=True))
                    row[name]["ratio_rps"] = statistics.median(ratios)
                    row[name]["ratio_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
                    steps = [r["steps"] for r in rs if r["steps"] is not None]
                    row[name]["steps_per_request"] = round(statistics.median(steps), 2) if steps else None
            row["ratio_rps"] = row["octo"]["ratio_rps"]
            client = statistics.median(r["client_cpu_us"] for rs in runs.values() for r in rs)
            row["octo_cpu_budget_us_for_0_9x"] = budget_for(0.9 * row["bare"]["rps"], client)
            for name in runs:  # what the GIL allows: one request per (the server's CPU a request), all of it Python
                if name != "bare":
                    row[name]["gil_bound_rps"] = round(1e6 / row[name]["cpu_us_per_request"])
            results["concurrency"][str(c)] = row
            print(f"c={c:3d}  bare {row['bare']['rps']:8.0f} req/s p50 {row['bare']['p50_ms']:6.2f} ms, "
                  f"{row['bare']['cpu_us_per_request']:.0f} us CPU a request", flush=True)
            for name in targets:
                if name != "bare":
                    r = row[name]
                    print(f"       {name:14s} {r['rps']:8.0f} req/s p50 {r['p50_ms']:6.2f} ms p99 {r['p99_ms']:6.2f} "
                          f"ms, {r['cpu_us_per_request']:.0f} us CPU a request ({r['loop_cpu_us_per_request']:.0f} on "
                          f"the event loop's thread) | {r['ratio_rps']:.2f}x of bare "
                          f"(rounds {r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})"
                          + (f", {r['steps_per_request']:.2f} steps a request" if r["steps_per_request"] else ""),
                          flush=True)
            print(f"       the client: {client:.0f} us CPU a request; 0.9x of bare needs octo at "
                  f"<= {row['octo_cpu_budget_us_for_0_9x']:.0f} us CPU a request here", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="event loop of both servers (auto: octo's default)")
    ap.add_argument("--isolation", choices=["thread", "process"], default="thread",
                    help="octo's echo model in the gateway (its default) or in an engine worker process")
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV",
                    help="git revisions served beside this checkout in the same rounds")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "overhead.json"))
    a = ap.parse_args()
    res = asyncio.run(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")
