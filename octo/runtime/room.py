"""Making room for a model loaded on demand (the registry's part that unloads others): ``--max-loaded``, the memory
guard (octo.runtime.memguard) and which loaded models may go.

- **Who may go**: an idle model (no request in flight) loaded on demand, least recently used first. Never a pinned
  one, and never one named at start (command line, ``--models-file``) unless the operator says so with
  ``--evict-startup-models``: the operator asked for those.
- **When**: memory is made before the load (a model must fit beside the others), but a model over the *count* alone
  (``--max-loaded``) goes only once the new model has loaded, so a load that fails unloads nothing it need not.
- **Waiting**: when every loaded model that could go is busy, the load waits up to ``--queue-timeout`` for one to
  become idle, then is a 503 ``no_room`` naming why.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from octo.errors import Overloaded
from octo.logsafe import quoted
from octo.runtime.memguard import DEFAULT_MAX_LOADED, no_room


class RoomMixin:
    """The room-making methods of :class:`octo.runtime.registry.Registry` (``config``, ``slots``, ``loaded``, ``say``,
    ``_unload`` and ``_freed`` are the registry's)."""

    config: Any
    slots: list[Any]
    say: Any
    _freed: asyncio.Event

    def max_loaded(self) -> int:
        """Models loaded at once (0: no limit): --max-loaded, by default 3 (Ollama's on a CPU host) or the number
        of models named at start if more."""
        if self.config.max_loaded is not None:
            return self.config.max_loaded
        return max(DEFAULT_MAX_LOADED, sum(1 for s in self.slots if s.spec.declared))

    def _may_go(self, slot: Any) -> bool:
        """Whether ``slot`` may be unloaded to make room for another model (when idle)."""
        return not slot.spec.pinned and (not slot.spec.declared or self.config.evict_startup_models)

    def _no_room(self, slot: Any, others: list[Any], count: bool = True) -> tuple[str, bool]:
        return no_room(self.config, self.max_loaded() if count else 0, slot.estimated_bytes, slot.spec.declared,
                       [s.estimated_bytes for s in others])

    async def _make_room(self, slot: Any) -> None:
        """Unload the least recently used idle models that may go until ``slot`` fits in memory; over the model count
        alone, one may go after the load (:meth:`_trim`); wait up to --queue-timeout for a busy one to become idle;
        503 when it cannot fit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout
        try:
            while True:
                others = [s for s in self.loaded() if s is not slot]
                why, possible = self._no_room(slot, others)
                if not why:
                    return
                if not possible:
                    raise Overloaded(f"No room to load '{slot.name}': {why}.", code="no_room",
                                     headers={"Retry-After": "60"})
                idle = sorted((s for s in others if s.inflight == 0 and self._may_go(s)), key=lambda s: s.last_used)
                if idle and not self._no_room(slot, others, count=False)[0]:
                    return  # only the count is over: the least recently used idle model goes once this one loaded
                if idle:
                    self.say(f"octo: unloading '{quoted(idle[0].name, bare=True)}' (least recently used) to make room "
                             f"for '{quoted(slot.name, bare=True)}'")
                    await self._unload(idle[0])
                    continue
                if loop.time() >= deadline or not any(self._may_go(s) for s in others):
                    raise Overloaded(f"No room to load '{slot.name}': {why}, and every loaded model is busy, pinned "
                                     "or named at start; retry later.", code="no_room", headers={"Retry-After": "5"})
                slot.no_room = f"{why}, and every loaded model is busy, pinned or named at start"
                self._freed.clear()
                with contextlib.suppress(TimeoutError):  # a second at most: memory frees up outside octo too
                    await asyncio.wait_for(self._freed.wait(), min(1.0, deadline - loop.time()))
        finally:
            slot.no_room = ""

    async def _trim(self, slot: Any) -> None:
        """``slot`` has loaded: unload the least recently used idle models that may go while more than --max-loaded
        are loaded (one that became busy meanwhile stays: the next load makes room again)."""
        limit = self.max_loaded()
        while limit:
            others = [s for s in self.loaded() if s is not slot]
            idle = sorted((s for s in others if s.inflight == 0 and self._may_go(s)), key=lambda s: s.last_used)
            if len(others) + 1 <= limit or not idle:
                return
            self.say(f"octo: unloading '{quoted(idle[0].name, bare=True)}' (least recently used) to make room for "
                              f"'{quoted(slot.name, bare=True)}'")
            await self._unload(idle[0])
