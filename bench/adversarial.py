"""No request holds the others hostage: a 4-token request beside one adversarial request, against its time alone.

One `octo serve` of the synthetic Qwen2.5-0.5B-shaped Q4_K_M GGUF (llama.cpp). The victim: a chat request with
``max_tokens`` 4 (end tokens banned), non-streaming, timed end to end. Each adversary is started, given a moment to
get going, then the victim runs; rounds alternate "alone" and "beside" and the median of each is kept:

* ``long-prompt``: a completion whose prompt fills most of the context (prefill, in chunks);
* ``long-stops``: a 300-token generation with 16 stop strings of 500 characters that never match;
* ``wide-n``: one request with ``n`` = ``--max-batch`` - 1 sequences of 300 tokens;
* ``long-generation``: one 1,000-token generation (the baseline: plain batching).

``--step-stretch`` is the server's (octo serve --step-stretch: prompt chunks may stretch a step to that many
decode-only steps while others decode, and a step carries at most about 0.25 s of prompt work; 0: whole prefill
chunks). The price of that pacing is measured too: the long prompt's own time alone (``long_prompt_alone_s``), and
the mean time to the first generated token of 8 short streaming requests sent at once (``burst8_ttft_s``).
Writes JSON to ``--out``; part of ``bench/run.py load``.

    flock /tmp/octo-bench.lock .venv/bin/python bench/adversarial.py
"""

from __future__ import annotations

import argparse
import asyncio
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
MODEL = ""


def adversaries(args, bias: dict) -> dict[str, tuple[str, dict]]:
    words = lc.long_system_prompt(7, n_words=args.prompt_words)
    stops = [("§" + str(i)) * 125 for i in range(16)]  # 500 characters each, never generated
    return {
        "long-prompt": ("/v1/completions", {"prompt": words, "max_tokens": 1, "temperature": 0}),
        "long-stops": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}],
                                                "max_tokens": 300, "temperature": 0, "stop": stops,
                                                "logit_bias": bias}),
        "wide-n": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}], "temperature": 0.8,
                                            "n": args.max_batch - 1, "max_tokens": 300, "logit_bias": bias}),
        "long-generation": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write on."}],
                                                     "max_tokens": 1000, "temperature": 0, "logit_bias": bias}),
    }


async def victim(session, base: str, bias: dict, i: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say four words ({i})."}], "max_tokens": 4,
            "temperature": 0, "logit_bias": bias}
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200 and data["usage"]["completion_tokens"] == 4, data
    return time.perf_counter() - t0


async def round_beside(base: str, path: str, body: dict, bias: dict, i: int, lead: float) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        adv = asyncio.ensure_future(s.post(f"{base}{path}", json={"model": MODEL, **body}))
        await asyncio.sleep(lead)
        took = await victim(s, base, bias, i)
        resp = await adv
        assert resp.status == 200, await resp.text()
        await resp.read()
    return took


async def timed(base: str, path: str, body: dict) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        async with s.post(f"{base}{path}", json={"model": MODEL, **body}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return time.perf_counter() - t0


async def burst_ttft(base: str, n: int) -> float:
    """Mean time to the first streamed chunk of ``n`` short chat requests sent together."""
    import aiohttp

    async def one(s, i: int) -> float:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Burst request {i}, hello."}],
                "max_tokens": 2, "stream": True}
        t0 = time.perf_counter()
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            async for raw in r.content:  # the first chunk with generated text (not the role chunk sent at admission)
                if raw.startswith(b"data: {") and any(c["delta"].get("content") or c.get("finish_reason")
                                                      for c in json.loads(raw[6:])["choices"]):
                    return time.perf_counter() - t0
        raise RuntimeError("no chunk")

    async with aiohttp.ClientSession() as s:
        return statistics.mean(await asyncio.gather(*(one(s, i) for i in range(n))))


async def round_alone(base: str, bias: dict, i: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        return await victim(s, base, bias, i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=1400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lead", type=float, default=0.3, help="seconds the adversary runs before the victim starts")
    ap.add_argument("--step-stretch", type=float, nargs="+", default=[2.0, 0.0])
    ap.add_argument("--flash", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--only", nargs="+", default=None, help="run only these adversaries (default: all)")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "adversarial.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    path = str(build_gguf(args.shape, ftype=args.quant, threads=args.threads))
    bias = lc.no_eos_bias()
    out: dict = {"config": vars(args), "host": lc.host_info(args), "results": {}}
    for stretch in args.step_stretch:
        port = lc.free_port()
        cmd = lc.octo_cmd(path, port, args, args.max_batch) + ["--step-stretch", str(stretch), "--no-cache"]
        rows = {}
        with lc.server(cmd, port, "/health", f"octo-stretch-{stretch}") as base:
            global MODEL
            with urllib.request.urlopen(f"{base}/v1/models") as r:
                MODEL = json.loads(r.read())["data"][0]["id"]
            asyncio.run(round_alone(base, bias, -1))  # warm-up
            for name, (route, body) in adversaries(args, bias).items():
                if args.only and name not in args.only:
                    continue
                alone, beside = [], []
                for i in range(args.rounds):
                    alone.append(asyncio.run(round_alone(base, bias, i)))
                    beside.append(asyncio.run(round_beside(base, route, body, bias, i, args.lead)))
                rows[name] = {"alone_s": statistics.median(alone), "beside_s": statistics.median(beside),
                              "ratio": round(statistics.median(beside) / statistics.median(alone), 2),
                              "alone_rounds": alone, "beside_rounds": beside}
                print(f"stretch {stretch} {name}: {rows[name]['ratio']}x", file=sys.stderr, flush=True)
            rows["burst8_ttft_s"] = statistics.median(asyncio.run(burst_ttft(base, 8)) for _ in range(args.rounds))
            route, body = adversaries(args, bias)["long-prompt"]
            rows["long_prompt_alone_s"] = statistics.median(
                asyncio.run(timed(base, route, body)) for _ in range(args.rounds))
        out["results"][f"step_stretch={stretch:g}"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
