"""Ollama's /api/chat against OpenAI's /v1/chat/completions on the same octo server and model, in one run.

The same conversation and token count go through both routes (``options.num_predict`` / ``max_tokens``, greedy), not
streamed and streamed (NDJSON / SSE, every line read), at concurrency 1 and 8. Rounds alternate the two routes so
that machine noise hits both alike; each cell reports requests/s per route and their ratio (ollama / openai; 1.0:
the same cost), the median over rounds, and the server's CPU time per request (gateway and worker processes, from
``/proc/PID/task/*/schedstat``), which other jobs on a shared host disturb far less than throughput. The model: the
echo engine in a worker process paced like a decode (``--token-delay-ms``), or with ``--gguf`` the tiny synthetic
GGUF on llama.cpp.

    flock /tmp/octo-bench.lock .venv/bin/python bench/ollama.py [--rounds 5] [--requests 48] [--tokens 32] [--gguf]
                                                                  [--out FILE]
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

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from serverproc import children, run_octo  # noqa: E402
from stream_cost import cpu_ns  # noqa: E402

WORDS = " ".join(f"word{i}" for i in range(200))


def bodies(model: str, tokens: int, stream: bool) -> dict[str, tuple[str, dict]]:
    messages = [{"role": "user", "content": WORDS}]
    return {"ollama": ("/api/chat", {"model": model, "messages": messages, "stream": stream,
                                     "options": {"num_predict": tokens, "temperature": 0}}),
            "openai": ("/v1/chat/completions", {"model": model, "messages": messages, "stream": stream,
                                                "max_tokens": tokens, "temperature": 0})}


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        if body["stream"]:
            async for _ in r.content:  # every line, as a client reads them
                pass
        else:
            await r.read()


def server_cpu(pids: list[int]) -> int:
    """CPU nanoseconds the server's processes (gateway and workers) have used so far."""
    return sum(cpu_ns(p) for p in pids)


async def round_(base: str, path: str, body: dict, concurrency: int, total: int) -> float:
    """Requests/s of ``total`` requests, ``concurrency`` at a time."""
    left = total
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one(session, base + path, body)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - started)


async def measure(base: str, model: str, pids: list[int], args) -> dict:
    out: dict = {}
    for stream in (False, True):
        routes = bodies(model, args.tokens, stream)
        for c in (1, 8):
            n = args.requests if c > 1 else max(8, args.requests // 4)
            for path, body in routes.values():  # warm-up of both routes
                await round_(base, path, body, c, c)
            rates: dict[str, list[float]] = {"ollama": [], "openai": []}
            cpu: dict[str, list[float]] = {"ollama": [], "openai": []}  # server CPU ms per request
            for r in range(args.rounds):
                order = list(routes) if r % 2 == 0 else list(reversed(routes))
                for name in order:
                    path, body = routes[name]
                    before = server_cpu(pids)
                    rates[name].append(await round_(base, path, body, c, n))
                    cpu[name].append((server_cpu(pids) - before) / n / 1e6)
            ratios = [a / b for a, b in zip(rates["ollama"], rates["openai"], strict=True)]
            cpu_ratios = [a / b for a, b in zip(cpu["ollama"], cpu["openai"], strict=True)]
            cell = {"requests_per_round": n, "ollama_rps": [round(x, 2) for x in rates["ollama"]],
                    "openai_rps": [round(x, 2) for x in rates["openai"]],
                    "ratio_median": round(statistics.median(ratios), 4),
                    "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
                    "ollama_cpu_ms_per_request": [round(x, 3) for x in cpu["ollama"]],
                    "openai_cpu_ms_per_request": [round(x, 3) for x in cpu["openai"]],
                    "cpu_ratio_median": round(statistics.median(cpu_ratios), 4)}
            key = f"{'stream' if stream else 'nonstream'}_c{c}"
            out[key] = cell
            print(f"{key}: req/s ollama/openai = {cell['ratio_median']:.3f} (rounds {cell['ratio_min']:.3f}.."
                  f"{cell['ratio_max']:.3f}); server CPU per request ollama/openai = "
                  f"{cell['cpu_ratio_median']:.3f} ({statistics.median(cpu['openai']):.2f} ms openai)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48, help="requests per round at concurrency 8 (a quarter at 1)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=1.0, help="echo engine: time per decode step")
    ap.add_argument("--gguf", action="store_true", help="the tiny synthetic GGUF on llama.cpp instead of echo")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "ollama.json"))
    args = ap.parse_args()
    if args.gguf:
        from octo.synth.gguf import build_gguf

        serve = [str(build_gguf("tiny", ftype="q8_0")), "--engine", "llamacpp"]
        model = "tiny"
    else:
        serve = ["bench-echo", "--engine", "echo", "--isolation", "process", "-o",
                 f"token_delay_ms={args.token_delay_ms}"]
        model = "bench-echo"
    with run_octo(*serve, "--max-batch", "8") as server:
        if args.gguf:
            model = server.get_json("/v1/models")["data"][0]["id"]
        pids = [server.proc.pid, *children(server.proc.pid)]
        cells = asyncio.run(measure(server.base_url, model, pids, args))
    result = {"bench": "ollama", "serve": serve, "tokens": args.tokens, "rounds": args.rounds,
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                       "load_avg": os.getloadavg()},
              "cells": cells}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
