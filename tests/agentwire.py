"""What a coding agent's run sends and receives, for the Codex and Claude Code tests on a real model.

:func:`tap` is a proxy between an agent and ``octo serve`` that passes every answer through as it arrives (a stream
stays a stream: the agent's own idle timers see exactly octo's bytes) and records each request's path and body, the
answer's status, and the arrival time and type of each server-sent event.

:func:`agent_model` is a synthetic GGUF (random weights) whose end-of-turn token ``<|im_end|>`` has the embedding row
of the token the model writes most often (embeddings are tied, so that row is also its output row): the model then
ends its answers after a few tokens, as a trained one does, instead of writing to the end of its context. Its prefill
is the same work as the unpatched model's. By default the ``demo`` shape (llama.cpp prefills an agent's prompt in
about a minute on 2 cores); ``OCTO_AGENT_TEST_MODEL=qwen2.5-0.5b`` takes the Qwen2.5-0.5B shape at Q4_K_M instead,
the model of bench/agent_prefill.py, whose prefill of the same prompts takes 5-30 minutes on 2 cores."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

QUANTS = {"demo": "f16", "qwen2.5-0.5b": "q4_k_m"}  # as octo serves demo; the bench's 0.5B


class _Tap(http.server.BaseHTTPRequestHandler):
    upstream = ""
    seen: list[dict] = []
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self, method: str) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
        rec: dict = {"method": method, "path": self.path, "t0": time.monotonic(), "events": [], "answer": b""}
        try:
            rec["body"] = json.loads(raw) if raw else None
        except ValueError:
            rec["body"] = None
        self.seen.append(rec)
        up = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=3600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        conn.request(method, self.path, body=raw or None, headers=headers)
        r = conn.getresponse()
        rec["status"] = r.status
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("connection", "close")  # the body ends with the connection: no framing to rewrite
        self.end_headers()
        pending = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            now = time.monotonic()
            self.wfile.write(chunk)
            self.wfile.flush()
            rec["answer"] += chunk
            pending += chunk
            while b"\n\n" in pending:
                block, pending = pending.split(b"\n\n", 1)
                rec["events"].append((now - rec["t0"], _event_type(block)))
        rec["t_end"] = time.monotonic() - rec["t0"]
        conn.close()
        self.close_connection = True

    def do_POST(self):
        self._forward("POST")

    def do_GET(self):
        self._forward("GET")


def _event_type(block: bytes) -> str:
    """An SSE event's name (its ``event:`` line, else its data's ``type``); ``:`` for a comment."""
    name = None
    for line in block.decode(errors="replace").splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:") and name is None:
            try:
                name = json.loads(line[5:]).get("type")
            except (ValueError, AttributeError):
                name = "data"
        elif line.startswith(":") and name is None:
            name = ":"
    return name or "?"


@contextlib.contextmanager
def tap(upstream: str):
    """A proxy to ``upstream`` on a free loopback port: yields its base URL and the list of recorded requests."""
    handler = type("Tap", (_Tap,), {"upstream": upstream, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()


# A random model's answer ends when its end-of-turn token comes up: mostly after a few tokens, now and then after
# thousands. The agent then goes on (its next turn, or a summary) with that answer in its prompt: the context is
# doubled, so that such a turn fits instead of ending the run with a 400 (the test is about the first turn's prefill).
SERVE_CONTEXT = ("-o", "n_ctx=65536")


def no_repeats(posts: list[dict]) -> list[tuple]:
    """The requests an agent sent, as (path, status, stream), after checking that none repeats an earlier one: a
    reconnect sends the same body again, Claude Code's watchdog the same with ``stream`` false."""
    bodies = []
    for r in posts:
        body = {k: v for k, v in (r["body"] or {}).items() if k != "stream"}
        assert body not in bodies, f"{r['path']} sent again (stream {r['body'].get('stream')})"
        bodies.append(body)
    return [(r["path"].split("?")[0], r["status"], (r["body"] or {}).get("stream")) for r in posts]


def first_output(rec: dict, before: tuple[str, ...]) -> float | None:
    """Seconds from a request to the first event of its answer whose type is not one of ``before`` (the events a
    stream opens with and its keep-alives)."""
    return next((t for t, kind in rec["events"] if kind not in before), None)


def gaps_before(rec: dict, until: float) -> list[float]:
    """The gaps between the events of an answer (from the request) up to ``until`` seconds."""
    times = [0.0] + [t for t, _ in rec["events"] if t <= until] + [until]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def agent_model() -> Path:
    """The model the agents' long-prompt tests serve (``OCTO_AGENT_TEST_MODEL``, default ``demo``)."""
    shape = os.environ.get("OCTO_AGENT_TEST_MODEL", "demo")
    if shape not in QUANTS:
        raise ValueError(f"OCTO_AGENT_TEST_MODEL={shape!r}: one of {', '.join(QUANTS)}")
    return ending_gguf(shape)


def ending_gguf(shape: str) -> Path:
    """The synthetic GGUF of ``shape`` whose ``<|im_end|>`` row is its most written token's (built once, cached
    beside it)."""
    from octo.atomic import build_file
    from octo.synth.gguf import build_gguf

    base = build_gguf(shape, ftype=QUANTS[shape])
    out = base.with_name(base.stem + "-ends.gguf")
    if out.exists():
        return out

    def write(tmp: Path) -> None:
        import gguf

        likeliest, eos = _likeliest_token(base)
        reader = gguf.GGUFReader(str(base))
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        row = int(embd.n_bytes) // embd.data.shape[0]  # bytes per token's row, whatever the tensor's type
        offset = embd.data_offset
        del reader
        tmp.write_bytes(base.read_bytes())
        with open(tmp, "r+b") as f:
            f.seek(offset + likeliest * row)
            data = f.read(row)
            f.seek(offset + eos * row)
            f.write(data)

    return build_file(out, write)


def _likeliest_token(path: Path) -> tuple[int, int]:
    """(the token with the highest mean probability over an agent-like prompt's positions, ``<|im_end|>``'s id)."""
    import llama_cpp
    import numpy as np

    from octo.synth.tokenizer import special_ids

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    text = ("<|im_start|>system\nYou are a coding agent. Tools: read_file, write_file, shell.<|im_end|>\n"
            "<|im_start|>user\nFix the failing test in the scheduler and explain the change.<|im_end|>\n"
            "<|im_start|>assistant\n")
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(tokens)
    scores = np.array(llm.scores[: llm.n_tokens])
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    eos = special_ids()["<|im_end|>"]
    mean = p.mean(axis=0)
    mean[eos] = 0.0
    return int(mean.argmax()), eos
