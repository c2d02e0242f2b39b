"""The disk prefix cache (``--prefix-cache-dir``): time to first token of a request whose long prefix is on disk after
a restart, against the same request served from the in-memory prefix cache and from a cold prefill.

    flock /tmp/octo-bench.lock .venv/bin/python bench/disk_cache.py      # 0.5B shape, q4_k_m, 4,000-token prefix

Each round (``--rounds``) uses a new ~4,000-token system prompt:
1. a server with an empty cache folder answers prompt A (system + question 1): a **cold** prefill; its KV goes to the
   in-memory cache and, in the background, to disk;
2. the same server answers system + question 2: an **in-memory hit**;
3. the server is restarted on the same folder and answers system + question 3: a **disk hit** (the prefix is read
   from disk, imported into the engine, and the rest of the prompt prefilled).
Each server first answers a short unrelated request (its first decode allocates the compute graph), so all three are
timed on a warm server. Every request is a chat completion with max_tokens=1, so the time is the time to first token
(measured client-side, request sent to answer received, over loopback). The target: a disk hit within 1.5x the
in-memory hit, far below cold. JSON to ``--out``; part of ``bench/run.py agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import tool_prefix  # noqa: E402
from llamacpp import REPO, free_port, host_info, server  # noqa: E402

QUESTIONS = ["Which tool reads a file?", "Which tool runs the tests?", "Which tool applies a patch?"]


async def ask(base: str, system: str, question: str) -> tuple[float, int, int]:
    import aiohttp

    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            data = await r.json()
        dt = time.perf_counter() - t0
    if "usage" not in data:
        raise RuntimeError(f"request failed: {data}")
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return dt, data["usage"]["prompt_tokens"], cached


def disk_writes(base: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/cache/stats", timeout=10) as r:
        stats = json.load(r)
    return sum((m.get("disk") or {}).get("writes", 0) for m in stats["models"].values())


def octo(path: str, folder: str, args):
    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", path, "--engine", "llamacpp", "--port", str(port),
           "-o", f"n_threads={args.threads}", "--prefix-cache-dir", folder]
    return server(cmd, port, "/health", "octo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "disk_cache.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    runs = []
    for k in range(args.rounds):
        system, n_system = tool_prefix(args.prefix_tokens, seed=100 + k)
        with tempfile.TemporaryDirectory(prefix="octo-disk-cache-") as folder:
            with octo(path, folder, args) as base:
                asyncio.run(ask(base, "Be brief.", "hi"))  # warm-up: each server's first decode allocates its graph
                cold, n_prompt, c0 = asyncio.run(ask(base, system, QUESTIONS[0]))
                memory, _, c1 = asyncio.run(ask(base, system, QUESTIONS[1]))
                deadline = time.monotonic() + 60
                while disk_writes(base) < 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
            with octo(path, folder, args) as base:
                asyncio.run(ask(base, "Be brief.", "hi"))
                disk, _, c2 = asyncio.run(ask(base, system, QUESTIONS[2]))
            size = sum(f.stat().st_size for f in Path(folder).rglob("*.kv"))
        run = {"prompt_tokens": n_prompt, "system_tokens": n_system, "cold_s": round(cold, 3),
               "memory_hit_s": round(memory, 3), "disk_hit_s": round(disk, 3), "cached_cold": c0,
               "cached_memory": c1, "cached_disk": c2, "disk_bytes": size,
               "disk_over_memory": round(disk / memory, 2), "cold_over_disk": round(cold / disk, 1)}
        print(json.dumps(run), flush=True)
        runs.append(run)
    summary = {key: statistics.median(r[key] for r in runs)
               for key in ("cold_s", "memory_hit_s", "disk_hit_s", "disk_over_memory", "cold_over_disk")}
    result = {"summary": summary, "runs": runs, "model": {"shape": args.shape, "quant": args.quant},
              "host": host_info(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
