"""The llama.cpp engine's KV cells: the shared pool's bookkeeping, preemption (``kv_room``/``kv_drop``/swap),
in-flight prefix sharing (``kv_share``) and the prefix cache (cells of cache sequence ids, RAM snapshots beyond).
A mixin of :class:`.engine.LlamaCppEngine`, which owns the state it uses (``ctx``, ``mem``, ``book``, ``active``,
``cache_ids``, ``_entries``, ``adapters``)."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from octo.engine import KVHandle, Sequence, common_prefix

from .native import LogTap
from .sampling import SamplerChain

log = logging.getLogger("octo.engines.llamacpp")
STATE_MAGIC = (0xAF143CD8).to_bytes(4, "little")  # llama.cpp's sequence-state io_magic (llama-context.cpp)


@dataclass
class Slot:
    seq_id: int
    chain: Any  # its .sampling.SamplerChain


class KVCells:
    # -- KV cells ----------------------------------------------------------------------------------
    def _shareable(self, tokens: list[int], adapter: str | None = None) -> int:
        """The longest prefix of ``tokens`` already in the pool's cells (a running sequence's or a cached entry's)."""
        if self.adapters is not None:  # KV computed with another adapter is never shared: same-adapter runners only
            held = [s.tokens[:s.n_cached] for s in self.active.values() if s.sampling.adapter == adapter]
        else:
            held = [*(s.tokens[:s.n_cached] for s in self.active.values()), *(h.tokens for h in self._entries.values())]
        return max((common_prefix(list(h), tokens) for h in held), default=0)

    def _seq_rm(self, seq_id: int, keep: int) -> bool:
        """Drop ``seq_id``'s positions from ``keep`` on (0: all), in llama.cpp and in the cell book."""
        ok = self._L.llama_memory_seq_rm(self.mem, seq_id, keep, -1)
        if not ok:  # a partial removal the memory cannot do: drop it all
            self._L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.book.truncate(seq_id, keep if ok else 0)
        return bool(ok)

    def _seq_cp(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) joins the cells of ``src``'s first ``n`` positions: no data is copied."""
        self._L.llama_memory_seq_cp(self.mem, src, dst, 0, n)
        self.book.copy(src, dst, n)

    def kv_stats(self) -> dict[str, Any] | None:
        if self.is_embedding or not self.ctx:
            return None
        adapt = self.adapt
        return {"layout": "unified" if self.kv_unified else "streams", "cells": self.kv_cells,
                "adaptive": adapt is not None, "stream_cells": adapt.cells if adapt is not None else None,
                "layout_switches": adapt.switches if adapt is not None else 0,
                "forced_switches": adapt.forced if adapt is not None else 0,
                "compaction_passes": self.compactions, "entries_moved_to_ram": self.demoted}

    # -- KV pressure -------------------------------------------------------------------------------
    def kv_room(self) -> int | None:
        if not self.kv_unified:  # separate streams: every sequence owns n_ctx cells
            return None
        return self.kv_cells - self.book.used()

    def kv_drop(self, seq: Sequence) -> None:
        self._seq_rm(seq.slot.seq_id, 0)
        seq.n_cached = 0

    def kv_swap_out(self, seq: Sequence) -> KVHandle | None:
        return self._snapshot(seq)

    def kv_share(self, src: Sequence, dst: Sequence, n_tokens: int) -> None:
        n = min(n_tokens, src.n_cached, len(dst.tokens) - 1)
        if not self.kv_unified:  # across streams llama.cpp would copy whole buffers: a snapshot copies less
            super().kv_share(src, dst, n)
            return
        if n > 0:
            self._seq_cp(src.slot.seq_id, dst.slot.seq_id, n)
            dst.n_cached = n
            if self.adapt is not None:
                self.adapt.reused(n)

    # -- compaction ----------------------------------------------------------------------------------
    # llama.cpp puts a step's new cells in the pool's first free cells, so sequences that decode together interleave:
    # after 144 steps of 16 sequences each one's cells are 144 runs of one cell, and ggml's CPU flash attention, which
    # walks every cell in use for each decode row and skips the masked ones one by one, pays for the short runs
    # (branch mispredictions). So once a sequence's cells form COMPACT_RUNS runs, a pass rewrites every sequence
    # with half as many as one run each: their cells are copied out (``llama_state_seq`` snapshots, into one scratch
    # buffer) and back into the cells they free together, which llama.cpp fills in order. A sequence that shares
    # cells (a prefix) is left alone: a copy would unshare them. Measured in lockstep against the same pool without it
    # (bench/compact.py, bench/results/compact-session35.json): +0.1% decode tok/s at 8 short streams, +0.8% at 16;
    # most of the gap to per-sequence streams (0.98x / 0.95x) is the walk over other sequences' cells, which no
    # placement removes.
    COMPACT_RUNS = 8

    def _reset_compaction(self, on: bool) -> None:
        self.compact = on
        self.compactions = 0
        self._runs: dict[int, int] = {}  # sequence id -> runs of cells written since its cells were last compacted
        self._solo = -1  # the sequence of the last step when it ran alone (its next cells continue the same run)
        self._scratch = (ctypes.c_uint8 * 0)()  # compaction's copies, kept between passes

    def _count_runs(self, feeds: list[Any]) -> None:
        runs = self._runs
        if len(feeds) == 1:
            sid = feeds[0].seq.slot.seq_id
            if sid != self._solo:
                runs[sid] = runs.get(sid, 0) + 1
            self._solo = sid
            return
        self._solo = -1
        for f in feeds:
            sid = f.seq.slot.seq_id
            runs[sid] = runs.get(sid, 0) + 1

    def _compact_scattered(self) -> None:
        runs, due = self._runs, self.COMPACT_RUNS
        if not any(r >= due for r in runs.values()):
            return
        self._compact([s for sid, s in sorted(self.active.items())
                       if runs.get(sid, 0) >= max(2, due // 2) and s.n_cached > 1])

    def _compact(self, seqs: list[Sequence]) -> None:
        """Rewrite the cells of each sequence that shares none of them as one run. All the copies are taken (into one
        scratch buffer, kept between passes) before any cell is freed; one fails to come back only if llama.cpp
        refuses cells it has just freed."""
        from octo.errors import EngineError

        L = self._L
        plan = []
        total = 0
        for seq in seqs:
            sid = seq.slot.seq_id
            self._runs[sid] = 1
            if self.book.shared_prefix(sid):  # shared cells stay where they are (a copy would unshare them)
                continue
            size = L.llama_state_seq_get_size(self.ctx, sid)
            plan.append((seq, sid, total, size))
            total += size
        if not plan:
            return
        if len(self._scratch) < total:
            self._scratch = (ctypes.c_uint8 * (total + total // 4))()
        base = ctypes.addressof(self._scratch)
        ptr = ctypes.POINTER(ctypes.c_uint8)
        taken = []
        for seq, sid, off, size in plan:
            if L.llama_state_seq_get_data(self.ctx, ctypes.cast(base + off, ptr), size, sid) == size:
                taken.append((seq, sid, off, size))
        for _, sid, _, _ in taken:
            self._seq_rm(sid, 0)
        for seq, sid, off, size in taken:
            if L.llama_state_seq_set_data(self.ctx, ctypes.cast(base + off, ptr), size, sid) != size:
                raise EngineError(f"llama.cpp could not put back the {seq.n_cached} cells of sequence {seq.id} it "
                                  f"had just freed (KV compaction): {LogTap.tail()}")
            self.book.append(sid, seq.n_cached)
        self.compactions += bool(taken)

    # -- prefix cache ------------------------------------------------------------------------------
    # Idle cached cells cost attention: every decode row of a unified pool scans all cells up to the last one in use
    # (bench/attention.py: 4 sequences of 2,000 tokens decode 15% slower beside 4 idle cached prefixes). So cells of
    # entries that no running sequence shares are moved to RAM snapshots (copied back on a hit) once they exceed
    # IDLE_SHARE of the cells running sequences use. There is no floor: a short stream beside 512 idle cells decoded
    # 3% slower than with them moved out (a snapshot of a short entry costs well under a millisecond, once).
    IDLE_SHARE = 0.1

    def kv_save(self, seq: Sequence) -> KVHandle | None:
        slot: Slot | None = seq.slot
        if slot is None or seq.n_cached <= 0 or self.is_embedding:
            return None
        if not self.cache_ids:
            return self._snapshot(seq)
        cid = self.cache_ids.pop()
        self._seq_cp(slot.seq_id, cid, seq.n_cached)
        n = seq.n_cached
        handle = KVHandle(tokens=tuple(seq.tokens[:n]), nbytes=n * self.cell_bytes, data=cid, cells=n)
        self._entries[cid] = handle
        return handle

    def _demote_idle(self, bound: int | None = None) -> None:
        """Move the oldest cache entries whose cells no running sequence shares to RAM, down to the idle bound (or
        ``bound`` idle cells)."""
        if not self._entries:
            return
        live = self.book.blocks(s.slot.seq_id for s in self.active.values())
        idle = {cid: self.book.cells_outside(cid, live) for cid in self._entries}
        total = sum(idle.values())
        if bound is None:
            bound = int(self.IDLE_SHARE * (self.book.used() - total))
        for cid in list(self._entries):
            if total <= bound:
                break
            if not idle[cid]:
                continue
            handle = self._entries.pop(cid)
            snap = self._snapshot_id(cid, len(handle.tokens))
            self._seq_rm(cid, 0)
            self.cache_ids.append(cid)
            handle.data, handle.cells = (snap.data if snap is not None else None), 0  # nbytes: as the index counted
            total -= idle[cid]
            self.demoted += 1

    def _snapshot(self, seq: Sequence) -> KVHandle | None:
        slot: Slot | None = seq.slot
        if slot is None or seq.n_cached <= 0 or self.is_embedding:
            return None
        snap = self._snapshot_id(slot.seq_id, seq.n_cached)
        if snap is not None:
            snap.tokens = tuple(seq.tokens[: seq.n_cached])
        return snap

    def _snapshot_id(self, seq_id: int, n: int) -> KVHandle | None:
        L = self._L
        size = L.llama_state_seq_get_size(self.ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self.ctx, buf, size, seq_id)
        if written == 0:
            return None
        return KVHandle(tokens=(), nbytes=written, data=(buf, written))

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        """Give ``seq`` the first ``n_tokens`` of ``handle`` (at least one prompt token is always left to feed, so the
        next step has logits to sample from). On failure ``n_cached`` stays 0."""
        slot: Slot = seq.slot
        n_tokens = min(n_tokens, len(handle.tokens), len(seq.tokens) - 1)
        if n_tokens <= 0:
            return
        if isinstance(handle.data, int):  # cells of a cache sequence: join them
            self._seq_cp(handle.data, slot.seq_id, n_tokens)
            seq.n_cached = n_tokens
            if self.adapt is not None:
                self.adapt.reused(n_tokens)
            return
        if handle.data is None:  # an entry whose RAM copy failed: a miss
            return
        buf, size = handle.data
        if not self._set_state(buf, size, slot.seq_id):
            log.warning("prefix cache: restoring %d tokens failed (KV pool full?); recomputing", n_tokens)
            self._seq_rm(slot.seq_id, 0)
            return
        self.book.append(slot.seq_id, len(handle.tokens))
        if not self._seq_rm(slot.seq_id, n_tokens):
            return
        seq.n_cached = n_tokens
        if self.adapt is not None:
            self.adapt.reused(n_tokens)

    def _set_state(self, buf: Any, size: int, seq_id: int) -> bool:
        """``llama_state_seq_set_data`` of a snapshot taken in either KV layout (:func:`restream`); all of it must be
        read."""
        n_stream = 1 if self.kv_unified else self._L.llama_n_seq_max(self.ctx)
        data = restream(buf, size, n_stream) if self.plain_kv else None
        if data is not None:
            buf, size = data
        return self._L.llama_state_seq_set_data(self.ctx, buf, size, seq_id) == size

    def kv_rollback(self, seq: Sequence, n_tokens: int) -> None:
        """Undo a step that raised (octo.scheduler.step_isolation): its positions from ``n_tokens`` on leave the KV
        (``llama_memory_seq_rm``, which only drops this sequence from cells it shares). A sampler chain that may have
        drawn in that step and keeps state (penalties' history, a random draw) is rebuilt from the sequence's tokens:
        penalties come back exactly, a random draw restarts from its seed; a plain greedy pick keeps no state."""
        slot: Slot | None = seq.slot
        if slot is None:
            seq.n_cached = 0
            return
        advanced = seq.n_cached > n_tokens  # the step got to this sequence (its n_cached moves before it samples)
        seq.n_cached = n_tokens if self._seq_rm(slot.seq_id, n_tokens) else 0
        if advanced and slot.chain is not None and slot.chain.argmax is None:
            old, slot.chain = slot.chain, SamplerChain(self.n_vocab, seq.sampling, self.penalty_last_n, seq.tokens)
            old.close()

    def kv_free(self, handle: KVHandle) -> None:
        if isinstance(handle.data, int):  # the cells stay while a running sequence shares them
            self._entries.pop(handle.data, None)
            self._seq_rm(handle.data, 0)
            self.cache_ids.append(handle.data)
        handle.data = None  # a snapshot's ctypes buffer is released with the last reference

    # -- disk tier (octo.scheduler.disk_cache) -----------------------------------------------------------------
    def kv_export(self, handle: KVHandle) -> bytes | None:
        """The llama.cpp sequence state of a cached entry (``llama_state_seq_get_data``): cells or a RAM snapshot."""
        data = handle.data
        if isinstance(data, int):
            snap = self._snapshot_id(data, len(handle.tokens))
            data = snap.data if snap is not None else None
        if data is None:
            return None
        buf, size = data
        return ctypes.string_at(buf, size)

    def kv_import(self, tokens: tuple[int, ...], data: bytes) -> KVHandle | None:
        """A RAM snapshot from exported bytes; llama.cpp checks them when ``kv_restore`` sets them (a refusal is a
        miss there)."""
        if not tokens or not data or self.is_embedding:
            return None
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return KVHandle(tokens=tuple(tokens), nbytes=len(data), data=(buf, len(data)))


def restream(buf: Any, size: int, n_stream: int) -> tuple[Any, int] | None:
    """A sequence's KV snapshot rewritten for a context of ``n_stream`` KV streams (1: the unified pool), or None
    when it needs no change or does not have the expected shape. llama.cpp writes a sequence state as a magic and the
    sequence id (``STATE_MAGIC``, two u32), then a plain KV cache's state: the stream count (u32), then per stream its
    cell count (u32) and, when not 0, its cells. A sequence has cells in one stream only, which llama.cpp reads into
    the sequence's own stream wherever it stands, and it refuses a stream count other than its own ("n_stream
    mismatch"). So the conversion keeps that one block and writes the counts around it; the caller checks that
    llama.cpp read all of it. Only the header is read unless a conversion is needed (a restore in the same layout,
    the common case, copies nothing)."""
    if size < 8:
        return None
    base = ctypes.addressof(buf)
    head = 8 if ctypes.string_at(base, 4) == STATE_MAGIC else 0
    if size < head + 8:
        return None
    have = int.from_bytes(ctypes.string_at(base + head, 4), "little")
    if have == n_stream or have < 1 or size < head + 4 * (have + 1):
        return None
    raw = ctypes.string_at(base, size)
    counts = head + 4
    first = next((k for k in range(have) if raw[counts + 4 * k:counts + 4 * k + 4] != bytes(4)), None)
    if first is None:
        return None
    tail = 4 * (have - 1 - first)
    if raw[size - tail:] != bytes(tail):
        return None
    out = raw[:head] + n_stream.to_bytes(4, "little") + raw[counts + 4 * first:size - tail] + bytes(4 * (n_stream - 1))
    return (ctypes.c_uint8 * len(out)).from_buffer_copy(out), len(out)
