"""``poisoned``: the llama.cpp engine, but a step that holds a sequence whose prompt says POISON raises after its
decode (every sequence's KV written, every sampler drawn), once that sequence has generated ``after`` tokens
(``-o after=N``, default 2). A fault only the engine's ``kv_rollback`` can undo (tests/test_llamacpp_rollback.py).
``-o step_ms=N`` makes every step take N ms more (the tiny test model's steps take well under one: requests meant to
share a step with the poisoned one could end before it came)."""

from __future__ import annotations

import time

from octo.engines.llamacpp import LlamaCppEngine

from octo.hookspecs import hookimpl


class PoisonedEngine(LlamaCppEngine):
    name = "poisoned"
    aliases = ()

    def __init__(self, config=None) -> None:
        self.after = int(config.options.pop("after", "2")) if config is not None else 2
        self.step_s = int(config.options.pop("step_ms", "0")) / 1000 if config is not None else 0.0
        super().__init__(config)
        self.poisoned: dict[int, int] = {}  # sequence id -> its prompt length

    def add_sequence(self, seq) -> None:
        super().add_sequence(seq)
        if b"POISON" in b"".join(self.token_bytes(t) for t in seq.tokens):
            self.poisoned[seq.id] = len(seq.tokens)

    def remove_sequence(self, seq) -> None:
        self.poisoned.pop(seq.id, None)
        super().remove_sequence(seq)

    def step(self, feeds):
        out = super().step(feeds)
        if self.step_s:
            time.sleep(self.step_s)
        if any(len(f.seq.tokens) - self.poisoned.get(f.seq.id, 1 << 30) >= self.after for f in feeds):
            raise RuntimeError("the poisoned engine failed this step")
        return out


@hookimpl
def register_engines(register):
    register(PoisonedEngine)
