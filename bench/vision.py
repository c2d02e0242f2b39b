"""Images, octo against llama-server on the same GGUF and projector: time to first token, a second turn, and the other
streams while an image encodes.

    flock /tmp/octo-bench.lock .venv/bin/python bench/vision.py [--model vision-bench] [--reps 3] [--out FILE]

Both servers run at once on the model's two files (a synthetic vision model of ``octo.synth.vision``, written by
llama.cpp's own converter; ``vision-bench``, a Qwen2.5-VL with a ViT large enough that an encode takes a good part of
a second on a CPU, is the default), with the same threads: ``octo serve MODEL --engine llamacpp`` and ``llama-server
-m MODEL --mmproj MMPROJ`` built from the llama.cpp octo's engine runs (``bench/llama_server.py engine``), with
``--streams + 1`` slots; octo's KV layout is given (``-o kv_unified=true``, llama.cpp's unified pool, the layout it
serves with until its idle probes decide), so that no probe takes the cores while llama-server is measured. The
measurements take turns between the two servers (the order swaps every repetition), each server idle while the other
one works, after a warm-up (a picture in each of their slots at once: llama-server's first use of a slot builds its
graphs). Octo serves the GGUF's path, the projector found beside it (``vision-bench`` is not in the catalog):

- ``ttft``: a request with one picture (a new one each time: no cache can hold it) and a short question, greedy,
  ``max_tokens`` 1: its wall time is the time to the first token, encode and prefill included. Then the second turn
  about the same picture (the first turn, an answer, a new question): its prefix, the picture included, is in the
  server's cache (octo's prefix cache, llama-server's slot). Targets: octo's first turn within 1.1x llama-server's,
  its second turn at least 5x faster than its first.
- ``gaps``: ``--streams`` greedy text streams decoding (``ignore_eos``), then one request with a picture: each stream's
  gaps between tokens while the picture is encoded and prefilled (from its request until its first token), against
  the gaps before it arrived (max and mean, over all streams).

Prints JSON (and writes ``--out``) with the host's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llama_server.py, bench/llamacpp.py

from llama_server import llama_server  # noqa: E402
from llamacpp import free_port, server, settle  # noqa: E402

QUESTION = "What is in this picture?"
ANSWER = "A picture with a few shapes on a coloured background."
FOLLOW_UP = "Which colour is the large shape?"


def picture(k: int, size: tuple[int, int]) -> str:
    """A PNG data URL, different for every ``k``: a gradient and two shapes whose colours and places depend on it."""
    from PIL import Image, ImageDraw

    w, h = size
    img = Image.new("RGB", size, ((37 * k) % 256, (91 * k) % 256, (53 * k + 80) % 256))
    draw = ImageDraw.Draw(img)
    draw.ellipse(((7 * k) % (w // 2), (5 * k) % (h // 2), w // 2 + (7 * k) % (w // 2), h // 2 + (5 * k) % (h // 2)),
                 fill=(255, (17 * k) % 256, 40))
    draw.rectangle((w // 3, h // 3, w // 3 + w // 4, h // 3 + h // 4), fill=((29 * k) % 256, 200, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def turn(url: str, second: bool) -> list[dict]:
    first = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}
    return [first, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}] if second \
        else [first]


async def ask(session, base: str, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        data = await r.json()
    wall = time.perf_counter() - t0
    if "usage" not in data:
        raise RuntimeError(f"{base}: {data}")
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"s": round(wall, 4), "prompt_tokens": data["usage"]["prompt_tokens"], "cached_tokens": cached}


async def ttft(bases: dict[str, str], model: str, reps: int, size: tuple[int, int]) -> dict:
    import aiohttp

    runs: dict[str, list[dict]] = {name: [] for name in bases}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for k in range(reps):
            order = list(bases) if k % 2 == 0 else list(bases)[::-1]
            for name in order:
                url = picture(1000 * (k + 1) + len(runs[name]), size)  # a picture neither server has seen
                first = await ask(s, bases[name], model, turn(url, False))
                second = await ask(s, bases[name], model, turn(url, True))
                runs[name].append({"first": first, "second": second})
    out: dict = {"runs": runs}
    for name, rs in runs.items():
        first = statistics.median(r["first"]["s"] for r in rs)
        second = statistics.median(r["second"]["s"] for r in rs)
        out[name] = {"first_turn_s": first, "second_turn_s": second, "second_turn_speedup": round(first / second, 2),
                     "prompt_tokens": rs[0]["first"]["prompt_tokens"]}
    a, b = out["octo"]["first_turn_s"], out["llama-server"]["first_turn_s"]
    out["octo_vs_llama_server_first_turn"] = round(a / b, 3)
    return out


async def stream(session, base: str, model: str, i: int, max_tokens: int, stamps: list[float]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": f"Story {i}: tell me about the harbor."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                data = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in data.get("choices", [])):
                    stamps.append(time.perf_counter())


def gap_stats(streams: list[list[float]], t0: float, t1: float) -> dict:
    """Max and mean gap between consecutive tokens of each stream whose later token came in [t0, t1]."""
    gaps = [b - a for st in streams for a, b in zip(st, st[1:], strict=False) if t0 <= b <= t1]
    return {"max_ms": round(1000 * max(gaps), 1) if gaps else None,
            "mean_ms": round(1000 * statistics.fmean(gaps), 1) if gaps else None, "gaps": len(gaps)}


async def gaps_once(base: str, model: str, n: int, max_tokens: int, url: str) -> dict:
    import aiohttp

    stamps: list[list[float]] = [[] for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.ensure_future(stream(s, base, model, i, max_tokens, stamps[i])) for i in range(n)]
        while min(len(st) for st in stamps) < 24:  # every stream decoding, past its start
            await asyncio.sleep(0.01)
            if all(t.done() for t in tasks):
                raise RuntimeError(f"{base}: the streams ended before the picture came")
        t_image = time.perf_counter()
        image = await ask(s, base, model, turn(url, False))
        t_first = time.perf_counter()
        await asyncio.gather(*tasks)
    before = gap_stats(stamps, t_image - (t_first - t_image) - 1.0, t_image)  # (a window as long, and a second)
    during = gap_stats(stamps, t_image, t_first)
    return {"image_ttft_s": image["s"], "before": before, "during_encode": during,
            "streams_ended_after_image": all(st and st[-1] > t_first for st in stamps)}


async def gaps(bases: dict[str, str], model: str, reps: int, n: int, max_tokens: int, size: tuple[int, int]) -> dict:
    out: dict = {name: [] for name in bases}
    for k in range(reps):
        for name in (list(bases) if k % 2 == 0 else list(bases)[::-1]):
            out[name].append(await gaps_once(bases[name], model, n, max_tokens, picture(5000 + 10 * k, size)))
    for name in bases:
        runs = out[name]
        out[name] = {"runs": runs, "during_max_ms": max(r["during_encode"]["max_ms"] or 0 for r in runs),
                     "during_mean_ms": round(statistics.fmean(r["during_encode"]["mean_ms"] or 0 for r in runs), 1),
                     "before_max_ms": max(r["before"]["max_ms"] or 0 for r in runs),
                     "before_mean_ms": round(statistics.fmean(r["before"]["mean_ms"] or 0 for r in runs), 1)}
    return out


async def warm_up(bases: dict[str, str], model: str, slots: int, size: tuple[int, int]) -> None:
    """Every slot of each server once (a picture each, together): llama-server gives a new prompt the least recently
    used slot, whose first use builds its graphs; not what a round should measure."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        for base in bases.values():
            await asyncio.gather(*(ask(s, base, model, turn(picture(90_000 + i, size), False)) for i in range(slots)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vision-bench", help="a synthetic vision model (octo.synth.vision.SHAPES)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=600)
    ap.add_argument("--size", type=int, nargs=2, default=[448, 336], metavar=("W", "H"), help="the pictures' size")
    ap.add_argument("--skip", nargs="*", default=[], choices=["ttft", "gaps"])
    ap.add_argument("--octo-option", nargs="*", default=[], metavar="KEY=VALUE", help="more -o options for octo")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from octo.synth.vision import build_vision_gguf, gguf_paths

    build_vision_gguf(args.model)
    model, mmproj = gguf_paths(args.model)
    binary = llama_server(log=lambda m: print(m, file=sys.stderr), source="engine")
    slots = args.streams + 1
    p1, p2 = free_port(), free_port()
    octo = [sys.executable, "-m", "octo.cli", "serve", str(model), "--port", str(p1), "--engine", "llamacpp",
            "--max-batch", str(max(8, slots)), "-o", f"n_threads={args.threads}", "-o", "kv_unified=true"]
    for opt in args.octo_option:
        octo += ["-o", opt]
    cpp = [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port", str(p2),
           "-t", str(args.threads), "-c", str(4096 * slots), "-np", str(slots)]
    size = tuple(args.size)
    report: dict = {"model": args.model, "gguf": str(model), "mmproj": str(mmproj), "llama_server": str(binary),
                    "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                             "load_avg_at_start": os.getloadavg()}}
    with contextlib.ExitStack() as st:
        bases = {"octo": st.enter_context(server(octo, p1, "/health", "octo")),
                 "llama-server": st.enter_context(server(cpp, p2, "/health", "llama-server"))}
        name = model.stem  # (octo serves the file, with the projector beside it, by its name)
        asyncio.run(warm_up(bases, name, slots, size))
        settle()  # the servers' start-up work done, and a quiet host, before the first round
        if "ttft" not in args.skip:
            report["ttft"] = asyncio.run(ttft(bases, name, args.reps, size))
        if "gaps" not in args.skip:
            report["gaps"] = asyncio.run(gaps(bases, name, args.reps, args.streams, args.stream_tokens, size))
    report["host"]["load_avg_at_end"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
