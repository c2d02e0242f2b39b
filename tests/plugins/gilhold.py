"""An engine stuck in one C call that holds the GIL (loaded with ``--plugins-dir tests/plugins``).

``gilhold`` behaves like echo (it repeats the last user message) until a sequence whose prompt holds the word
GILHOLD has generated ``after`` tokens (``-o after=N``, default 2). Its step then calls ``sum(range(10**15))``: the
builtin ``sum`` over a ``range`` runs in C and never returns to the bytecode loop, so the GIL is never released (it
would take days). Every thread of the worker stops with it, its heartbeat thread and event loop included, exactly as
with a native engine stuck in a loop that holds the GIL: only the gateway can see it, and only SIGKILL ends it.
"""

from __future__ import annotations

from octo.engines.echo import EchoEngine

from octo.hookspecs import hookimpl


class GilHoldEngine(EchoEngine):
    name = "gilhold"
    isolation = "process"

    def __init__(self, config=None) -> None:
        options = dict((config.options if config else {}) or {})
        self.after = int(options.pop("after", "2"))
        if config is not None:
            config.options = options
        super().__init__(config)

    def add_sequence(self, seq) -> None:
        super().add_sequence(seq)
        seq.slot["hold"] = any(self._pieces[t].strip() == "GILHOLD" for t in seq.tokens)

    def step(self, feeds):
        if any(f.seq.slot.get("hold") and f.seq.slot["emitted"] >= self.after for f in feeds):
            sum(range(10**15))  # one C call holding the GIL
        return super().step(feeds)


@hookimpl
def register_engines(register):
    register(GilHoldEngine)
