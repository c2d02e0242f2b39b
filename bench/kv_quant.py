"""KV-cache quantization on llama.cpp (``-o cache_type=f16|q8_0|q4_0``): bytes per token, tok/s at 8 streams, the
longest context a fixed KV memory budget holds, and how often q8_0 / q4_0 greedy output agrees with f16.

Engine level (the llama.cpp engine octo serves with, no HTTP), on the synthetic Qwen2.5-0.5B-shaped GGUF (Q4_K_M
weights; 24 layers, 2 KV heads of 64: 12,288 KV bytes per token in f16):

* KV bytes per token: ``llama_state_seq_get_size`` of one sequence at two lengths (the difference over the tokens
  between: no header), next to the engine's own accounting (``kv_bytes_per_token``) and llama.cpp's allocated KV
  buffer (its "KV buffer size" log line) divided by the cells.
* tok/s at ``--streams`` (8) streams: every stream's ``--prompt-tokens`` prompt is prefilled (one step each), then
  ``--decode`` greedy steps of all streams together are timed (aggregate generated tokens / decode seconds; prefill
  tok/s reported too). Rounds alternate the types (f16, q8_0, q4_0, f16, ...) so a busy shared host slows all alike;
  the median over rounds is reported.
* Longest context in ``--budget-mib`` of KV: budget / measured bytes per token, checked by creating a context of that
  many cells and reading llama.cpp's KV buffer size (it must fit the budget).
* Greedy agreement with f16 over the first ``--agree-tokens`` tokens of ``--agree-prompts`` prompts, all decoded in
  one batch per type (the same batch for every type): the share of prompts whose first N tokens are identical, the
  mean length of the identical prefix, and the share of positions equal. Random weights: a near tie flips on tiny
  numeric differences, and after the first difference the texts part for good, so only the first tokens mean much.

    flock /tmp/octo-bench.lock .venv/bin/python bench/kv_quant.py          # part of bench/run.py engines
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TYPES = ("f16", "q8_0", "q4_0")
WORDS = ("harbor lighthouse river garden engine letter number spring window market silver forest winter music "
         "station candle mountain bridge paper orange").split()


def prompt_text(i: int, n_words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(n_words))


def load(path: Path, cache_type: str, max_batch: int, n_ctx: int, threads: int, **opts):
    from octo.engines.llamacpp import LlamaCppEngine
    from octo.engines.llamacpp.native import LogTap

    from octo.engine import EngineConfig

    e = LlamaCppEngine(EngineConfig(max_batch=max_batch, options={
        "n_ctx": str(n_ctx), "n_threads": str(threads), "cache_type": cache_type, "cache_seqs": "0", **opts}))
    LogTap.recent = collections.deque(maxlen=100_000)  # keep every load line (the KV buffer's among them)
    e.load(str(path), "bench")
    e.kv_buffer_bytes = kv_buffer_bytes()
    return e


def kv_buffer_bytes() -> int | None:
    """llama.cpp's allocated KV buffer, from its log line ``... KV buffer size = 12.00 MiB``."""
    from octo.engines.llamacpp.native import LogTap

    total = 0.0
    for line in LogTap.recent:
        m = re.search(r"KV buffer size\s*=\s*([\d.]+) MiB", line)
        if m:
            total += float(m.group(1))
    return round(total * 2**20) if total else None


def state_bytes_per_token(e, n1: int = 64, n2: int = 320) -> float:
    from octo.engine import Feed, SamplingParams, Sequence

    toks = e.tokenize(prompt_text(99, n2 * 2))[:n2]
    s = Sequence(1, toks, SamplingParams(temperature=0.0))
    e.add_sequence(s)
    try:
        e.step([Feed(s, toks[:n1], False)])
        a = e.lib.llama_state_seq_get_size(e.ctx, s.slot.seq_id)
        e.step([Feed(s, toks[n1:], False)])
        b = e.lib.llama_state_seq_get_size(e.ctx, s.slot.seq_id)
    finally:
        e.remove_sequence(s)
    return (b - a) / (n2 - n1)


def greedy(e, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float]:
    """Each prompt prefilled in a step of its own, then ``n`` - 1 decode steps of all of them together: (generated
    tokens, prefill s, decode s)."""
    from octo.engine import Feed, SamplingParams, Sequence

    seqs = [Sequence(i, list(p), SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    for s in seqs:
        e.add_sequence(s)
    try:
        t0 = time.perf_counter()
        out = [e.step([Feed(s, list(s.tokens), True)])[0] for s in seqs]
        t1 = time.perf_counter()
        gen = [[t] for t in out]
        for _ in range(n - 1):
            for s, g in zip(seqs, gen, strict=True):
                s.tokens.append(g[-1])
            out = e.step([Feed(s, s.tokens[-1:], True) for s in seqs])
            for g, t in zip(gen, out, strict=True):
                g.append(t)
        t2 = time.perf_counter()
    finally:
        for s in seqs:
            e.remove_sequence(s)
    return gen, t1 - t0, t2 - t1


def agreement(ref: list[list[int]], other: list[list[int]], n: int) -> dict:
    prefixes, equal = [], 0
    for a, b in zip(ref, other, strict=True):
        k = next((i for i in range(n) if a[i] != b[i]), n)
        prefixes.append(k)
        equal += sum(a[i] == b[i] for i in range(n))
    return {"first_token_equal": round(sum(k > 0 for k in prefixes) / len(prefixes), 4),
            "prompts_identical": round(sum(k == n for k in prefixes) / len(prefixes), 4),
            "mean_identical_prefix": round(statistics.mean(prefixes), 2),
            "positions_equal": round(equal / (n * len(ref)), 4),
            "first_difference": prefixes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=64.0)
    ap.add_argument("--agree-prompts", type=int, default=16)
    ap.add_argument("--agree-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "kv_quant.json"))
    args = ap.parse_args()

    from octo.synth.gguf import build_gguf

    path = build_gguf(args.shape, 0, args.quant)
    n_ctx = max(args.prompt_tokens + args.decode + 8, 512)
    engines = {t: load(path, t, args.streams, n_ctx, args.threads) for t in TYPES}
    result: dict = {"model": f"synthetic {args.shape} {args.quant}", "host": platform.node(),
                    "cpus": os.cpu_count(), "threads": args.threads, "streams": args.streams,
                    "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode, "types": {}}
    for t, e in engines.items():
        result["types"][t] = {
            "kv_bytes_per_token_state": round(state_bytes_per_token(e), 1),
            "kv_bytes_per_token_engine": e.cell_bytes,
            "kv_buffer_bytes_per_cell": round(e.kv_buffer_bytes / e.kv_cells, 1) if e.kv_buffer_bytes else None,
            "flash_attn": e.info.extra["flash_attn"],
        }
    # tok/s: rounds alternate the types
    prompts = [engines["f16"].tokenize(prompt_text(i, args.prompt_tokens * 2))[:args.prompt_tokens]
               for i in range(args.streams)]
    rates: dict[str, list] = {t: [] for t in TYPES}
    prefill: dict[str, list] = {t: [] for t in TYPES}
    for r in range(args.rounds):
        for t in TYPES if r % 2 == 0 else reversed(TYPES):
            _, tp, td = greedy(engines[t], prompts, args.decode + 1)
            rates[t].append(args.streams * args.decode / td)
            prefill[t].append(args.streams * args.prompt_tokens / tp)
            print(f"round {r} {t}: decode {rates[t][-1]:.1f} tok/s, prefill {prefill[t][-1]:.0f} tok/s", flush=True)
    for t in TYPES:
        result["types"][t].update(decode_tok_s=round(statistics.median(rates[t]), 2),
                                  prefill_tok_s=round(statistics.median(prefill[t]), 1),
                                  decode_tok_s_rounds=[round(x, 2) for x in rates[t]])
    # greedy agreement with f16 (same batch of prompts for every type)
    agree_prompts = [engines["f16"].tokenize(prompt_text(100 + i, 12 + i)) for i in range(args.agree_prompts)]
    outs = {}
    for t in TYPES:
        outs[t] = []
        for i in range(0, len(agree_prompts), args.streams):
            outs[t] += greedy(engines[t], agree_prompts[i:i + args.streams], args.agree_tokens)[0]
    for t in TYPES[1:]:
        result["types"][t]["agreement_with_f16"] = agreement(outs["f16"], outs[t], args.agree_tokens)
    for e in engines.values():
        e.unload()
    # the longest context in a fixed KV budget, checked against llama.cpp's own allocation
    budget = int(args.budget_mib * 2**20)
    for t in TYPES:
        per_token = result["types"][t]["kv_bytes_per_token_state"]
        cells = int(budget // per_token) // 256 * 256  # llama.cpp pads the cells to 256
        e = load(path, t, 1, cells, args.threads)
        result["types"][t]["budget"] = {"budget_bytes": budget, "max_context_tokens": cells,
                                        "kv_buffer_bytes": e.kv_buffer_bytes,
                                        "fits": e.kv_buffer_bytes is not None and e.kv_buffer_bytes <= budget}
        e.unload()
    f16 = result["types"]["f16"]
    for t in TYPES[1:]:
        q = result["types"][t]
        q["vs_f16"] = {"kv_bytes": round(q["kv_bytes_per_token_state"] / f16["kv_bytes_per_token_state"], 3),
                       "decode_tok_s": round(q["decode_tok_s"] / f16["decode_tok_s"], 3),
                       "max_context": round(q["budget"]["max_context_tokens"] / f16["budget"]["max_context_tokens"], 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
