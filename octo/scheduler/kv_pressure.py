"""KV pressure, a part of the engine loop (:class:`octo.scheduler.engine_loop.EngineLoop`; engine thread).

Engines whose sequences share one bounded KV pool report its free cells with ``Engine.kv_room``: a new sequence is
admitted only when its prompt fits beside what the running ones still have to feed; before each step, the youngest
sequences are preempted until every decoding sequence has its cell. A preempted sequence keeps its tokens, text,
stream and engine slot; its KV is saved to host memory (``preempt="swap"``, through ``Engine.kv_swap_out``) or
dropped (``"recompute"``), and it resumes, oldest first, when the pool has room for all its tokens.

:class:`KVPressure` owns the queue of preempted sequences; it is given the engine, the loop's list of running
sequences, the prefix cache (whose entries give their pool cells back first), the prefix-sharing part (a preempted
lead releases its followers) and the engine's ``kv_free``.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

from octo.engine import KVHandle
from octo.errors import EngineError
from octo.scheduler.jobs import Ticket
from octo.scheduler.prefix_cache import PrefixCache
from octo.scheduler.sharing import PrefixSharing

log = logging.getLogger("octo.scheduler.admission")


class KVPressure:
    """Admission room, preemption and resumption over the engine's shared KV pool. ``mode``: ``"swap"`` (a preempted
    sequence's KV waits in host memory) or ``"recompute"``."""

    def __init__(self, engine: Any, active: list[Ticket], *, cache: PrefixCache | None, sharing: PrefixSharing,
                 mode: str, free_kv: Callable[[Any], None]) -> None:
        self.engine = engine
        self.active = active
        self.cache = cache
        self.sharing = sharing
        self.mode = mode
        self.free_kv = free_kv
        self.preempted: list[Ticket] = []  # gave their KV back under pressure; resume oldest first
        self.total_preemptions = 0
        self.total_resumed = 0

    def room(self) -> int | None:
        """KV cells free for new work: the engine's free cells less what the active sequences still have to feed
        (the rest of their prompts, and the next decode token); None when the engine's KV is not shared."""
        room = self.engine.kv_room()
        if room is None:
            return None
        return room - sum(len(t.seq.tokens) - t.seq.n_cached for t in self.active)

    def fit(self, room: int) -> int:
        """Preempt the youngest sequences until every decoding sequence has a cell for this step and something can
        move; return the cells left for prompt chunks."""
        while True:
            decoding = sum(1 for t in self.active if len(t.seq.tokens) - t.seq.n_cached == 1)
            spare = room - decoding
            if spare < 0 or not (decoding or spare > 0):
                room += self.reclaim(max(1, -spare))  # cached prefixes give their cells back before anyone waits
                spare = room - decoding
            if len(self.active) <= 1 or (spare >= 0 and (decoding or spare > 0)):
                return max(spare, 0)
            self.preempt_youngest()
            room = self.engine.kv_room()  # shared cells stay with their other users: ask, do not add

    def reclaim(self, cells: int, keep: KVHandle | None = None) -> int:
        """Evict prefix-cache entries that hold cells of the engine's shared pool, least recently used first (never
        ``keep``), until ``cells`` are free again or none is left; returns the cells freed."""
        if self.cache is None or cells <= 0:
            return 0
        before = self.engine.kv_room() or 0
        freed = 0
        while freed < cells and self.cache.evict_pool(keep):
            freed = (self.engine.kv_room() or 0) - before
        return freed

    def cached_cells(self, seq: Any) -> tuple[KVHandle | None, int]:
        """The prefix-cache entry ``seq`` will start from when its cells are in the engine's pool (a restore shares
        them, ``Engine.kv_shares_cells``), and how many of its prompt tokens that gives it: admission counts only
        the rest, and never evicts that entry to make room for it."""
        if self.cache is None or not self.engine.kv_shares_cells:
            return None, 0
        handle, n = self.cache.peek(seq.tokens, len(seq.tokens) - 1, seq.sampling.adapter)
        return (handle, n) if handle is not None and handle.cells else (None, 0)

    def preempt(self, t: Ticket) -> None:
        """``t`` gives its KV back and waits in ``preempted``; its tokens, text and sampler stay as they are."""
        seq = t.seq
        self.active.remove(t)
        self.sharing.release_followers(t)  # before its KV goes
        t.lead = None
        if self.mode == "swap" and seq.n_cached > 0:
            try:
                t.swap = self.engine.kv_swap_out(seq)
            except Exception:  # noqa: BLE001 - it is recomputed instead
                log.exception("KV save for preemption failed; the sequence will be recomputed")
        try:
            self.engine.kv_drop(seq)
        except BaseException:
            self.active.append(t)  # still running: the loop fails it, rather than leave it nowhere
            raise
        seq.n_cached = 0
        t.preemptions += 1
        self.total_preemptions += 1
        bisect.insort(self.preempted, t, key=age_of)

    def preempt_youngest(self) -> None:
        self.preempt(max(self.active, key=age_of))

    def discard(self, t: Ticket) -> None:
        """``t`` leaves (it ended, failed or was cancelled): out of the preempted queue, its swapped KV freed."""
        if t in self.preempted:
            self.preempted.remove(t)
        if t.swap is not None:
            handle, t.swap = t.swap, None
            self.free_kv(handle)

    def resume(self) -> None:
        """Bring preempted sequences back, oldest first, while the pool has room for all their tokens (the loop
        finishes the cancelled ones first)."""
        room = self.room()
        while self.preempted:
            t = self.preempted[0]
            need = len(t.seq.tokens) + 1
            if room is not None and self.active and need > room:
                return
            self.preempted.pop(0)
            bisect.insort(self.active, t, key=age_of)  # the oldest sequences' prompts are fed first
            handle, t.swap = t.swap, None
            if handle is not None:
                try:
                    self.engine.kv_restore(t.seq, handle, len(handle.tokens))
                    check_restored(t.seq, len(handle.tokens))
                except Exception:  # noqa: BLE001 - recompute instead
                    log.exception("KV restore after preemption failed; recomputing")
                    self.engine.kv_drop(t.seq)
                    t.seq.n_cached = 0
                finally:
                    self.free_kv(handle)
            self.total_resumed += 1
            if room is not None:
                room -= need


def check_restored(seq: Any, n: int) -> None:
    """A restore of ``n`` tokens must leave 0..n of them in the sequence's KV (more would skip tokens never fed)."""
    if not 0 <= seq.n_cached <= n:
        raise EngineError(f"kv_restore of {n} tokens left {seq.n_cached} tokens in the sequence's KV")


def check_saved(handle: Any, seq: Any) -> None:
    """A handle ``kv_save`` gave for the prefix cache: for tokens of this sequence (the index serves it to other
    requests by them), with a size the cache can count."""
    if not isinstance(handle, KVHandle):
        raise EngineError(f"kv_save returned {type(handle).__name__}, not a KVHandle or None")
    n = len(handle.tokens)
    if n > seq.n_cached or tuple(handle.tokens) != tuple(seq.tokens[:n]):
        raise EngineError(f"kv_save returned a handle for {n} tokens that are not the sequence's first ones")
    if not isinstance(handle.nbytes, int) or handle.nbytes < 0:
        raise EngineError(f"kv_save returned a handle of {handle.nbytes!r} bytes")


def age_of(t: Ticket) -> int:
    return t.seq.id  # sequence ids grow with submission: the largest is the youngest
