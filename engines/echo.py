"""The echo engine: the standard test engine, served through the real queue, batcher and prefix cache.

Its "model" repeats the last user message (for completions: the prompt), one token per
whitespace-separated word, then ends with its end-of-sequence token (told it may not end yet, ``min_tokens``, it
repeats the message). Its KV for a sequence is that
sequence's token history, so the shared prefix-cache index really saves and restores it. Its
distribution is a point mass, so temperature, top_p, top_k, min_p and seed are honoured trivially;
other sampling parameters are refused by the serving layer.

Options (``-o KEY=VALUE``): ``token_delay_ms`` (sleep per decode step), ``n_ctx`` (default 8192, or
``kv_cells``), ``dim`` (embedding size, default 64), ``kv_cells`` (default 0: none; else one KV pool of that many
cells shared by every sequence, as llama.cpp's, so the scheduler's preemption can be tested with a scripted model),
``think`` (1: its chat template "reasons", so ``<think>...</think>`` in what it echoes is its reasoning).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import threading
import time
from typing import Any

from octo.engine import (
    Embeddings,
    Engine,
    Feed,
    KVHandle,
    ModelInfo,
    Sequence,
    Task,
)
from octo.errors import ConfigError, KVCacheFull
from octo.hookspecs import hookimpl
from octo.options import parse_engine_options

_WORD = re.compile(r"\s*\S+")
EOS = 0
_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_OPTIONS = {"token_delay_ms": float, "n_ctx": int, "dim": int, "kv_cells": int, "think": int}


class EchoEngine(Engine):
    name = "echo"
    tasks = frozenset({Task.CHAT, Task.COMPLETION, Task.EMBEDDINGS})
    formats = frozenset({"any"})
    option_names = frozenset(_OPTIONS)
    sampling_params = frozenset({"temperature", "top_p", "top_k", "min_p", "seed"})
    supports_logprobs = True  # a point mass: the echoed token has logprob 0 and is the only possible one
    supports_min_tokens = True  # Feed.no_eos: past its message it repeats it
    prefill_chunk = 4096
    isolation = "thread"  # pure Python: nothing native to contain
    supports_rollback = True  # its KV is a count, its sampler a position in the reply: both can be set back

    def __init__(self, config=None) -> None:
        super().__init__(config)
        opts = parse_engine_options("echo", _OPTIONS, self.config.options)
        self.delay = opts.get("token_delay_ms", 0.0) / 1000.0
        self.kv_cells = opts.get("kv_cells", 0)
        self.n_ctx = opts.get("n_ctx", self.kv_cells or 8192)
        if self.kv_cells and not 0 < self.n_ctx <= self.kv_cells:
            raise ConfigError(f"n_ctx ({self.n_ctx}) must be between 1 and kv_cells ({self.kv_cells}).", param="n_ctx")
        self._seqs: set[Sequence] = set()  # holding KV, for kv_room
        self.dim = opts.get("dim", 64)
        self.think = bool(opts.get("think", 0))
        self._vocab: dict[str, int] = {"": EOS}
        self._pieces: list[str] = [""]
        self._words: list[str] = [""]  # each piece without its white space (what _reply compares)
        self._bytes: list[bytes] = [b""]
        self._lock = threading.Lock()  # tokenize runs on the event loop, _reply in the engine thread

    @classmethod
    def version(cls) -> str:
        return "1"

    def load(self, artifact: str, name: str) -> ModelInfo:
        self.info = ModelInfo(name=name, n_ctx=self.n_ctx, eos_token_ids=frozenset({EOS}),
                              embedding_dim=self.dim, extra={"token_delay_ms": self.delay * 1000})
        return self.info

    # -- text --------------------------------------------------------------------------------------
    def _id(self, piece: str) -> int:
        tid = self._vocab.get(piece)
        if tid is None:
            with self._lock:
                tid = self._vocab.get(piece)
                if tid is None:
                    tid = len(self._pieces)
                    self._pieces.append(piece)
                    self._words.append(piece.strip())
                    self._bytes.append(piece.encode())
                    self._vocab[piece] = tid
        return tid

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        words = _WORD.findall(text)
        ids = list(map(self._vocab.get, words))  # (every word seen before: no call per word)
        return ids if None not in ids else [self._id(w) for w in words]

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        parts = [f"<|{m['role']}|> {m.get('content') or ''} <|end|>" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "\n".join(parts)

    def chat_template(self) -> str | None:
        # think=1: a "reasoning model" (its answers' <think>...</think> is reasoning; it echoes what it is given)
        return "echo: <|role|> content <|end|>, reasons in <think>...</think>" if self.think else None

    def _reply(self, history: list[int]) -> list[int]:
        words = list(map(self._words.__getitem__, history))
        start = 0
        for i in range(len(words) - 1, -1, -1):
            if words[i] == "<|user|>":
                start = i + 1
                break
        if start == 0 and "<|assistant|>" in words:  # chat without a user turn: nothing to echo
            return []
        reply = []
        for tok, word in zip(history[start:], words[start:], strict=True):
            if word in _MARKERS:
                break
            reply.append(tok)
        if reply:
            reply[0] = self._id(self._pieces[reply[0]].lstrip())
        return reply

    # -- steps ---------------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        seq.slot = {"reply": None, "emitted": 0}
        self._seqs.add(seq)

    def kv_room(self) -> int | None:
        return self.kv_cells - sum(s.n_cached for s in self._seqs) if self.kv_cells else None

    def kv_drop(self, seq: Sequence) -> None:
        seq.n_cached = 0

    def step(self, feeds: list[Feed]) -> list[int | None]:
        if self.kv_cells and sum(len(f.tokens) for f in feeds) > self.kv_room():
            raise KVCacheFull(f"echo's KV pool is full ({self.kv_cells} cells)")
        if self.delay:
            time.sleep(self.delay)
        out: list[int | None] = []
        for feed in feeds:
            seq, slot = feed.seq, feed.seq.slot
            slot["undo"] = (seq.n_cached, slot["emitted"])  # what kv_rollback puts back
            seq.n_cached += len(feed.tokens)
            if not feed.sample:
                out.append(None)
                continue
            if slot["reply"] is None:
                slot["reply"] = self._reply(seq.tokens[: seq.n_cached])
            reply, k = slot["reply"], slot["emitted"]
            slot["emitted"] = k + 1
            tok = reply[k] if k < len(reply) else EOS
            if tok == EOS and feed.no_eos:  # min_tokens: it may not end yet, so it says its message again
                tok = (reply[k % len(reply)] if k % len(reply) else self._id(" " + self._pieces[reply[0]])) \
                    if reply else self._id("...")
            if feed.logprobs >= 0:
                feed.logprob = (0.0, [(tok, 0.0)][:feed.logprobs])
            out.append(tok)
        return out

    def kv_rollback(self, seq: Sequence, n_tokens: int) -> None:
        slot = seq.slot
        undo = slot.get("undo")
        if undo is not None and undo[0] >= n_tokens:  # the failed step got to this sequence: its sample goes too
            slot["emitted"] = undo[1]
        seq.n_cached = n_tokens

    def remove_sequence(self, seq: Sequence) -> None:
        seq.slot = None
        self._seqs.discard(seq)

    def kv_save(self, seq: Sequence) -> KVHandle:
        tokens = tuple(seq.tokens[: seq.n_cached])
        return KVHandle(tokens=tokens, nbytes=8 * len(tokens) + 64, data=tokens)

    def kv_export(self, handle: KVHandle) -> bytes | None:
        return struct.pack(f"<{len(handle.data)}i", *handle.data)

    def kv_import(self, tokens: tuple[int, ...], data: bytes) -> KVHandle | None:
        if len(data) != 4 * len(tokens) or struct.unpack(f"<{len(tokens)}i", data) != tuple(tokens):
            return None
        return KVHandle(tokens=tuple(tokens), nbytes=8 * len(tokens) + 64, data=tuple(tokens))

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        if tuple(seq.tokens[:n_tokens]) != handle.data[:n_tokens]:
            raise ValueError("cached prefix does not match the sequence")
        seq.n_cached = n_tokens

    # -- embeddings ----------------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Embeddings:
        vectors, n_tokens = [], 0
        for text in texts:
            n_tokens += len(_WORD.findall(text))
            digest = b""
            counter = 0
            while len(digest) < 4 * self.dim:
                digest += hashlib.sha256(f"{counter}:{text}".encode()).digest()
                counter += 1
            raw = [v / 2**31 - 1.0 for v in struct.unpack(f"<{self.dim}I", digest[: 4 * self.dim])]
            norm = math.sqrt(sum(v * v for v in raw)) or 1.0
            vectors.append([v / norm for v in raw])
        return Embeddings(vectors, n_tokens)


@hookimpl
def register_engines(register):
    register(EchoEngine)
