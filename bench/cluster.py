"""Scale-out on Ray Serve: what going through a cluster costs on one host, and what a second replica gives here.

Two `octo serve` processes on this host: a local one (echo in the gateway, the default) and one with
``--cluster ray`` (a local Ray head) serving, from a models file: echo with 1 replica, echo with 2 replicas, and the
synthetic tiny GGUF (llama.cpp) with 1 and with 2 replicas (the same file under two paths). Rounds of A and B
alternate, so drift on this shared host hits both sides alike.

1. Overhead: p50 latency of a short non-streamed chat request at concurrency 8, local echo vs echo behind Ray Serve
   (1 replica); the difference is what the cluster path adds (target <= 2 ms). Then, after both servers stopped,
   Ray Serve's own floor: a deployment that returns at once, called through a DeploymentHandle at the same
   concurrency from this driver (``--floor-only`` measures only that).
2. Throughput: aggregate generated tok/s of llama.cpp with 2 replicas vs 1 at concurrency 8 (greedy, no EOS). On
   a 2-core host two replicas share the same cores, so no gain is expected: the number shows what it is.
3. Sessions stick: multi-turn conversations (a shared system prompt, each conversation its own history); the share
   of prompt tokens served from the prefix cache on turns 2+, 2 replicas vs 1 (target: within 10%).

    flock /tmp/octo-bench.lock .venv/bin/python bench/cluster.py     # part of bench/run.py load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("OCTO_HOME", str(REPO / ".cache" / "octo-test"))
from serverproc import run_octo  # noqa: E402


def no_eos_bias() -> dict[str, float]:
    """Ban the synthetic tokenizer's end-of-generation tokens: every request generates exactly max_tokens."""
    from octo.synth.tokenizer import special_ids

    ids = special_ids()
    return {str(ids[t]): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}


SYSTEM = "You are a careful assistant who answers briefly. " * 12


async def _post(client, base: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


async def latency_round(client, base: str, model: str, n: int, conc: int) -> list[float]:
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> float:
        async with sem:
            dt, _ = await _post(client, base, {"model": model, "max_tokens": 4, "messages": [
                {"role": "user", "content": f"ping {i} one two three"}]})
            return dt

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def throughput_round(client, base: str, model: str, n: int, conc: int, max_tokens: int) -> float:
    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            _, body = await _post(client, base, {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                                 "logit_bias": no_eos_bias(), "messages": [
                                                     {"role": "user", "content": f"Tell story number {i}."}]})
            tokens += body["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return tokens / (time.perf_counter() - t0)


async def conversations(client, base: str, model: str, convs: int, turns: int, tag: str) -> dict:
    """Prompt tokens and cached prompt tokens of turns 2+ of ``convs`` conversations run side by side."""
    prompt = cached = 0
    replicas: dict[str, set] = {}

    async def conv(c: int) -> None:
        nonlocal prompt, cached
        history = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            history.append({"role": "user", "content": f"{tag} conversation {c}, question {t}: what next?"})
            r = await client.post(base + "/v1/chat/completions", json={"model": model, "max_tokens": 8,
                                                                      "messages": history})
            r.raise_for_status()
            body = r.json()
            replicas.setdefault(c, set()).add(r.headers.get("X-Octo-Replica"))
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            if t > 0:
                prompt += body["usage"]["prompt_tokens"]
                cached += (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    await asyncio.gather(*(conv(c) for c in range(convs)))
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / max(1, prompt), 4),
            "replicas_per_conversation": max(len(v) for v in replicas.values())}


async def run(args, local: str, cluster: str, gguf1: str, gguf2: str) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for base, model in ((local, "echo"), (cluster, "echo-r1"), (cluster, "echo-r2")):
            await latency_round(client, base, model, 32, args.concurrency)  # warm up
        lat = {"local": [], "ray": []}
        for _ in range(args.rounds):
            lat["local"] += await latency_round(client, local, "echo", args.requests, args.concurrency)
            lat["ray"] += await latency_round(client, cluster, "echo-r1", args.requests, args.concurrency)
        p50 = {k: statistics.median(v) * 1000 for k, v in lat.items()}
        p99 = {k: sorted(v)[int(0.99 * (len(v) - 1))] * 1000 for k, v in lat.items()}
        overhead = {"concurrency": args.concurrency, "requests_per_side": len(lat["local"]),
                    "p50_ms": {k: round(v, 3) for k, v in p50.items()},
                    "p99_ms": {k: round(v, 3) for k, v in p99.items()},
                    "p50_added_ms": round(p50["ray"] - p50["local"], 3), "target_ms": 2.0}
        overhead["meets_target"] = overhead["p50_added_ms"] <= 2.0

        tps = {"1 replica": [], "2 replicas": []}
        for model in (gguf1, gguf2):
            await throughput_round(client, cluster, model, 8, 8, 16)  # warm up
        for _ in range(args.tp_rounds):
            tps["1 replica"].append(await throughput_round(client, cluster, gguf1, 16, 8, args.max_tokens))
            tps["2 replicas"].append(await throughput_round(client, cluster, gguf2, 16, 8, args.max_tokens))
        med = {k: statistics.median(v) for k, v in tps.items()}
        throughput = {"engine": "llamacpp", "model": "synthetic tiny GGUF (q8_0)", "concurrency": 8,
                      "max_tokens": args.max_tokens, "tok_s_rounds": {k: [round(x, 1) for x in v] for k, v in
                                                                     tps.items()},
                      "tok_s_median": {k: round(v, 1) for k, v in med.items()},
                      "ratio_2_vs_1": round(med["2 replicas"] / med["1 replica"], 3),
                      "cores": os.cpu_count()}

        hits = {}
        for i in range(2):  # alternate: 1 replica, 2 replicas, again
            for model, label in (("echo-r1", "1 replica"), ("echo-r2", "2 replicas")):
                got = await conversations(client, cluster, model, args.convs, args.turns, f"run{i}-{label}")
                prev = hits.get(label)
                if prev is None:
                    hits[label] = got
                else:
                    for k in ("prompt_tokens", "cached_tokens"):
                        prev[k] += got[k]
                    prev["hit_rate"] = round(prev["cached_tokens"] / max(1, prev["prompt_tokens"]), 4)
                    prev["replicas_per_conversation"] = max(prev["replicas_per_conversation"],
                                                            got["replicas_per_conversation"])
        rel = hits["2 replicas"]["hit_rate"] / max(1e-9, hits["1 replica"]["hit_rate"])
        sticky = {"engine": "echo", "conversations": args.convs, "turns": args.turns, **hits,
                  "ratio_2_vs_1": round(rel, 4), "within_10pct": rel >= 0.9}
        placement = {m["id"]: m["cluster"]["placement"] for m in (await client.get(cluster + "/v1/models")).json()[
            "data"] if "cluster" in m}
    return {"overhead": overhead, "throughput": throughput, "sessions": sticky, "placement": placement}


def ray_floor(conc: int, n: int, rounds: int) -> dict:
    """Ray Serve's own cost of one request on this host, without octo: a deployment that returns at once, called
    through a DeploymentHandle at concurrency ``conc`` from this driver (a local head, Serve's throughput-optimized
    mode as octo sets it). What octo's cluster path adds beyond this is octo's."""
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    import ray
    from ray import serve

    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, namespace="octo-floor",
             log_to_driver=False)
    try:
        serve.start(http_options={"location": "NoServer"})

        @serve.deployment(max_ongoing_requests=64)
        class Floor:
            async def __call__(self, i: int) -> dict:
                return {"i": i}

        handle = serve.run(Floor.bind(), name="floor", route_prefix=None)

        async def measure() -> list[float]:
            sem = asyncio.Semaphore(conc)

            async def one(i: int) -> float:
                async with sem:
                    t0 = time.perf_counter()
                    await handle.remote(i)
                    return time.perf_counter() - t0

            await asyncio.gather(*(one(i) for i in range(32)))  # warm up
            out: list[float] = []
            for _ in range(rounds):
                out += await asyncio.gather(*(one(i) for i in range(n)))
            return out

        lat = asyncio.run(measure())  # (ray.shutdown below ends Serve too)
    finally:
        ray.shutdown()
    return {"concurrency": conc, "requests": len(lat), "p50_ms": round(statistics.median(lat) * 1000, 3),
            "p99_ms": round(sorted(lat)[int(0.99 * (len(lat) - 1))] * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tp-rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "cluster.json"))
    ap.add_argument("--floor-only", action="store_true", help="measure only Ray Serve's own floor")
    args = ap.parse_args()
    if args.floor_only:
        print(json.dumps(ray_floor(args.concurrency, args.requests, args.rounds), indent=2))
        return
    from octo.synth.gguf import build_gguf

    gguf = build_gguf("tiny", ftype="q8_0")
    tmp = Path(tempfile.mkdtemp(prefix="octo-bench-cluster-"))
    gguf1, gguf2 = str(tmp / "tiny-one.gguf"), str(tmp / "tiny-two.gguf")
    shutil.copy(gguf, gguf1)
    shutil.copy(gguf, gguf2)
    models = [{"model": "echo-r1", "engine": "echo", "replicas": 1},
              {"model": "echo-r2", "engine": "echo", "replicas": 2},
              # what Ray reserves is what each replica computes with: 1 x 2 cores vs 2 x 1 core on this host
              {"model": gguf1, "engine": "llamacpp", "replicas": 1, "resources": {"num_cpus": 2}},
              {"model": gguf2, "engine": "llamacpp", "replicas": 2, "resources": {"num_cpus": 1}}]
    mf = tmp / "models.yaml"
    mf.write_text(json.dumps({"models": models}))
    t0 = time.time()
    try:
        with run_octo("echo", "--engine", "echo") as local, \
                run_octo("--models-file", str(mf), "--cluster", "ray", "--replica-cpus", "0.5",
                         timeout=600) as cluster:
            result = asyncio.run(run(args, local.base_url, cluster.base_url, gguf1, gguf2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import ray

    # Ray Serve's own floor, measured after the octo servers stopped (their Ray head included)
    floor = ray_floor(args.concurrency, args.requests, args.rounds)
    result["overhead"]["ray_floor"] = floor
    result["overhead"]["p50_added_beyond_ray_floor_ms"] = round(
        result["overhead"]["p50_added_ms"] - floor["p50_ms"], 3)
    result["host"] = {"cores": os.cpu_count(), "ray": ray.__version__, "python": sys.version.split()[0]}
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
