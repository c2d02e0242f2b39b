"""octo against llama-server on the same vision-language GGUF and projector: correctness, not speed.

    .venv/bin/python bench/vision_parity.py [--model NAME ...] [--max-tokens 16] [--out FILE]

For each synthetic vision model (``octo.synth.vision``; default: ``demo-vision``, a Gemma 3, and ``demo-vision-qwen``,
a Qwen2.5-VL with M-RoPE image positions), both servers serve its two files (the model and its ``mmproj``, written
by llama.cpp's own converter): ``octo serve MODEL --engine llamacpp`` (the projector found beside the GGUF) and
``llama-server -m MODEL --mmproj MMPROJ`` built from the llama.cpp octo's engine runs (``bench/llama_server.py
engine``). Each case is one Chat Completions request (images as base64 PNG data URLs, greedy, ``logprobs``) sent to
both: the prompt's token count (``usage.prompt_tokens``) and the generated tokens (their count and bytes, from
``logprobs``) must be the same. Prints JSON (and writes ``--out``); the exit status is 1 when a case differs.
"""

from __future__ import annotations

import argparse
import base64
import codecs
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


def ask(base: str, messages: list[dict], max_tokens: int, model: str = "demo-vision") -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True}
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": out["usage"]["completion_tokens"],
            "tokens": [bytes(t["bytes"]).hex() for t in (choice.get("logprobs") or {}).get("content") or []],
            "text": choice["message"]["content"]}


def same_tokens(o: dict, c: dict) -> bool:
    """The same generated tokens: as many, with the same bytes. llama-server's logprobs join a token that ends inside
    a UTF-8 character to the next one, and hold such a token back at the end of the answer; octo lists each token."""
    a, b = (b"".join(bytes.fromhex(t) for t in x["tokens"]) for x in (o, c))
    if not o["tokens"] or o["completion_tokens"] != c["completion_tokens"] or not a.startswith(b):
        return False
    tail = a[len(b):]
    if not tail:
        return True
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        dec.decode(tail, final=False)
    except UnicodeDecodeError:
        return False
    return dec.getstate()[0] != b""  # the last token, held back


def compare(name: str, threads: int, max_tokens: int) -> dict:
    """Every case on both servers serving the synthetic model ``name``."""
    from octo.synth.vision import build_vision_gguf, gguf_paths

    build_vision_gguf(name)
    model, mmproj = gguf_paths(name)
    binary = llama_server(log=lambda m: print(m, file=sys.stderr), source="engine")
    p1, p2 = free_port(), free_port()
    octo = [sys.executable, "-m", "octo.cli", "serve", name, "--port", str(p1), "--engine", "llamacpp",
            "-o", f"n_threads={threads}"]
    cpp = [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port", str(p2),
           "-t", str(threads), "-c", "4096", "-np", "1", "--no-warmup"]
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as st:
        bases = {"octo": st.enter_context(server(octo, p1, "/health", "octo")),
                 "llama-server": st.enter_context(server(cpp, p2, "/health", "llama-server"))}
        for case, messages in cases().items():
            got = {who: ask(base, messages, max_tokens, name) for who, base in bases.items()}
            o, c = got["octo"], got["llama-server"]
            results[case] = {**got, "same_prompt_tokens": o["prompt_tokens"] == c["prompt_tokens"],
                             "same_tokens": same_tokens(o, c)}
    ok = all(r["same_prompt_tokens"] and r["same_tokens"] for r in results.values())
    return {"model": str(model), "mmproj": str(mmproj), "llama_server": str(binary), "all_same": ok,
            "cases": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", action="append", help="a synthetic vision model (octo.synth.vision.SHAPES; "
                    "repeatable; default: demo-vision and demo-vision-qwen)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    models = {name: compare(name, args.threads, args.max_tokens)
              for name in args.model or ["demo-vision", "demo-vision-qwen"]}
    ok = all(m["all_same"] for m in models.values())
    text = json.dumps({"all_same": ok, "models": models}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
