"""An engine whose prompts take long to prefill, for the keep-alive tests (loaded with ``--plugins-dir tests/plugins``).

``slowprefill`` behaves like echo (it repeats the last user message) but each prompt token it is fed costs
``prefill_ms`` of its step (default 20), fed ``prefill_chunk`` tokens a step (default 16): a prompt of N words takes
about N * prefill_ms to prefill, in steps short enough that a sequence whose client went away leaves the batch
promptly, as llama.cpp's 256-token chunks do. It runs in an engine worker process, as native engines do.
Options: ``-o prefill_ms=N``, ``-o prefill_chunk=N``, ``-o load_s=N`` (its load takes N seconds).
"""

from __future__ import annotations

import time

from octo.engines.echo import EchoEngine

from octo.engine import Task
from octo.hookspecs import hookimpl

_OWN = {"prefill_ms": float, "prefill_chunk": int, "load_s": float}


class SlowPrefill(EchoEngine):
    name = "slowprefill"
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    isolation = "process"

    def __init__(self, config=None) -> None:
        options = dict((config.options if config else {}) or {})
        own = {k: _OWN[k](options.pop(k)) for k in list(options) if k in _OWN}
        if config is not None:
            config.options = options
        super().__init__(config)
        self.prefill_s = own.get("prefill_ms", 20.0) / 1000.0
        self.prefill_chunk = own.get("prefill_chunk", 16)
        self.load_s = own.get("load_s", 0.0)

    def load(self, artifact, name):
        time.sleep(self.load_s)
        return super().load(artifact, name)

    def step(self, feeds):
        n = sum(len(f.tokens) for f in feeds if len(f.tokens) > 1)  # prompt chunks (decode feeds are one token)
        if n:
            time.sleep(n * self.prefill_s)
        return super().step(feeds)


@hookimpl
def register_engines(register):
    register(SlowPrefill)
