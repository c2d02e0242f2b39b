"""KV pressure: streams that together need about twice the KV pool still all finish, identical to their runs alone.

Three `octo serve` processes on the synthetic Qwen2.5-0.5B-shaped Q4_K_M GGUF (llama.cpp, one unified KV pool):

* ``small-swap``: a pool of ``--small-cells`` (default 6,144) cells, preempted sequences keep their KV in host
  memory (``--preempt swap``, the default);
* ``small-recompute``: the same pool, preempted sequences recompute their KV when they resume;
* ``large``: a pool large enough for the whole load (no preemption).

The load: ``--streams`` (8) concurrent greedy streaming completions of ``--tokens`` (1,500) tokens each, end tokens
banned so each generates exactly that many. Rounds alternate the three servers. Reported per server: failures
(a stream without finish_reason "length", an error, fewer tokens), aggregate tok/s (median over rounds), and the
preemptions the server counted. Each stream's text is compared with the same prompt run alone on the large server
(one stream at a time): identical, or the index of the first different character; and with the same streams on the
``large`` server (the same load without KV pressure: what preemption itself must not change). llama.cpp is not
batch-invariant: a different batch or KV layout changes the last bits of the logits, and on random weights a near
tie flips, so a stream batched with others differs from its run alone with or without preemption (the ``large``
server shows it with no preemption at all). The exact no-token-lost proof is the scripted engine's:
tests/test_kv_pressure_functional.py runs echo with a pool half the load's size through a real server.

    flock /tmp/octo-bench.lock .venv/bin/python bench/kv_pressure.py     # part of bench/run.py load
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_llamacpp", REPO / "bench" / "llamacpp.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


async def one_stream(session, base: str, prompt: str, max_tokens: int, bias: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logit_bias": bias,
            "stream_options": {"include_usage": True}}
    text, finish, usage, error = [], None, None, None
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                error = data["error"].get("message")
            for ch in data.get("choices", []):
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
            usage = data.get("usage") or usage
    return {"text": "".join(text), "finish": finish, "tokens": (usage or {}).get("completion_tokens"),
            "error": error}


async def run_load(base: str, prompts: list[str], max_tokens: int,
                   timeline: list | None = None) -> tuple[float, list[dict]]:
    """Every prompt at once; ``timeline`` (if given) gets (seconds, active, preempted) from the server every second."""
    import aiohttp

    bias = lc.no_eos_bias()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as s:
        t0 = time.perf_counter()
        load = asyncio.gather(*(one_stream(s, base, p, max_tokens, bias) for p in prompts))
        while timeline is not None and not load.done():
            async with s.get(f"{base}/v1/queue/stats") as r:
                q = (await r.json())
            timeline.append((round(time.perf_counter() - t0, 1), q.get("active"), q.get("preempted")))
            await asyncio.wait([load], timeout=1.0)
        res = await load
        return time.perf_counter() - t0, res


def batch_profile(timeline: list) -> dict:
    """Seconds spent at each number of running sequences (from the 1 s samples)."""
    out: dict[str, float] = {}
    for (t, active, _), (t2, _, _) in zip(timeline, timeline[1:], strict=False):
        out[str(active)] = round(out.get(str(active), 0.0) + (t2 - t), 1)
    return dict(sorted(out.items(), key=lambda kv: -int(kv[0]) if kv[0].isdigit() else 0))


def queue_stats(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/v1/queue/stats", timeout=10) as r:
        return json.loads(r.read())


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--small-cells", type=int, default=6144)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--flash", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "kv_pressure.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    large = 1 << (args.streams * args.n_ctx - 1).bit_length()
    servers = {"small-swap": (args.small_cells, "swap"), "small-recompute": (args.small_cells, "recompute"),
               "large": (large, "swap")}
    prompts = [lc.prompt(i, "kvp") for i in range(args.streams)]
    out: dict = {"config": {**vars(args), "large_cells": large}, "host": lc.host_info(args), "servers": {}}
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, (cells, mode) in servers.items():
            port = lc.free_port()
            cmd = lc.octo_cmd(path, port, args, args.streams) + [
                "-o", f"n_ctx={args.n_ctx}", "-o", f"kv_cells={cells}", "--preempt", mode, "--no-cache"]
            bases[name] = stack.enter_context(lc.server(cmd, port, "/health", f"octo-{name}"))
        for base in bases.values():  # warm-up
            asyncio.run(run_load(base, prompts[:2], 8))
        alone = []
        for p in prompts:
            _, (r,) = asyncio.run(run_load(bases["large"], [p], args.tokens))
            alone.append(r)
        rates: dict[str, list[float]] = {n: [] for n in servers}
        checks: dict[str, list] = {}
        texts: dict[str, list] = {}
        for _ in range(args.reps):
            for name, base in bases.items():
                before = queue_stats(base)["total_preemptions"]
                timeline: list = []
                wall, res = asyncio.run(run_load(base, prompts, args.tokens, timeline))
                failures = [r for r in res if r.get("error") or r.get("finish") != "length"
                            or r.get("tokens") != args.tokens]
                rates[name].append(args.streams * args.tokens / wall)
                checks[name] = {
                    "failures": len(failures),
                    "failure_examples": [str(f)[:300] for f in failures[:3]],
                    "preemptions": queue_stats(base)["total_preemptions"] - before,
                    "identical_to_alone": sum(r.get("text") == a.get("text") for r, a in zip(res, alone, strict=True)),
                    "first_difference": [first_difference(r.get("text") or "", a.get("text") or "")
                                         for r, a in zip(res, alone, strict=True)],
                    "seconds_at_batch": batch_profile(timeline),
                }
                texts[name] = [r.get("text") for r in res]
                print(name, f"{rates[name][-1]:.1f} tok/s", checks[name], file=sys.stderr, flush=True)
    for name in servers:  # the same load without KV pressure: what preemption must not change
        checks[name]["identical_to_large_pool"] = sum(a == b for a, b in zip(texts[name], texts["large"], strict=True))
        out["servers"][name] = {"tok_s": statistics.median(rates[name]), "rounds": rates[name], **checks[name]}
    big = out["servers"]["large"]["tok_s"]
    out["ratios"] = {f"{n}_vs_large": round(out["servers"][n]["tok_s"] / big, 3) for n in servers if n != "large"}
    out["alone_failures"] = sum(1 for a in alone if a.get("finish") != "length")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["ratios"]), file=sys.stderr)


if __name__ == "__main__":
    main()
