"""The prefix cache in use (engine thread): a starting sequence restores the longest cached prefix of its prompt, from
memory (:class:`octo.scheduler.prefix_cache.PrefixCache`) or from the disk tier
(:class:`octo.scheduler.disk_cache.DiskTier`) when that holds more of it; a sequence leaving the batch offers its KV
to both. :class:`PrefixReuse` is a part of :class:`octo.scheduler.engine_loop.EngineLoop`, given the engine, the two
tiers and the engine's ``kv_free``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from octo.engine import KVHandle, Sequence
from octo.scheduler.disk_cache import DiskTier
from octo.scheduler.kv_pressure import check_restored, check_saved
from octo.scheduler.prefix_cache import PrefixCache

log = logging.getLogger("octo.scheduler.admission")


class PrefixReuse:
    def __init__(self, engine: Any, cache: PrefixCache, disk: DiskTier | None, free_kv: Callable[[Any], None]) -> None:
        self.engine = engine
        self.cache = cache
        self.disk = disk
        self.free_kv = free_kv

    def restore(self, seq: Sequence) -> tuple[int, Exception | None]:
        """Restore the longest cached prefix of ``seq``'s prompt into its KV (just added to the engine): the tokens
        reused, and the error the sequence fails with when a failed restore left it unusable (a failed restore is
        otherwise a miss: the prompt is computed)."""
        cache = self.cache
        handle, n = cache.lookup(seq.tokens, len(seq.tokens) - 1, seq.sampling.adapter)
        fresh = None  # a handle imported from the disk tier: the in-memory cache takes it after the restore
        if self.disk is not None and seq.sampling.adapter is None:  # the disk holds base-model KV only
            handle, n, fresh = self.disk.restore(seq, handle, n)
        if handle is None:
            return 0, None
        cached = 0
        try:
            self.engine.kv_restore(seq, handle, n)
            check_restored(seq, n)
            cached = seq.n_cached
            if seq.n_cached != n:  # the engine reused less than the index offered
                cache.tokens_reused -= n - seq.n_cached
        except Exception:  # noqa: BLE001 - a failed restore is a miss, never an error
            log.exception("KV restore failed; recomputing the prompt")
            cache.restore_failed(n)
            seq.n_cached = 0
            try:
                self.engine.remove_sequence(seq)
                self.engine.add_sequence(seq)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                return 0, exc
        if fresh is not None and seq.n_cached > 0:
            cache.insert(fresh)
        elif fresh is not None:  # the engine refused the disk entry's bytes: not kept
            self.free_kv(fresh)
        return cached, None

    def save(self, seq: Sequence, n_prompt: int) -> None:
        """Offer the KV of ``seq`` (leaving the batch; ``n_prompt`` prompt tokens) to the cache and the disk tier."""
        handle = None
        try:  # whatever the engine does here, the request still gets its result
            handle = self.engine.kv_save(seq)
            if handle is not None:
                check_saved(handle, seq)
                if self.disk is not None and seq.sampling.adapter is None:
                    self.disk.offer(handle, n_prompt)
                self.cache.insert(handle, seq.sampling.adapter)
        except Exception:  # noqa: BLE001
            log.exception("KV save failed")
            if isinstance(handle, KVHandle):  # not kept: the engine gets it back
                self.free_kv(handle)
