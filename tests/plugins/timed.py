"""Engines of known speed for the start-up selection tests (loaded with ``--plugins-dir tests/plugins``).

``fastone`` and ``slowone`` behave like echo (they repeat the last user message) and claim the ``timed`` format,
which no real engine reads: a catalog entry with ``none://`` artifacts for both makes them the only candidates.
Each step burns CPU time in the calling thread (``time.thread_time``, so a busy neighbour on the cores slows it
down exactly as it slows a real engine): ``per_step_ms + per_token_ms`` for every token fed, batched tokens
costing a quarter, and, like a real engine, a cold start: the first step of each size it has not run yet
(llama.cpp reserving buffers for a new batch size, a runtime choosing kernels) and the first step after a
thread-count change cost ``cold_ms`` more. ``slowone`` is exactly ``SLOW_FACTOR`` times slower than ``fastone``.

Options: ``-o timed_mark=PATH``: each engine touches ``PATH.NAME`` on its first step (tests wait for it); with
``-o timed_hold=NAME`` as well, that engine's first step then waits (at most 30 s) until ``PATH.NAME.go`` exists
(a test that starts a busy neighbour there lets the step go on once the neighbour is computing).
"""

from __future__ import annotations

import time
from pathlib import Path

from octo.engines.echo import EchoEngine

from octo.engine import Task
from octo.hookspecs import hookimpl

SLOW_FACTOR = 2.0


def burn(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(200):
            x += i * i


class _Timed(EchoEngine):
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    formats = frozenset({"timed"})
    isolation = "process"
    per_step_ms = 0.4
    per_token_ms = 0.6
    cold_ms = 60.0

    def __init__(self, config=None) -> None:
        options = dict((config.options if config else {}) or {})
        self.mark = options.pop("timed_mark", None)
        self.hold = options.pop("timed_hold", None) == self.name
        if config is not None:
            config.options = options
        super().__init__(config)
        self.seen: set[int] = set()
        self.threads = 2
        self.cold_next = False

    @classmethod
    def version(cls) -> str:
        return "1"

    def thread_counts(self) -> list[int]:
        return [2, 1]

    def set_threads(self, n: int) -> None:
        self.cold_next = n != self.threads
        self.threads = n

    def step(self, feeds):
        if self.mark and not self.seen:
            Path(f"{self.mark}.{self.name}").touch()
            deadline = time.monotonic() + 30
            while self.hold and not Path(f"{self.mark}.{self.name}.go").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        n = sum(len(f.tokens) for f in feeds)
        cost = self.per_step_ms + self.per_token_ms * (n if len(feeds) == 1 else 1 + 0.25 * (n - 1))
        if n not in self.seen or self.cold_next:
            cost += self.cold_ms
            self.seen.add(n)
            self.cold_next = False
        burn(cost / 1000.0)
        return super().step(feeds)


class FastOne(_Timed):
    name = "fastone"


class SlowOne(_Timed):
    name = "slowone"
    per_step_ms = _Timed.per_step_ms * SLOW_FACTOR
    per_token_ms = _Timed.per_token_ms * SLOW_FACTOR


@hookimpl
def register_engines(register):
    register(FastOne)
    register(SlowOne)
