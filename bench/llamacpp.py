"""Benchmark of the llama.cpp engine: octo over HTTP vs raw llama.cpp in-process vs llama-cpp-python's server.

Run (one benchmark at a time on a shared host):

    flock /tmp/octo-bench.lock .venv/bin/python bench/llamacpp.py [--streams 8 16 32] [--out FILE]

Part of ``bench/run.py streams``.

Model: the synthetic Qwen2.5-0.5B-shaped GGUF (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, 151,936
vocab, random weights from seed 0) quantised to Q4_K_M by llama.cpp's own quantiser; every contender uses the
same file and the same thread count (default 2).

What is measured, all greedy:
* raw: llama.cpp through llama-cpp-python's low-level API in this process, no server: a greedy
  ``llama_decode`` loop (one sequence), an N-sequence batched loop (``n_seq_max=N``, unified KV, one token per
  sequence per ``llama_decode``), and prompt prefill. This is the ceiling.
* octo: ``octo serve FILE --engine llamacpp -o n_threads=T --max-batch N`` on loopback, streaming
  ``/v1/completions``; N concurrent streams with distinct prompts.
* llama_cpp.server: ``python -m llama_cpp.server`` on the same file and threads, ``--interrupt_requests False``
  (its default cuts off a running stream when a new request arrives), under the same load.

Decode throughput over HTTP is measured differentially: each load runs once with ``SHORT`` and once with ``LONG``
max_tokens, and the rate is ``streams * (LONG - SHORT) / (wall(LONG) - wall(SHORT))``. Prefill, time to first
token and connection set-up cancel out, and no per-token timestamps are needed (this random-weight model often
samples padding tokens whose text is empty, so SSE chunks are not one per token). The raw loops time the same
decode positions (steps SHORT..LONG). Every run checks finish_reason == "length" (all LONG tokens generated; the
end-of-generation tokens are banned with logit_bias, the same request for both servers). For each load level the
three contenders are interleaved (raw, octo, llama_cpp.server, raw, ...) so that drift on a shared host hits all
of them; the median of ``--reps`` is reported, with every run.

Time to first token: a ~2,000-token system prompt with a user turn (miss: new system prompt) and then the same
system prompt with a different user turn (hit: octo's prefix cache restores the KV), max_tokens=1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llama_server.py
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
    return f"[{tag}] {PROMPTS[i % len(PROMPTS)]}"


def long_system_prompt(seed: int, n_words: int = 1500) -> str:
    words = (
        "the harbor keeper light lamp ships rocks evening stairs narrow river farmers fields wheat summer "
        "engine memory request tokens batch queue server stream model cache market village window"
    ).split()
    rng = random.Random(seed)
    text = " ".join(rng.choice(words) for _ in range(n_words))
    return f"You are assistant number {seed}. Remember these notes: {text}."


# -- raw llama.cpp, in process ----------------------------------------------------------------------------
class Raw:
    """A bare llama.cpp context: one model, ``n_seq`` sequences, greedy native samplers, llama_batch_init."""

    def __init__(self, path: str, threads: int, n_seq: int, n_ctx: int, flash: bool) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        self.vocab = L.llama_model_get_vocab(self.model)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, n_seq
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 1 if flash else 0
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(512, 0, n_seq)
        self.n_seq = n_seq

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.L.llama_token * (len(data) + 8))()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, True)
        return buf[:n]

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def prefill(self, prompts: list[list[int]]) -> float:
        """Prefill every sequence (chunks of 512 tokens, no outputs); returns seconds."""
        items = [(t, p, s, False) for s, toks in enumerate(prompts) for p, t in enumerate(toks)]
        t0 = time.perf_counter()
        for i in range(0, len(items), 512):
            self._decode(items[i : i + 512])
        return time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], n_tokens: int) -> list[float]:
        """Prefill, then ``n_tokens`` batched greedy decode steps; returns the duration of each step."""
        L = self.L
        L.llama_memory_clear(self.mem, True)
        self.prefill([t[:-1] for t in prompts])  # all but the last token, then every last token in one batch
        self._decode([(t[-1], len(t) - 1, s, True) for s, t in enumerate(prompts)])
        chains = []
        for _ in prompts:
            c = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            L.llama_sampler_chain_add(c, L.llama_sampler_init_greedy())
            chains.append(c)
        last = [L.llama_sampler_sample(c, self.ctx, i) for i, c in enumerate(chains)]
        pos = [len(t) for t in prompts]
        times = []
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            self._decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = [L.llama_sampler_sample(chains[s], self.ctx, s) for s in range(len(prompts))]
            times.append(time.perf_counter() - t0)
            pos = [p + 1 for p in pos]
        for c in chains:
            L.llama_sampler_free(c)
        return times

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def raw_rate(raw: Raw, n: int, args, tag: str) -> float:
    """Greedy decode tok/s of the raw n-sequence loop over the same positions as the HTTP measurement."""
    prompts = [raw.tokenize(prompt(i, tag)) for i in range(n)]
    steps = raw.generate(prompts, args.long)
    return n * (args.long - args.short) / sum(steps[args.short :])


def raw_prefill(path: str, args) -> dict:
    raw = Raw(path, args.threads, 1, 4096, args.flash)
    toks = raw.tokenize(long_system_prompt(0, args.system_words))[: args.prefill_tokens]
    rates = []
    for _ in range(args.reps):
        raw.L.llama_memory_clear(raw.mem, True)
        rates.append(len(toks) / raw.prefill([toks]))
    raw.close()
    return {"prefill_tok_s": round(statistics.median(rates), 1), "prefill_tokens": len(toks)}


def kv_mechanisms(path: str, args) -> dict:
    """Prefix reuse measured in process: the engine's state_seq snapshots vs seq_cp cells vs recompute."""
    import llama_cpp as L
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig, Feed, SamplingParams, Sequence

    eng = LlamaCppEngine(
        EngineConfig(
            max_batch=4,
            options={"n_threads": str(args.threads), "n_ctx": "4096", "flash_attn": "on" if args.flash else "off"},
        )
    )
    eng.load(path, "bench")
    prefix = eng.tokenize(long_system_prompt(7, args.system_words))[:2000]
    tail = eng.tokenize(" and one more question about the harbor")[:10]

    def prefill(seq, toks):
        for i in range(0, len(toks), 256):
            eng.step([Feed(seq, toks[i : i + 256], i + 256 >= len(toks))])

    a = Sequence(1, list(prefix), SamplingParams(temperature=0))
    eng.add_sequence(a)
    t0 = time.perf_counter()
    prefill(a, prefix)
    t_recompute = time.perf_counter() - t0
    t0 = time.perf_counter()
    handle = eng.kv_save(a)
    t_save = time.perf_counter() - t0
    b = Sequence(2, list(prefix) + tail, SamplingParams(temperature=0))
    eng.add_sequence(b)
    t0 = time.perf_counter()
    eng.kv_restore(b, handle, len(prefix))
    t_restore = time.perf_counter() - t0
    prefill(b, tail)
    t_restore_tail = time.perf_counter() - t0
    eng.remove_sequence(b)
    # the alternative: share a's cells with a new sequence id (unified KV: metadata only, no copy)
    c = Sequence(3, list(prefix) + tail, SamplingParams(temperature=0))
    eng.add_sequence(c)
    t0 = time.perf_counter()
    L.llama_memory_seq_cp(eng.mem, a.slot.seq_id, c.slot.seq_id, -1, -1)
    t_cp = time.perf_counter() - t0
    c.n_cached = len(prefix)
    prefill(c, tail)
    t_cp_tail = time.perf_counter() - t0
    eng.remove_sequence(c)
    eng.remove_sequence(a)
    eng.unload()
    per_tok = handle.nbytes / len(prefix)
    return {
        "prefix_tokens": len(prefix),
        "tail_tokens": len(tail),
        "recompute_prefix_s": round(t_recompute, 3),
        "snapshot_save_s": round(t_save, 4),
        "snapshot_restore_s": round(t_restore, 4),
        "snapshot_restore_plus_tail_s": round(t_restore_tail, 3),
        "snapshot_bytes": handle.nbytes,
        "seq_cp_s": round(t_cp, 5),
        "seq_cp_plus_tail_s": round(t_cp_tail, 3),
        "seq_cp_pool_cells_held": len(prefix),
        "kv_bytes_per_token": round(per_tok),
    }


# -- servers ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, ready_path: str, name: str, timeout: float = 300, env: dict | None = None,
           cwd: Path = REPO):
    """``cmd`` running in ``cwd`` until the block ends, once ``ready_path`` answers 200 (its output: a temp log)."""
    log = tempfile.NamedTemporaryFile("wb", prefix=f"bench-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; log: {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in {timeout}s; log: {log.name}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def octo_cmd(path: str, port: int, args, max_batch: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "octo.cli.main",
        "serve",
        path,
        "--engine",
        "llamacpp",
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        "--max-queue",
        "256",
        "-o",
        f"n_threads={args.threads}",
        "-o",
        f"flash_attn={'on' if args.flash else 'off'}",
    ]


SETTLE_S = 7.0  # octo starts its spare worker 5 s after it serves, in a lull in the requests (octo.runtime.process)


def settle(limit: float = 20.0) -> None:
    """Before measured rounds (this file's, bench/paired.py's, bench/workers.py's): wait out the servers' start-up
    work (octo's spare worker: an interpreter start and imports, 0.3 s of a core) and then for a quiet host, so that
    none of it lands in a round (start-up is measured by bench/startup.py)."""
    from octo.benchload import wait_quiet

    time.sleep(SETTLE_S)
    wait_quiet(limit)


def cpp_cmd(path: str, port: int, args, n: int) -> list[str]:
    """The C++ llama-server (bench/llama_server.py builds it once): n slots, as many as streams, flash attention as
    for the others, --no-repack where octo's probe found the repack crashes."""
    import llama_cpp
    from llama_server import llama_server
    from octo.engines.llamacpp.probe import repack_safe

    cmd = [str(llama_server()), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
           "-np", str(n), "-c", str(max(4096, n * (args.long + 128))), "-fa", "on" if args.flash else "off"]
    return cmd + ([] if repack_safe(llama_cpp.__version__) else ["--no-repack"])


def lcp_cmd(path: str, port: int, args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--n_ctx",
        "4096",
        "--flash_attn",
        str(args.flash),
        "--interrupt_requests",
        "False",
        "--verbose",
        "False",
    ]


async def stream_completion(session, base: str, body: dict) -> dict:
    t0 = time.perf_counter()
    finish, chunks = None, 0
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            chunks += 1
            for ch in data.get("choices", []):
                finish = ch.get("finish_reason") or finish
    return {"wall": time.perf_counter() - t0, "finish": finish, "chunks": chunks}


def no_eos_bias() -> dict[str, float]:
    """logit_bias that bans the end-of-generation tokens, so every stream generates exactly max_tokens."""
    from octo.synth.tokenizer import special_ids

    ids = special_ids()
    return {str(ids[t]): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}


async def load(base: str, n: int, max_tokens: int, tag: str) -> float:
    """``n`` concurrent greedy streams of ``max_tokens``; returns the wall time until the last one ends."""
    import aiohttp

    bias = no_eos_bias()
    bodies = [
        {"prompt": prompt(i, tag), "max_tokens": max_tokens, "temperature": 0, "stream": True, "logit_bias": bias}
        for i in range(n)
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(stream_completion(s, base, b) for b in bodies))
        wall = time.perf_counter() - t0
    bad = [r["finish"] for r in res if r["finish"] != "length"]
    if bad:
        raise RuntimeError(f"{base}: {len(bad)} of {n} streams ended early ({bad[:3]}); rates would be wrong")
    return wall


def decode_rate(base: str, n: int, args, tag: str) -> tuple[float, float]:
    """(differential decode tok/s, end-to-end completion tok/s at LONG) for n concurrent streams."""
    w_short = asyncio.run(load(base, n, args.short, tag + "s"))
    w_long = asyncio.run(load(base, n, args.long, tag + "l"))
    return n * (args.long - args.short) / (w_long - w_short), n * args.long / w_long


async def ttft_once(base: str, system: str, user: str) -> tuple[float, int, int]:
    import aiohttp

    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            data = await r.json()
        dt = time.perf_counter() - t0
    if "usage" not in data:
        raise RuntimeError(f"TTFT request failed: {data}")
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return dt, data["usage"]["prompt_tokens"], cached


def ttft(base: str, args) -> dict:
    runs = []
    for k in range(args.reps):
        system = long_system_prompt(100 + k, args.system_words)
        miss, n_prompt, c_miss = asyncio.run(ttft_once(base, system, "Where is the lighthouse?"))
        hit, _, c_hit = asyncio.run(ttft_once(base, system, "Who lights the lamp in the evening?"))
        runs.append(
            {
                "prompt_tokens": n_prompt,
                "miss_s": round(miss, 3),
                "hit_s": round(hit, 3),
                "cached_tokens_miss": c_miss,
                "cached_tokens_hit": c_hit,
                "speedup": round(miss / hit, 1),
            }
        )
        print(f"ttft: miss {miss:.3f}s hit {hit:.3f}s ({c_hit} cached)", file=sys.stderr)
    return {
        "runs": runs,
        "miss_s": statistics.median(r["miss_s"] for r in runs),
        "hit_s": statistics.median(r["hit_s"] for r in runs),
        "speedup": round(statistics.median(r["speedup"] for r in runs), 1),
    }


def run_levels(args, level, reps: list[int], hide: str) -> None:
    """The 0.5B Q4_K_M GGUF, ``level(path, n, reps, args)`` for each of ``args.streams`` (``reps``: per level, the last
    repeats), each level's summary printed (without its ``hide`` key), all of it as JSON to ``args.out``."""
    args.flash = True
    from octo.synth.gguf import build_gguf

    path = str(build_gguf("qwen2.5-0.5b", ftype="q4_k_m", threads=args.threads))
    out = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "host": host_info(args), "levels": {}}
    for i, n in enumerate(args.streams):
        out["levels"][str(n)] = level(path, n, reps[min(i, len(reps) - 1)], args)
        print(n, {k: v for k, v in out["levels"][str(n)].items() if k != hide}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def host_info(args) -> dict:
    import llama_cpp
    from octo.engines.llamacpp.native import physical_cores

    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "load_avg_at_start": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--system-words", type=int, default=1930, help="size of the TTFT system prompt (~2,000 tokens)")
    ap.add_argument(
        "--flash",
        type=lambda s: s.lower() in ("1", "true", "on", "yes"),
        default=True,
        help="flash attention for every contender (default on: what llama.cpp's auto picks on CPU)",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["raw", "kv", "octo", "lcp", "cpp", "ttft"])
    ap.add_argument("--octo-env", nargs="*", default=[], metavar="KEY=VALUE", help="extra environment for octo")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "llamacpp.json"))
    args = ap.parse_args()
    args.octo_env = dict(kv.split("=", 1) for kv in args.octo_env)

    from octo.engines.llamacpp.native import LogTap

    from octo.synth.gguf import build_gguf

    LogTap.install()  # llama.cpp's log to Python logging (quiet) instead of stderr
    t_build = time.perf_counter()
    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    result: dict = {
        "model": {"path": path, "shape": args.shape, "quant": args.quant, "size_bytes": Path(path).stat().st_size},
        "host": host_info(args),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "build_s": round(time.perf_counter() - t_build, 1),
    }
    if "kv" not in args.skip:
        result["kv_mechanism"] = kv_mechanisms(path, args)
    raw_r: dict = {"decode_tok_s": {}}
    if "raw" not in args.skip:
        raw_r.update(raw_prefill(path, args))
    octo_r: dict = {"decode_tok_s": {}, "e2e_tok_s": {}}
    lcp_r: dict = {"decode_tok_s": {}, "e2e_tok_s": {}}
    cpp_r: dict = {"decode_tok_s": {}, "e2e_tok_s": {}}
    result["load_avg_per_level"] = {}
    with contextlib.ExitStack() as stack:
        lcp = None
        if "lcp" not in args.skip:
            port = free_port()
            lcp = stack.enter_context(server(lcp_cmd(path, port, args), port, "/v1/models", "llama_cpp.server"))
        for n in [1, *args.streams]:
            r_rates, o_rates, l_rates, c_rates = [], [], [], []
            port = free_port()
            octo = raw = cpp = None
            with contextlib.ExitStack() as per_level:
                if "octo" not in args.skip:
                    cmd = octo_cmd(path, port, args, max(8, n))
                    octo = per_level.enter_context(server(cmd, port, "/health", "octo", env=args.octo_env))
                if "cpp" not in args.skip:
                    cport = free_port()
                    cpp = per_level.enter_context(server(cpp_cmd(path, cport, args, n), cport, "/health",
                                                         "llama-server"))
                if "raw" not in args.skip:
                    raw = Raw(path, args.threads, n, max(4096, n * (args.long + 64)), args.flash)
                    per_level.callback(raw.close)
                if octo:
                    settle()
                result["load_avg_per_level"][str(n)] = os.getloadavg()
                for rep in range(args.reps):  # interleave raw / octo / llama_cpp.server, so drift hits all three
                    if raw:
                        r_rates.append(raw_rate(raw, n, args, f"r{n}r{rep}"))
                    if octo:
                        o_rates.append(decode_rate(octo, n, args, f"o{n}r{rep}"))
                    if lcp:
                        l_rates.append(decode_rate(lcp, n, args, f"l{n}r{rep}"))
                    if cpp:
                        c_rates.append(decode_rate(cpp, n, args, f"c{n}r{rep}"))
                if octo and n == 1 and "ttft" not in args.skip:
                    result["ttft_2000_token_system_prompt"] = ttft(octo, args)
            if r_rates:
                raw_r["decode_tok_s"][str(n)] = round(statistics.median(r_rates), 2)
                raw_r.setdefault("decode_tok_s_runs", {})[str(n)] = [round(x, 1) for x in r_rates]
            for rates, r in ((o_rates, octo_r), (l_rates, lcp_r), (c_rates, cpp_r)):
                if rates:
                    r["decode_tok_s"][str(n)] = round(statistics.median(x[0] for x in rates), 2)
                    r["e2e_tok_s"][str(n)] = round(statistics.median(x[1] for x in rates), 2)
                    r.setdefault("decode_tok_s_runs", {})[str(n)] = [round(x[0], 1) for x in rates]
            print(
                f"{n:>2} streams: raw {raw_r['decode_tok_s'].get(str(n))} octo {octo_r['decode_tok_s'].get(str(n))} "
                f"llama_cpp.server {lcp_r['decode_tok_s'].get(str(n))} "
                f"llama-server {cpp_r['decode_tok_s'].get(str(n))} tok/s",
                file=sys.stderr,
            )
    result["raw"] = raw_r
    result["octo"], result["llama_cpp_server"], result["llama_server_cpp"] = octo_r, lcp_r, cpp_r
    result["ratios"] = ratios(result)
    result["host"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


def ratios(r: dict) -> dict:
    out: dict = {}
    raw, o, lc = r.get("raw", {}).get("decode_tok_s", {}), r["octo"]["decode_tok_s"], r["llama_cpp_server"]
    for n, v in o.items():
        if n in raw:
            out[f"octo_vs_raw_{n}"] = round(v / raw[n], 3)
        if n in lc["decode_tok_s"]:
            out[f"octo_vs_llama_cpp_server_{n}"] = round(v / lc["decode_tok_s"][n], 2)
            out[f"octo_vs_llama_cpp_server_e2e_{n}"] = round(r["octo"]["e2e_tok_s"][n] / lc["e2e_tok_s"][n], 2)
        cpp = r.get("llama_server_cpp", {})
        if n in cpp.get("decode_tok_s", {}):
            out[f"octo_vs_llama_server_{n}"] = round(v / cpp["decode_tok_s"][n], 3)
            out[f"octo_vs_llama_server_e2e_{n}"] = round(r["octo"]["e2e_tok_s"][n] / cpp["e2e_tok_s"][n], 3)
    if "1" in raw and "8" in raw:
        out["raw_8_vs_1"] = round(raw["8"] / raw["1"], 2)
    if "ttft_2000_token_system_prompt" in r:
        out["ttft_miss_vs_hit"] = r["ttft_2000_token_system_prompt"]["speedup"]
    out["targets"] = {
        "octo_vs_raw_1": ">= 0.95",
        "octo_vs_raw_8": ">= 0.9",
        "octo_vs_llama_cpp_server_8": ">= 1.6",
        "octo_vs_llama_server_1/8/16": ">= 0.98",
        "ttft_miss_vs_hit": ">= 10",
    }
    return out


if __name__ == "__main__":
    main()
