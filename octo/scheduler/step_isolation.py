"""One raising step costs one request where the engine allows it (:class:`StepIsolation`, a part of
:class:`octo.scheduler.engine_loop.EngineLoop`, given the engine and the loop's guarded step function).

An ``Engine.step`` over several sequences that raises (rather than returning an exception in one feed's place) used
to fail every sequence of the step: one request whose tokens make the backend fail took its batch with it, as
llama-server's does. Engines that can undo a step (``Engine.supports_rollback``: ``kv_rollback`` truncates a
sequence's KV to what it held before, as llama.cpp's ``llama_memory_seq_rm`` does, and puts back its sampler's
count) get a bisection instead: the step is undone, and its feeds run again in two halves, each half that raises is
undone and split again, until the sequence that raises is alone: that request fails with the engine's error, the
others take their outputs from the smaller steps, exactly as if nothing had happened (at temperature 0 the same text;
a sampled sequence keeps its distribution). A step of n sequences with one bad one costs at most about
2·log2(n) extra steps, once.

Engines without rollback (mlx, onnx, plugins that do not declare it) keep the old behaviour: the step's sequences
fail together. So does a step whose rollback fails (the engine could not keep a sequence's KV).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from octo.engine import Feed

log = logging.getLogger("octo.scheduler.admission")


class StepIsolation:
    """``step(feeds)``: the engine loop's ``Engine.step`` as it runs it (watched, in the compute gate's turn, its
    outputs counted), raising what the engine raised."""

    def __init__(self, engine: Any, step: Callable[[list[Feed]], list[Any]]) -> None:
        self.engine = engine
        self.step = step
        self.isolated_steps = 0  # steps that raised and were split until the failing sequence was alone
        self.rollback_failures = 0

    def isolate(self, feeds: list[Feed], starts: list[int], exc: BaseException) -> list[Any] | None:
        """After ``engine.step(feeds)`` raised ``exc``: one output per feed, the sequences that raise alone getting
        their exception in their place; None when the engine cannot undo the step (every sequence then fails)."""
        if len(feeds) < 2 or not getattr(self.engine, "supports_rollback", False):
            return None
        if not self._roll_back(feeds, starts, range(len(feeds))):
            return None
        self.isolated_steps += 1
        out: list[Any] = [None] * len(feeds)
        half = len(feeds) // 2
        groups = [list(range(half)), list(range(half, len(feeds)))]
        alone: list[int] = []
        while groups:
            group = groups.pop(0)
            err = self._rerun(feeds, group, out)
            if err is None:
                continue
            if len(group) == 1 or not self._roll_back(feeds, starts, group):
                for i in group:  # alone, it raises: this one fails (or the engine could not undo this group)
                    out[i] = err
                    alone.append(feeds[i].seq.id)
                continue
            mid = len(group) // 2
            groups[:0] = [group[:mid], group[mid:]]
        log.warning("the step of %d sequences that raised was run again in smaller groups: sequence(s) %s failed, "
                    "%d went on", len(feeds), alone, len(feeds) - len(alone))
        return out

    def _roll_back(self, feeds: list[Feed], starts: list[int], group: Any) -> bool:
        """Undo the failed step for the feeds in ``group``; False when the engine could not."""
        for i in group:
            seq = feeds[i].seq
            try:
                self.engine.kv_rollback(seq, starts[i])
            except Exception:  # noqa: BLE001 - then the step fails as without rollback
                log.exception("kv_rollback of sequence %d failed", seq.id)
                self.rollback_failures += 1
                return False
            if seq.n_cached != starts[i]:
                log.warning("kv_rollback of sequence %d kept %d of its %d tokens", seq.id, seq.n_cached, starts[i])
                self.rollback_failures += 1
                return False
            feeds[i].logprob = feeds[i].prompt_out = None  # outputs of the failed step
        return True

    def _rerun(self, feeds: list[Feed], group: list[int], out: list[Any]) -> BaseException | None:
        """``engine.step`` of the feeds in ``group``, their outputs into ``out``; the exception when it raised."""
        try:
            res = self.step([feeds[i] for i in group])
        except BaseException as exc:  # noqa: BLE001 - the caller splits the group, or fails it when alone
            return exc
        for i, r in zip(group, res, strict=True):
            out[i] = r
        return None
