"""LoRA adapters: what serving several adapters from one model costs in decode speed, on llama.cpp and MLX.

Engine level, the synthetic demo shape (float32 llama.cpp GGUF / float32 MLX folder, 4 layers, 256 wide) with two
synthetic adapters (rank 8 on q, v, o, up; rank 4 on k, gate, down: octo.synth.lora). Decode tok/s of ``--streams``
(8) greedy streams, four mixes, alternated within each round (median over ``--rounds``):

* ``base``: no adapter (the engine has the adapters loaded, none is used);
* ``one``: every stream on adapter x;
* ``two``: 4 streams on x, 4 on y;
* ``base+one``: 4 streams without adapter, 4 on x.

llama.cpp's adapter set is per context, so a step of ``two`` or ``base+one`` runs one ``llama_decode`` per adapter
(engines/llamacpp/lora.py); MLX adds each row's adapter term inside one batched forward pass (engines/mlx/lora.py).

    flock /tmp/octo-bench.lock .venv/bin/python bench/lora.py              # part of bench/run.py engines
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/, whose mlx.py and llamacpp.py would shadow the libraries

MIXES = {"base": [None] * 8, "one": ["x"] * 8, "two": ["x", "y"] * 4, "base+one": [None, "x"] * 4}
X = dict(seed=1)
Y = dict(seed=2, rank=4, alpha=4.0, targets=("k_proj", "gate_proj", "down_proj"), strength=0.8)


def decode_rate(e, adapters: list, prompt_tokens: int, steps: int) -> float:
    from octo.engine import Feed, SamplingParams, Sequence

    words = "the harbor light river garden engine letter number spring window".split()
    seqs = []
    for i, a in enumerate(adapters):
        toks = e.tokenize(" ".join(words[(i + j) % len(words)] for j in range(prompt_tokens)))[:prompt_tokens]
        seqs.append(Sequence(i, toks, SamplingParams(temperature=0.0, adapter=a)))
    for s in seqs:
        e.add_sequence(s)
    try:
        for s in seqs:
            s.tokens.append(e.step([Feed(s, list(s.tokens), True)])[0])
        e.step([Feed(s, s.tokens[-1:], True) for s in seqs])  # the first decode step (warms the batch)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = e.step([Feed(s, s.tokens[-1:], True) for s in seqs])
            for s, t in zip(seqs, out, strict=True):
                s.tokens.append(t)
        return len(seqs) * steps / (time.perf_counter() - t0)
    finally:
        for s in seqs:
            e.remove_sequence(s)


def engines(threads: int) -> dict:
    from octo.engine import EngineConfig
    from octo.synth.lora import LoraSpec, build_gguf_lora, build_mlx_lora

    out = {}
    try:
        from octo.engines.llamacpp import LlamaCppEngine

        from octo.synth.gguf import build_gguf

        paths = {k: str(build_gguf_lora("demo", 0, LoraSpec(**v))) for k, v in (("x", X), ("y", Y))}
        e = LlamaCppEngine(EngineConfig(max_batch=8, options={"n_ctx": "512", "n_threads": str(threads),
                                                              "lora": json.dumps(paths)}))
        e.load(str(build_gguf("demo", 0, "f32")), "demo")
        out["llamacpp"] = e
    except ImportError as exc:
        print(f"llamacpp skipped: {exc}")
    from octo.engines.mlx import MLXEngine

    if MLXEngine.detect().available:
        from octo.synth.mlx import build_mlx

        paths = {k: str(build_mlx_lora("demo", 0, LoraSpec(**v))) for k, v in (("x", X), ("y", Y))}
        e = MLXEngine(EngineConfig(max_batch=8, options={"lora": json.dumps(paths)}))
        e.load(str(build_mlx("demo")), "demo")
        out["mlx"] = e
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "lora.json"))
    args = ap.parse_args()
    loaded = engines(args.threads)
    rates = {name: {m: [] for m in MIXES} for name in loaded}
    for r in range(args.rounds):
        order = list(MIXES) if r % 2 == 0 else list(reversed(MIXES))
        for name, e in loaded.items():
            for mix in order:
                rates[name][mix].append(decode_rate(e, MIXES[mix], args.prompt_tokens, args.steps))
                print(f"round {r} {name} {mix}: {rates[name][mix][-1]:.0f} tok/s", flush=True)
    result = {"model": "synthetic demo (float32), adapters rank 8 (q,v,o,up) and rank 4 (k,gate,down)",
              "host": platform.node(), "cpus": os.cpu_count(), "threads": args.threads, "streams": 8,
              "decode_steps": args.steps, "engines": {}}
    for name, e in loaded.items():
        med = {m: round(statistics.median(v), 1) for m, v in rates[name].items()}
        result["engines"][name] = {"decode_tok_s": med, "rounds": {m: [round(x, 1) for x in v]
                                                                   for m, v in rates[name].items()},
                                   "vs_base": {m: round(med[m] / med["base"], 3) for m in MIXES}}
        if name == "llamacpp":
            result["engines"][name]["adapter_switches"] = e.adapters.switches
        e.unload()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
