"""Several models behind one octo server: load on demand, sharing the cores, memory across load/unload cycles.

One `octo serve` process (engine workers, the default), synthetic Qwen2.5-0.5B-shaped models:

1. Load on demand: with the llama.cpp model unloaded (its file in the page cache, no selection to run), the time
   from a streaming request for it to its first token, against what it cannot be below: its own load time (as
   /v1/models reports it) plus its time to first token once loaded. Target: the difference <= 0.2 s.
2. Sharing the cores: a llama.cpp model and a second model (ONNX int4 by default, or a second GGUF) each serving
   4 greedy streams: each alone, then both at once; with ``--share-cores os`` (octo's default: both thread pools
   run, and while both are busy llama.cpp computes with its share of the cores) and ``--share-cores turns`` (the
   arbiter: the workers compute in turns). Targets:
   the summed tok/s >= 0.9x the mean of the two single-model rates, neither below 0.3x its own. A Whisper
   transcription sent while both stream (apart from the measured rounds) must finish, and the streams go on.
3. Memory: gateway + worker RSS after each of 5 load/unload cycles of the llama.cpp model.

    flock /tmp/octo-bench.lock .venv/bin/python bench/multimodel.py     # part of bench/run.py load
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# bench/ holds mlx.py, onnx.py and whisper.py: keep it off sys.path so the real packages import
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO / "tests"))
from serverproc import rss_tree  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_llamacpp", REPO / "bench" / "llamacpp.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=60) as r:
        return json.loads(r.read())


def post(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


async def first_token(base: str, model: str, prompt: str) -> float:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "logit_bias": lc.no_eos_bias()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        async with s.post(f"{base}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(await r.text())
            async for raw in r.content:
                if raw.startswith(b"data:"):
                    return time.perf_counter() - t0
    raise RuntimeError("no token")


async def streams(base: str, model: str, n: int, max_tokens: int, tag: str) -> float:
    """Aggregate tok/s of ``n`` concurrent greedy streams of ``max_tokens`` each (end tokens banned)."""
    import aiohttp

    bodies = [{"model": model, "prompt": lc.prompt(i, tag), "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "logit_bias": lc.no_eos_bias()} for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(lc.stream_completion(s, base, b) for b in bodies))
        wall = time.perf_counter() - t0
    if any(r["finish"] != "length" for r in res):
        raise RuntimeError(f"{model}: a stream ended early")
    return n * max_tokens / wall


async def both(base: str, models: list[str], n: int, max_tokens: int, tag: str, audio: str | None) -> dict:
    """Both models streaming at once (and a transcription in the middle): each one's tok/s."""
    tasks = [asyncio.create_task(streams(base, m, n, max_tokens, f"{tag}{i}")) for i, m in enumerate(models)]
    out: dict = {}
    if audio:
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        out["transcription"] = await asyncio.to_thread(transcribe, base, audio)
        out["transcription_s"] = round(time.perf_counter() - t0, 2)
    rates = await asyncio.gather(*tasks)
    out["rates"] = dict(zip(models, rates, strict=True))
    return out


def transcribe(base: str, path: str) -> str:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    with open(path, "rb") as f:
        return client.audio.transcriptions.create(model="whisper-1", file=f).text


def fairness(path_a: str, path_b: str, args, share: str, audio: str | None) -> dict:
    port = lc.free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", path_a, path_b, args.whisper, "--port", str(port),
           "--max-batch", "8", "--share-cores", share, "--log-level", "warning"]
    with lc.server(cmd, port, "/health", f"octo-{share}") as base:
        models = [path_a, path_b]
        for m in models:  # warm-up
            asyncio.run(streams(base, m, 1, 8, "w"))
        alone = {m: [] for m in models}
        together = {m: [] for m in models}
        extra = []
        for k in range(args.reps):
            for m in models:
                alone[m].append(asyncio.run(streams(base, m, args.streams, args.tokens, f"a{k}")))
            r = asyncio.run(both(base, models, args.streams, args.tokens, f"b{k}", None))
            for m in models:
                together[m].append(r["rates"][m])
        if audio:  # apart from the measured rounds: a transcription while both models stream
            r = asyncio.run(both(base, models, args.streams, 2 * args.tokens, "t", audio))
            extra.append({"transcription": r["transcription"], "transcription_s": r["transcription_s"],
                          "stream_tok_s_meanwhile": {m: round(v, 2) for m, v in r["rates"].items()}})
        single = {m: statistics.median(v) for m, v in alone.items()}
        shared = {m: statistics.median(v) for m, v in together.items()}
        engines = {m["id"]: m.get("engine") for m in get(base, "/v1/models")["data"]}
    mean_single = statistics.fmean(single.values())
    return {"share_cores": share, "engines": engines,
            "single_tok_s": {m: round(v, 2) for m, v in single.items()},
            "together_tok_s": {m: round(v, 2) for m, v in shared.items()},
            "sum_over_mean_single": round(sum(shared.values()) / mean_single, 3),
            "each_over_own_single": {m: round(shared[m] / single[m], 3) for m in models},
            "runs": {"alone": alone, "together": together}, "during": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--second", choices=["onnx", "gguf"], default="onnx", help="the second model's engine")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "multimodel.json"))
    args = ap.parse_args()
    from octo.synth import build_for
    from octo.synth.gguf import build_gguf
    from octo.synth.whisper import build_whisper, speech

    gguf = str(build_gguf("qwen2.5-0.5b", ftype="q4_k_m"))
    second = str(build_for("qwen2.5-0.5b", "onnx", "int4")) if args.second == "onnx" else \
        str(build_gguf("qwen2.5-0.5b", ftype="q8_0"))
    args.whisper = str(build_whisper("test"))
    audio = str(speech("the engines take turns on the cores while this is transcribed", "/tmp/octo-mm.wav"))
    report: dict = {"models": {"llamacpp": gguf, "second": second}, "host": lc.host_info(argparse.Namespace())}

    # 1 + 3: load on demand, memory across cycles
    port = lc.free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", "resident", "--engine", "echo", "--port", str(port),
           "--log-level", "warning"]
    with lc.server(cmd, port, "/health", "octo-ondemand") as base:
        post(base, f"/v1/models/{gguf}/load")  # selection cached, file in the page cache
        post(base, f"/v1/models/{gguf}/unload")
        runs = []
        gateway = int(subprocess.check_output(["pgrep", "-f", f"serve resident .*port {port}"]).split()[0])
        rss = []
        for k in range(args.cycles):
            t_first = asyncio.run(first_token(base, gguf, lc.prompt(k, "od")))
            entry = get(base, f"/v1/models/{gguf}")
            warm = statistics.median(asyncio.run(first_token(base, gguf, lc.prompt(k, f"w{j}"))) for j in range(3))
            runs.append({"first_token_s": round(t_first, 3), "load_s": entry["load_seconds"],
                         "warm_ttft_s": round(warm, 3),
                         "overhead_s": round(t_first - entry["load_seconds"] - warm, 3)})
            rss_loaded = rss_tree(gateway)
            post(base, f"/v1/models/{gguf}/unload")
            rss.append({"loaded": rss_loaded, "unloaded": rss_tree(gateway)})
            print(f"on demand: first token {t_first:.3f} s = load {entry['load_seconds']:.3f} s + warm TTFT "
                  f"{warm:.3f} s + {runs[-1]['overhead_s']:+.3f} s; RSS after unload {rss[-1]['unloaded'] / 2**20:.0f} "
                  "MB", file=sys.stderr, flush=True)
    report["on_demand"] = {"runs": runs, "overhead_s_median": statistics.median(r["overhead_s"] for r in runs)}
    report["memory"] = {"cycles": rss, "last_over_first_unloaded": round(rss[-1]["unloaded"] / rss[0]["unloaded"], 3)}

    # 2: sharing the cores
    report["sharing"] = {share: fairness(gguf, second, args, share, audio) for share in ("os", "turns")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"load on demand: first token - (load + warm TTFT) = {report['on_demand']['overhead_s_median']:+.3f} s "
          f"(median of {args.cycles})")
    print(f"RSS after unload, last/first cycle: {report['memory']['last_over_first_unloaded']:.3f}")
    for share, r in report["sharing"].items():
        print(f"share-cores {share}: alone {r['single_tok_s']}, together {r['together_tok_s']}, sum/mean(single) "
              f"{r['sum_over_mean_single']}, each/own {r['each_over_own_single']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
