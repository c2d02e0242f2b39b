"""octo against llama-server on the same vision-language GGUF and projector: correctness, not speed.

    .venv/bin/python bench/vision_parity.py [--max-tokens 16] [--out FILE]

Both servers serve demo-vision's two files (``octo.synth.vision``: the model and its ``mmproj``, written by llama.cpp's
own converter): ``octo serve demo-vision`` (the projector found beside the GGUF) and ``llama-server -m MODEL
--mmproj MMPROJ`` built from the llama.cpp octo's engine runs (``bench/llama_server.py engine``). Each case is one
Chat Completions request (images as base64 PNG data URLs, greedy, ``logprobs``) sent to both: the prompt's token count
(``usage.prompt_tokens``) and the generated tokens (their bytes, from ``logprobs``) must be the same. Prints JSON (and
writes ``--out``); the exit status is 1 when a case differs.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llama_server.py, bench/llamacpp.py

from llama_server import llama_server  # noqa: E402
from llamacpp import free_port, server  # noqa: E402

QUESTION = "What is in this picture?"


def png(color: tuple[int, int, int], size: tuple[int, int] = (80, 60), circle: bool = False) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, color)
    if circle:
        ImageDraw.Draw(img).ellipse((size[0] // 8, size[1] // 8, size[0] // 2, size[1] // 2), fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def cases() -> dict[str, list[dict]]:
    red, blue, drawn = png((220, 30, 30)), png((20, 40, 230)), png((30, 160, 60), (120, 90), circle=True)
    return {
        "image then question": [{"role": "user", "content": [image(red), {"type": "text", "text": QUESTION}]}],
        "question then image": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image(blue)]}],
        "drawing, system prompt": [{"role": "system", "content": "Answer in one word."},
                                   {"role": "user", "content": [image(drawn), {"type": "text", "text": QUESTION}]}],
        "two images": [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image(red),
                                                    {"type": "text", "text": "and"}, image(blue)]}],
        "second turn": [{"role": "user", "content": [image(red), {"type": "text", "text": QUESTION}]},
                        {"role": "assistant", "content": "A red square."},
                        {"role": "user", "content": "And its colour?"}],
    }


def ask(base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "demo-vision", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True}
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return {"prompt_tokens": out["usage"]["prompt_tokens"],
            "tokens": [bytes(t["bytes"]).hex() for t in (choice.get("logprobs") or {}).get("content") or []],
            "text": choice["message"]["content"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from octo.synth.vision import build_vision_gguf, gguf_paths

    build_vision_gguf("demo-vision")
    model, mmproj = gguf_paths("demo-vision")
    binary = llama_server(log=lambda m: print(m, file=sys.stderr), source="engine")
    p1, p2 = free_port(), free_port()
    octo = [sys.executable, "-m", "octo.cli", "serve", "demo-vision", "--port", str(p1),
            "-o", f"n_threads={args.threads}"]
    cpp = [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port", str(p2),
           "-t", str(args.threads), "-c", "4096", "-np", "1", "--no-warmup"]
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as st:
        bases = {"octo": st.enter_context(server(octo, p1, "/health", "octo")),
                 "llama-server": st.enter_context(server(cpp, p2, "/health", "llama-server"))}
        for name, messages in cases().items():
            got = {who: ask(base, messages, args.max_tokens) for who, base in bases.items()}
            o, c = got["octo"], got["llama-server"]
            results[name] = {**got, "same_prompt_tokens": o["prompt_tokens"] == c["prompt_tokens"],
                             "same_tokens": bool(o["tokens"]) and o["tokens"] == c["tokens"]}
    ok = all(r["same_prompt_tokens"] and r["same_tokens"] for r in results.values())
    report = {"model": str(model), "mmproj": str(mmproj), "llama_server": str(binary), "all_same": ok,
              "cases": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
