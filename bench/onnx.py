"""Benchmark of the onnx engine: octo over HTTP vs onnxruntime-genai's own ``og.Generator`` loop in-process.

Run (one benchmark at a time on a shared host):

    flock /tmp/octo-bench.lock .venv/bin/python bench/onnx.py          # part of bench/run.py engines

Model: the synthetic Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, 151,936
vocab, random weights from seed 0) turned into an onnxruntime-genai folder by onnxruntime-genai's model builder
(``-e cpu -p int4``); every contender uses the same folder and the same onnxruntime intra-op thread count.

What is measured, all greedy, EOS banned so every stream generates exactly max_tokens:
* raw: ``og.Generator`` in this process, no server: one prompt, and an N-prompt batch in one Generator
  (``batch_size=N``, prompts right-padded as ``Tokenizer.encode_batch`` pads them), ``generate_next_token``
  per step, ``min_length`` masking EOS. The ceiling for a Generator-based server.
* octo: ``octo serve FOLDER --engine onnx -o threads=T --max-batch N``, streaming ``/v1/completions`` with
  ``logit_bias`` banning the EOS tokens; N concurrent streams with distinct prompts; for both backends:
  ``session`` (continuous batching over KV rows octo owns, the default) and ``generator`` (og.Generator
  batch windows).
* staggered arrivals: N requests sent ``--gap`` seconds apart, for both backends: completion wall time and mean
  time to first token (what continuous batching changes compared with windows).
* prefix cache: time to first token with a long system prompt, first (miss) and again with another user turn
  (hit: the system prompt's KV rows are restored), session backend, cache on.

Decode throughput over HTTP is measured differentially, as bench/llamacpp.py does: each load runs with ``SHORT``
and ``LONG`` max_tokens, and the rate is ``streams * (LONG - SHORT) / (wall(LONG) - wall(SHORT))``; prefill, time
to first token and connection set-up cancel out (the SHORT and LONG loads use different prompts, and these
servers run with ``--no-cache``, so no prompt is served from the prefix cache). The raw loops time the same
decode steps (SHORT..LONG) on the LONG prompts, and the generated text is checked against octo's. The median of
``--reps`` runs is reported; octo and raw runs alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# This file is named onnx.py: keep its folder off sys.path so that ``import onnx`` finds the real package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and every evening the keeper",
    "A good engine answers quickly, keeps its memory small, and never forgets a request",
    "In the spring the river rose over its banks, and the farmers moved their animals",
    "She opened the letter carefully, read it twice, and then laughed out loud because",
    "Numbers can be written in many ways, and prices like these appear in shops when",
    "The teacher opened the window of the quiet school and the morning light came in",
    "Between the mountains and the ocean there was a small village with a market where",
    "Every engineer who builds a server must measure the speed of each request and",
]


def prompt(i: int, tag: str) -> str:
    return f"{PROMPTS[i % len(PROMPTS)]} ({tag}-{i})"


def eos_ids() -> list[int]:
    from octo.synth.tokenizer import special_ids

    ids = special_ids()
    return [ids["<|im_end|>"], ids["<|endoftext|>"]]


# -- raw og.Generator ------------------------------------------------------------------------------------
class Raw:
    def __init__(self, folder: str, threads: int) -> None:
        import onnxruntime_genai as og
        from octo.engines.onnx.folder import TextCodec, read_config

        self.og = og
        config = og.Config(folder)
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        spec, _ = read_config(Path(folder))
        self.pad = spec.pad_token_id
        self.codec = TextCodec(Path(folder), spec.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return self.codec.tokenize(text, special=False)

    def generate(self, prompts: list[list[int]], n_tokens: int) -> tuple[list[float], list[list[int]]]:
        """Step end times and generated tokens of an N-prompt Generator run for ``n_tokens`` steps."""
        import numpy as np

        og = self.og
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), self.pad, np.int32)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, batch_size=len(prompts), max_length=width + n_tokens,
                                  min_length=width + n_tokens)
        gen = og.Generator(self.model, params)
        gen.append_tokens(og.Tensor(ids))
        stamps, out = [], [[] for _ in prompts]
        for _ in range(n_tokens):
            gen.generate_next_token()
            for i, t in enumerate(gen.get_next_tokens().tolist()):
                out[i].append(t)
            stamps.append(time.perf_counter())
        return stamps, out

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.codec.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def raw_rate(raw: Raw, n: int, args, tag: str) -> tuple[float, list[list[int]]]:
    prompts = [raw.tokenize(prompt(i, tag + "l")) for i in range(n)]
    stamps, out = raw.generate(prompts, args.long)
    return n * (args.long - args.short) / (stamps[args.long - 1] - stamps[args.short - 1]), out


# -- octo over HTTP ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def octo(folder: str, args, backend: str, max_batch: int, cache: bool = False, timeout: float = 300):
    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", folder, "--engine", "onnx", "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", "256", "-o", f"threads={args.threads}",
           "-o", f"backend={backend}", *([] if cache else ["--no-cache"])]
    log = tempfile.NamedTemporaryFile("wb", prefix="bench-onnx-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"octo exited with {proc.returncode}; log: {log.name}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError(f"octo did not start in {timeout}s; log: {log.name}")
        with urllib.request.urlopen(base + "/v1/engines") as r:
            engines = json.loads(r.read())
        yield base, engines
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


async def stream_completion(session, base: str, body: dict, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    finish, first, text = None, None, []
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            for ch in data.get("choices", []):
                finish = ch.get("finish_reason") or finish
                if ch.get("text"):
                    first = first or time.perf_counter()
                    text.append(ch["text"])
    end = time.perf_counter()
    return {"start": t0, "end": end, "ttft": (first or end) - t0, "finish": finish, "text": "".join(text)}


async def load(base: str, n: int, max_tokens: int, tag: str, gap: float = 0.0) -> tuple[float, list[dict]]:
    """``n`` concurrent greedy streams of ``max_tokens`` (the i-th sent ``i * gap`` s late)."""
    import aiohttp

    bias = {str(t): -100.0 for t in eos_ids()}
    bodies = [{"prompt": prompt(i, tag), "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "logit_bias": bias} for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(stream_completion(s, base, b, i * gap) for i, b in enumerate(bodies)))
        wall = time.perf_counter() - t0
    bad = [r["finish"] for r in res if r["finish"] != "length"]
    if bad:
        raise RuntimeError(f"{base}: {len(bad)} of {n} streams ended early ({bad[:3]}); rates would be wrong")
    return wall, res


def octo_rate(base: str, n: int, args, tag: str) -> tuple[float, float, list[dict]]:
    """(differential decode tok/s, end-to-end tok/s at LONG, the LONG results) for n concurrent streams."""
    w_short, _ = asyncio.run(load(base, n, args.short, tag + "s"))
    w_long, res = asyncio.run(load(base, n, args.long, tag + "l"))
    return n * (args.long - args.short) / (w_long - w_short), n * args.long / w_long, res


def staggered(base: str, n: int, args) -> dict:
    wall, res = asyncio.run(load(base, n, args.long, "stagger", args.gap))
    return {"wall_s": round(wall, 2), "tok_s": round(n * args.long / wall, 1),
            "mean_ttft_s": round(statistics.mean(r["ttft"] for r in res), 3),
            "max_ttft_s": round(max(r["ttft"] for r in res), 3)}


def long_system_prompt(seed: int, n_words: int) -> str:
    import random

    rng = random.Random(seed)
    words = " ".join(PROMPTS).replace(",", "").split()
    return " ".join(rng.choice(words) for _ in range(n_words)) + "."


async def chat_once(base: str, system: str, user: str) -> tuple[float, int, int]:
    import aiohttp

    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            data = await r.json()
        wall = time.perf_counter() - t0
    usage = data["usage"]
    return wall, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def ttft(base: str, args) -> dict:
    """Time to first token for a long system prompt: a miss (new system prompt), then a hit (same system prompt,
    another user turn: the prefix cache restores the system prompt's KV rows and prefills only the new turn)."""
    miss, hit, cached, prompt_tokens = [], [], [], 0
    for rep in range(args.reps):
        system = long_system_prompt(rep, args.system_words)
        w, prompt_tokens, _ = asyncio.run(chat_once(base, system, "What does the keeper do?"))
        miss.append(w)
        w, _, c = asyncio.run(chat_once(base, system, "Where are the rocks?"))
        hit.append(w)
        cached.append(c)
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "miss_s": median(miss), "hit_s": median(hit),
            "speedup": round(statistics.median(miss) / statistics.median(hit), 1)}


# -- main --------------------------------------------------------------------------------------------------
def host_info() -> dict:
    import onnxruntime
    import onnxruntime_genai

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "onnxruntime_genai": onnxruntime_genai.__version__,
            "load_avg_at_start": os.getloadavg()}


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between staggered arrivals")
    ap.add_argument("--system-words", type=int, default=1200, help="words of the TTFT test's system prompt")
    ap.add_argument("--skip", nargs="*", default=[], choices=["generator", "staggered", "ttft"])
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "onnx.json"))
    args = ap.parse_args()

    from octo.synth.onnx import build_onnx

    t_build = time.perf_counter()
    folder = str(build_onnx(args.shape, precision=args.precision))
    result: dict = {"model": {"path": folder, "shape": args.shape, "precision": args.precision,
                              "size_bytes": sum(f.stat().st_size for f in Path(folder).iterdir())},
                    "host": host_info(), "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "build_or_cache_s": round(time.perf_counter() - t_build, 1)}
    raw = Raw(folder, args.threads)
    n = args.streams
    raw_r: dict = {"1": [], str(n): []}
    octo_r: dict = {"session": {"1": [], str(n): []}, "generator": {str(n): []}}
    same: dict = {}
    with octo(folder, args, "session", n) as (base, engines):
        result["engines_row"] = next(r for r in engines["data"] if r["name"] == "onnx")
        for k in (1, n):  # warm-up: first-run allocations (KV pages, bindings) in both processes
            asyncio.run(load(base, k, args.short, "warm"))
            raw.generate([raw.tokenize(prompt(i, "warm")) for i in range(k)], args.short)
        for rep in range(args.reps):  # alternate octo / raw
            for k in (1, n):
                rate, e2e, res = octo_rate(base, k, args, f"s{k}r{rep}")
                octo_r["session"][str(k)].append((rate, e2e))
                rrate, rout = raw_rate(raw, k, args, f"s{k}r{rep}")
                raw_r[str(k)].append(rrate)
                same[str(k)] = [r["text"] for r in res] == [raw.text(t) for t in rout]
                print(f"rep {rep} {k:>2} streams: octo {rate:.1f}  raw og.Generator {rrate:.1f} tok/s",
                      file=sys.stderr, flush=True)
        if "staggered" not in args.skip:
            result["staggered_session"] = staggered(base, n, args)
    if "generator" not in args.skip:
        with octo(folder, args, "generator", n) as (base, _):
            asyncio.run(load(base, n, args.short, "warm"))
            for rep in range(args.reps):
                rate, e2e, _ = octo_rate(base, n, args, f"g{n}r{rep}")
                octo_r["generator"][str(n)].append((rate, e2e))
                print(f"rep {rep} {n:>2} streams: octo generator backend {rate:.1f} tok/s", file=sys.stderr,
                      flush=True)
            if "staggered" not in args.skip:
                result["staggered_generator"] = staggered(base, n, args)
    if "ttft" not in args.skip:
        with octo(folder, args, "session", n, cache=True) as (base, _):
            result["ttft_long_system_prompt"] = ttft(base, args)
    result["raw_og_generator"] = {"decode_tok_s": {k: median(v) for k, v in raw_r.items()}}
    for backend, levels in octo_r.items():
        result[f"octo_{backend}"] = {
            "decode_tok_s": {k: median([x[0] for x in v]) for k, v in levels.items() if v},
            "e2e_tok_s": {k: median([x[1] for x in v]) for k, v in levels.items() if v},
        }
    result["same_greedy_text_as_raw"] = same
    rd, sd = result["raw_og_generator"]["decode_tok_s"], result["octo_session"]["decode_tok_s"]
    result["ratios"] = {
        "octo_vs_raw_1": round(sd["1"] / rd["1"], 3),
        f"octo_vs_raw_{n}": round(sd[str(n)] / rd[str(n)], 3),
        f"raw_{n}_vs_1": round(rd[str(n)] / rd["1"], 2),
        "targets": {"octo_vs_raw_1": ">= 0.95", f"octo_vs_raw_{n}": ">= 0.9"},
    }
    gd = result["octo_generator"]["decode_tok_s"]
    if gd:
        result["ratios"][f"generator_backend_vs_raw_{n}"] = round(gd[str(n)] / rd[str(n)], 3)
    if "ttft_long_system_prompt" in result:
        result["ratios"]["ttft_miss_vs_hit"] = result["ttft_long_system_prompt"]["speedup"]
    result["host"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
