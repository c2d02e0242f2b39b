"""Speculative decoding on llama.cpp (``--draft``, ``-o n_draft``): decode tok/s of the same model with and without a
draft model, alternating in one run, with the draft's acceptance rate.

Engine level (the llama.cpp engine octo serves with, no HTTP), on synthetic Qwen2.5-0.5B-shaped GGUFs:

* **agreeing draft** (a constructed best case): the target's layers from the third on write 0.002x
  their attention and MLP outputs (``ModelSpec.quiet_from``), so a 2-layer model with the same first layers (same
  names, same weights; ``num_hidden_layers=2``) predicts it well; both Q8_0. On the 0.5B shape the draft still
  carries the whole 151,936-token output matrix, so one draft token costs about a third of a target token; the
  **small vocabulary** pair is the same shape with a 4,096-token vocabulary, where the draft costs about 1/12.
* **disagreeing draft**: the first 2 layers of the ordinary synthetic 0.5B model (Q4_K_M), drafting for that ordinary
  model: random weights, so its proposals are rejected; this is the cost of a draft that does not help, with
  ``draft_p_min`` 0 (always draft) and with the default 0.75 (a row stops drafting at a token the draft is unsure of).
  The agreeing pairs run with ``draft_p_min`` 0 too: random weights leave every model unsure of every token.

For each pair, ``--streams`` (1 and 4) greedy streams of ``--prompt-tokens`` prompts decode ``--decode`` tokens each;
rounds alternate without / with the draft; tok/s is generated tokens over decode seconds, median over rounds; the
outputs with and without the draft are compared token by token (greedy: they should be identical).

    flock /tmp/octo-bench.lock .venv/bin/python bench/speculative.py     # part of bench/run.py engines
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kv_quant import prompt_text  # noqa: E402
from llamacpp import host_info  # noqa: E402


def models(shape: str, quant: str, threads: int) -> list[tuple[str, str, str, float, str]]:
    """(name, target GGUF, draft GGUF, draft_p_min, quantization) of each pair measured."""
    from octo.synth.gguf import build_gguf
    from octo.synth.spec import TOKENIZER_VOCAB, get_spec

    def build(spec, ftype):
        return str(build_gguf(spec, ftype=ftype, threads=threads))

    def quiet_pair(spec, ftype):
        quiet = dataclasses.replace(spec, name=f"{spec.name}-quiet2-002", quiet_from=2,
                                    quiet_scale=0.002)
        return build(quiet, ftype), build(dataclasses.replace(quiet, name=f"{quiet.name}-draft", num_hidden_layers=2),
                                          ftype)

    base = get_spec(shape)
    small_vocab = dataclasses.replace(base, name=f"{base.name}-v{TOKENIZER_VOCAB}", vocab_size=TOKENIZER_VOCAB)
    first2 = build(dataclasses.replace(base, name=f"{base.name}-first2", num_hidden_layers=2), quant)
    return [
        # q8_0: every layer quantized alike (Q4_K_M picks types by layer index and depth, so a 2-layer copy of a
        # 24-layer Q4_K_M model would not have the same weights)
        ("agreeing", *quiet_pair(base, "q8_0"), 0.0, "q8_0"),
        ("agreeing, small vocabulary", *quiet_pair(small_vocab, "q8_0"), 0.0, "q8_0"),
        ("disagreeing", build(base, quant), first2, 0.0, quant),
        ("disagreeing, default p_min", build(base, quant), first2, 0.75, quant),
    ]


def load(path: str, threads: int, max_batch: int, **opts):
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig

    e = LlamaCppEngine(EngineConfig(max_batch=max_batch, options={
        "n_ctx": "2048", "n_threads": str(threads), "cache_seqs": "0", **{k: str(v) for k, v in opts.items()}}))
    e.load(path, "bench")
    return e


def decode(e, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, int]:
    """Prefill each prompt, then decode all together until each has ``n`` tokens: (outputs, decode s, steps)."""
    from octo.engine import Feed, SamplingParams, Sequence

    seqs = [Sequence(i, list(p), SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in seqs]
    for s in seqs:
        e.add_sequence(s)
    try:
        for s, o in zip(seqs, out, strict=True):
            o.append(e.step([Feed(s, list(s.tokens), True)])[0])
        t0, steps = time.perf_counter(), 0
        live = list(range(len(seqs)))
        for s, o in zip(seqs, out, strict=True):
            s.tokens.append(o[-1])
        while live:
            res = e.step([Feed(seqs[i], [out[i][-1]], True) for i in live])
            steps += 1
            for i, r in zip(live, res, strict=True):
                got = (r if isinstance(r, list) else [r])[: n - len(out[i])]
                out[i] += got
                seqs[i].tokens += got  # every token a speculative step yields (the draft reads them)
            live = [i for i in live if len(out[i]) < n]
        dt = time.perf_counter() - t0
    finally:
        for s in seqs:
            e.remove_sequence(s)
    return out, dt, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--n-draft", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "speculative.json"))
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    result = {"pairs": {}, "model": {"shape": args.shape, "quant": args.quant}, "n_draft": args.n_draft,
              "decode_tokens": args.decode, "prompt_tokens": args.prompt_tokens, "host": host_info(args)}
    for pair, target, draft, p_min, quant in models(args.shape, args.quant, args.threads):
        plain = load(target, args.threads, max(streams))
        drafted = load(target, args.threads, max(streams), draft=draft, n_draft=args.n_draft,
                       draft_max_batch=max(streams), draft_p_min=p_min)
        rows = {}
        for n in streams:
            prompts = [plain.tokenize(prompt_text(i, args.prompt_tokens * 2))[: args.prompt_tokens] for i in range(n)]
            runs = {"plain": [], "draft": []}
            outs = {}
            before = dict(drafted.draft_stats())
            for _ in range(args.rounds):
                for name, e in (("plain", plain), ("draft", drafted)):
                    out, dt, steps = decode(e, prompts, args.decode)
                    runs[name].append({"tok_s": round(n * (args.decode - 1) / dt, 2), "steps": steps})
                    outs[name] = out
            after = drafted.draft_stats()
            proposed, accepted = after["proposed"] - before["proposed"], after["accepted"] - before["accepted"]
            med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
            equal = sum(a == b for x, y in zip(outs["plain"], outs["draft"], strict=True)
                        for a, b in zip(x, y, strict=True))
            steps = statistics.median(r["steps"] for r in runs["draft"])
            row = rows[f"{n}_streams"] = {
                "plain_tok_s": med["plain"], "draft_tok_s": med["draft"],
                "speedup": round(med["draft"] / med["plain"], 2),
                "acceptance": round(accepted / proposed, 4) if proposed else None,
                "tokens_per_step_per_stream": round((args.decode - 1) / steps, 2),
                "outputs_equal": round(equal / (n * args.decode), 4), "rounds": runs}
            print(pair, n, json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        result["pairs"][pair] = {"quant": quant, "draft_p_min": p_min, **rows}
        plain.unload()
        drafted.unload()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
