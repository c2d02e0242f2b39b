"""CPU per streamed token: octo's gateway against a bare aiohttp server streaming the same SSE chunks.

At one stream each token is one wake-up of the server and one write to the client, whatever the server does in
between. This measures what octo's gateway spends per streamed token beyond that floor: octo serves the echo engine in
a worker process (``--isolation process``, as a native engine runs), paced by ``token_delay_ms`` like a decode, and
the bare server (aiohttp on the same event loop, octo's default: uvloop when installed) writes one chunk of the same
shape per timer tick. CPU time is read per process from ``/proc/PID/task/*/schedstat`` (nanoseconds, every thread):
octo's gateway process, its worker, and the bare server. Rounds alternate the two servers.

    flock /tmp/octo-bench.lock .venv/bin/python bench/stream_cost.py     # part of bench/run.py gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from overhead import start  # noqa: E402
from serverproc import children, free_port  # noqa: E402

BARE_SERVER = r'''
import asyncio, json, sys
from aiohttp import web
async def completions(request):
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    words = body["prompt"].split()
    for i in range(body["max_tokens"]):
        await asyncio.sleep(float(sys.argv[2]) / 1000)
        chunk = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": body["model"],
                 "system_fingerprint": "bare", "choices": [{"index": 0, "text": " " + words[i % len(words)],
                 "logprobs": None, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
try:
    import uvloop
    loop = uvloop.new_event_loop()
except ImportError:
    loop = None
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, loop=loop)
'''


def cpu_ns(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return total


async def stream(base: str, streams: int, tokens: int) -> int:
    words = " ".join(f"w{i}" for i in range(tokens))
    body = {"model": "echo-m", "prompt": words, "max_tokens": tokens, "stream": True}

    async def one(session: aiohttp.ClientSession) -> int:
        n = 0
        async with session.post(f"{base}/v1/completions", json=body) as r:
            async for line in r.content:
                n += line.startswith(b"data: {")
        return n

    async with aiohttp.ClientSession() as session:
        return sum(await asyncio.gather(*(one(session) for _ in range(streams))))


def measure(pids: dict[str, int], base: str, streams: int, tokens: int) -> dict[str, float]:
    before = {k: cpu_ns(p) for k, p in pids.items()}
    chunks = asyncio.run(stream(base, streams, tokens))
    after = {k: cpu_ns(p) for k, p in pids.items()}
    out = {f"{k}_us_per_token": round((after[k] - before[k]) / 1000 / chunks, 1) for k in pids}
    out["chunks"] = chunks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--token-ms", type=float, default=20.0, help="pause per token (a 0.5B decode here: ~21 ms)")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "stream_cost.json"))
    args = ap.parse_args()
    octo_port, bare_port = free_port(), free_port()
    octo = start([sys.executable, "-m", "octo.cli", "serve", "echo-m", "--engine", "echo", "--isolation", "process",
                  "-o", f"token_delay_ms={args.token_ms}", "--port", str(octo_port)], octo_port)
    bare = start([sys.executable, "-c", BARE_SERVER, str(bare_port), str(args.token_ms)], bare_port)
    runs: dict[str, dict[str, list]] = {"octo": {}, "bare": {}}
    try:
        worker = children(octo.pid)[0]
        servers = {"octo": ({"gateway": octo.pid, "worker": worker}, f"http://127.0.0.1:{octo_port}"),
                   "bare": ({"server": bare.pid}, f"http://127.0.0.1:{bare_port}")}
        for _, base in servers.values():
            asyncio.run(stream(base, 1, 20))  # warm-up
        for r in range(args.rounds):
            for name in (["octo", "bare"] if r % 2 == 0 else ["bare", "octo"]):
                pids, base = servers[name]
                for n in args.streams:
                    runs[name].setdefault(str(n), []).append(measure(pids, base, n, args.tokens))
            print(r, {k: {n: v[-1] for n, v in d.items()} for k, d in runs.items()}, file=sys.stderr, flush=True)
    finally:
        for p in (octo, bare):
            p.terminate()
            p.wait(30)
    summary = {}
    for n in map(str, args.streams):
        gw = statistics.median(x["gateway_us_per_token"] for x in runs["octo"][n])
        floor = statistics.median(x["server_us_per_token"] for x in runs["bare"][n])
        summary[n] = {"octo_gateway_us_per_token": gw, "bare_server_us_per_token": floor,
                      "octo_worker_us_per_token": statistics.median(x["worker_us_per_token"] for x in runs["octo"][n]),
                      "gateway_vs_bare": round(gw / floor, 3)}
    result = {"config": vars(args), "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                            "load_avg": os.getloadavg()},
              "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
