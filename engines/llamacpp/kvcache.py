"""The llama.cpp engine's KV cells (:class:`KVCells`, the engine's ``cells`` part): the shared pool's bookkeeping
(:class:`.cells.CellBook`), preemption (``drop``/swap snapshots), in-flight prefix sharing (``share``), compaction of
scattered cells and the prefix cache (cells of cache sequence ids, RAM snapshots beyond).

The part owns its state (the book, the free cache ids, the cached entries, the compaction counters) and reads the
engine's serving context through :class:`CellsHost`: the context is rebuilt when the KV layout changes
(:mod:`.adapt`), so the handles are read where used, never kept; :meth:`KVCells.reset` starts the new context's book."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from octo.engine import KVHandle, Sequence, common_prefix
from octo.errors import EngineError, KVCacheFull

from .cells import CellBook
from .native import LogTap
from .vision import floor, position

log = logging.getLogger("octo.engines.llamacpp")
STATE_MAGIC = (0xAF143CD8).to_bytes(4, "little")  # llama.cpp's sequence-state io_magic (llama-context.cpp)


@dataclass
class Slot:
    seq_id: int
    chain: Any  # its .sampling.SamplerChain


class CellsHost(Protocol):
    """What :class:`KVCells` reads of the engine: its serving context and the sequences running in it."""

    lib: Any  # the llama_cpp module
    ctx: Any  # llama_context (rebuilt on a layout switch)
    mem: Any  # its llama_memory
    active: dict[int, Sequence]  # running sequences by sequence id
    adapters: Any  # .lora.Adapters, or None without LoRA
    is_embedding: bool
    kv_unified: bool
    cell_bytes: int
    plain_kv: bool  # one plain KV cache (no sliding window, not recurrent): restream applies


class KVCells:
    """The KV cells of the engine's context, as one part (``engine.cells``)."""

    def __init__(self, host: CellsHost) -> None:
        self.host = host
        self.demoted = 0  # prefix-cache entries moved from the pool to RAM (kept across layout switches)
        self.compactions = 0  # compaction passes that moved cells (kept across layout switches)
        self.reset(0, 0, True)

    def reset(self, n_cache: int, first_cache_id: int, compact: bool) -> None:
        """A new context: an empty book, ``n_cache`` cache sequence ids from ``first_cache_id`` on, no entries."""
        self.book = CellBook()
        self.cache_ids = list(range(first_cache_id + n_cache - 1, first_cache_id - 1, -1))
        self.entries: dict[int, KVHandle] = {}  # cache sequence id -> its handle, oldest first
        self.members_changed = False  # sequences came or went since the last step's idle check
        self.compact = compact
        self.runs: dict[int, int] = {}  # sequence id -> runs of cells written since its cells were last compacted
        self.solo = -1  # the sequence of the last step when it ran alone (its next cells continue the same run)
        self.scratch = (ctypes.c_uint8 * 0)()  # compaction's copies, kept between passes

    # -- sequences ---------------------------------------------------------------------------------------------
    def join(self, seq_id: int) -> None:
        """A sequence takes ``seq_id``: whatever the id held goes."""
        self.seq_rm(seq_id, 0)
        self.members_changed = True
        self.runs[seq_id] = 0

    def leave(self, seq_id: int) -> None:
        """The sequence of ``seq_id`` is removed: its cells go (those it shares stay with their other holders)."""
        self.seq_rm(seq_id, 0)
        self.runs.pop(seq_id, None)
        self.members_changed = True

    def shareable(self, tokens: list[int], adapter: str | None = None) -> int:
        """The longest prefix of ``tokens`` already in the pool's cells (a running sequence's or a cached entry's)."""
        active = self.host.active
        if self.host.adapters is not None:  # KV computed with another adapter is never shared: same-adapter only
            held = [s.tokens[:s.n_cached] for s in active.values() if s.sampling.adapter == adapter]
        else:
            held = [*(s.tokens[:s.n_cached] for s in active.values()), *(h.tokens for h in self.entries.values())]
        return max((common_prefix(list(h), tokens) for h in held), default=0)

    def at(self, seq_id: int, n: int) -> int:
        """The KV position of token ``n`` of the running sequence ``seq_id`` (``n`` itself but after an M-RoPE image:
        :func:`.vision.position`)."""
        seq = self.host.active.get(seq_id) if n > 0 else None
        return position(seq, n) if seq is not None and seq.media else n

    def seq_rm(self, seq_id: int, keep: int) -> bool:
        """Drop ``seq_id``'s tokens from ``keep`` on (0: all), in llama.cpp and in the cell book."""
        L, mem = self.host.lib, self.host.mem
        ok = L.llama_memory_seq_rm(mem, seq_id, self.at(seq_id, keep), -1)
        if not ok:  # a partial removal the memory cannot do: drop it all
            L.llama_memory_seq_rm(mem, seq_id, -1, -1)
        self.book.truncate(seq_id, keep if ok else 0)
        return bool(ok)

    def decode_failed(self, rc: int, feeds: list[Any]) -> None:
        """Raise for a ``llama_decode`` that returned ``rc`` on ``feeds``: KVCacheFull for no KV slot (the memory state
        was restored, nothing was consumed: the scheduler preempts), else EngineError, once what each sequence may
        have added is dropped."""
        if rc == 1:
            raise KVCacheFull(f"llama.cpp's KV cache is full ({len(self.host.active)} sequences holding "
                              f"{self.book.used()} tokens).")
        for f in feeds:
            self.seq_rm(f.seq.slot.seq_id, f.seq.n_cached)
        raise EngineError(f"llama_decode failed with code {rc}: {LogTap.tail()}")

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) joins the cells of ``src``'s first ``n`` tokens: no data is copied. (One of the two is a
        running sequence, whose images place the tokens.)"""
        p = self.at(dst if dst in self.host.active else src, n)
        self.host.lib.llama_memory_seq_cp(self.host.mem, src, dst, 0, p)
        self.book.copy(src, dst, n)

    # -- KV pressure -------------------------------------------------------------------------------------------
    def drop(self, seq: Sequence) -> None:
        self.seq_rm(seq.slot.seq_id, 0)
        seq.n_cached = 0

    def share(self, src: Sequence, dst: Sequence, n: int) -> None:
        """``dst`` joins the cells of ``src``'s first ``n`` positions (the unified pool; fewer when ``n`` falls inside
        an M-RoPE image)."""
        n = floor(dst, n)
        self.seq_cp(src.slot.seq_id, dst.slot.seq_id, n)
        dst.n_cached = n

    # -- compaction ----------------------------------------------------------------------------------
    # llama.cpp puts a step's new cells in the pool's first free cells, so sequences that decode together interleave:
    # after 144 steps of 16 sequences each one's cells are 144 runs of one cell, and ggml's CPU flash attention, which
    # walks every cell in use for each decode row and skips the masked ones one by one, pays for the short runs
    # (branch mispredictions). So once a sequence's cells form COMPACT_RUNS runs, a pass rewrites every sequence
    # with half as many as one run each: their cells are copied out (``llama_state_seq`` snapshots, into one scratch
    # buffer) and back into the cells they free together, which llama.cpp fills in order. A sequence that shares
    # cells (a prefix) is left alone: a copy would unshare them. Measured in lockstep against the same pool without it
    # (three engines in one process, one step each in turn): +0.1% decode tok/s at 8 short streams, +0.8% at 16;
    # most of the gap to per-sequence streams (0.98x / 0.95x) is the walk over other sequences' cells, which no
    # placement removes.
    COMPACT_RUNS = 8

    def count_runs(self, feeds: list[Any]) -> None:
        """After a step in the unified pool: each fed sequence wrote a new run of cells (a sequence alone continues
        its last one)."""
        runs = self.runs
        if len(feeds) == 1:
            sid = feeds[0].seq.slot.seq_id
            if sid != self.solo:
                runs[sid] = runs.get(sid, 0) + 1
            self.solo = sid
            return
        self.solo = -1
        for f in feeds:
            sid = f.seq.slot.seq_id
            runs[sid] = runs.get(sid, 0) + 1

    def compact_scattered(self) -> None:
        runs, due = self.runs, self.COMPACT_RUNS
        if not any(r >= due for r in runs.values()):
            return
        self.compact_seqs([s for sid, s in sorted(self.host.active.items())
                           if runs.get(sid, 0) >= max(2, due // 2) and s.n_cached > 1])

    def compact_seqs(self, seqs: list[Sequence]) -> None:
        """Rewrite the cells of each sequence that shares none of them as one run. All the copies are taken (into one
        scratch buffer, kept between passes) before any cell is freed; one fails to come back only if llama.cpp
        refuses cells it has just freed."""
        L, ctx = self.host.lib, self.host.ctx
        plan = []
        total = 0
        for seq in seqs:
            sid = seq.slot.seq_id
            self.runs[sid] = 1
            if self.book.shared_prefix(sid):  # shared cells stay where they are (a copy would unshare them)
                continue
            size = L.llama_state_seq_get_size(ctx, sid)
            plan.append((seq, sid, total, size))
            total += size
        if not plan:
            return
        if len(self.scratch) < total:
            self.scratch = (ctypes.c_uint8 * (total + total // 4))()
        base = ctypes.addressof(self.scratch)
        ptr = ctypes.POINTER(ctypes.c_uint8)
        taken = []
        for seq, sid, off, size in plan:
            if L.llama_state_seq_get_data(ctx, ctypes.cast(base + off, ptr), size, sid) == size:
                taken.append((seq, sid, off, size))
        for _, sid, _, _ in taken:
            self.seq_rm(sid, 0)
        for seq, sid, off, size in taken:
            if L.llama_state_seq_set_data(ctx, ctypes.cast(base + off, ptr), size, sid) != size:
                raise EngineError(f"llama.cpp could not put back the {seq.n_cached} cells of sequence {seq.id} it "
                                  f"had just freed (KV compaction): {LogTap.tail()}")
            self.book.append(sid, seq.n_cached)
        self.compactions += bool(taken)

    # -- prefix cache ------------------------------------------------------------------------------
    # Idle cached cells cost attention: every decode row of a unified pool scans all cells up to the last one in use
    # (measured in process: 4 sequences of 2,000 tokens decode 15% slower beside 4 idle cached prefixes). So cells of
    # entries that no running sequence shares are moved to RAM snapshots (copied back on a hit) once they exceed
    # IDLE_SHARE of the cells running sequences use. There is no floor: a short stream beside 512 idle cells decoded
    # 3% slower than with them moved out (a snapshot of a short entry costs well under a millisecond, once).
    IDLE_SHARE = 0.1

    def save(self, seq: Sequence) -> KVHandle | None:
        slot: Slot | None = seq.slot
        if slot is None or seq.n_cached <= 0 or self.host.is_embedding:
            return None
        if not self.cache_ids:
            return self.snapshot(seq)
        cid = self.cache_ids.pop()
        self.seq_cp(slot.seq_id, cid, seq.n_cached)
        n = seq.n_cached
        handle = KVHandle(tokens=tuple(seq.tokens[:n]), nbytes=n * self.host.cell_bytes, data=cid, cells=n)
        self.entries[cid] = handle
        return handle

    def demote_after_change(self) -> None:
        """Before a step after sequences came or went: idle entries beyond the bound leave the pool."""
        self.members_changed = False
        self.demote_idle()

    def demote_idle(self, bound: int | None = None) -> None:
        """Move the oldest cache entries whose cells no running sequence shares to RAM, down to the idle bound (or
        ``bound`` idle cells)."""
        if not self.entries:
            return
        live = self.book.blocks(s.slot.seq_id for s in self.host.active.values())
        idle = {cid: self.book.cells_outside(cid, live) for cid in self.entries}
        total = sum(idle.values())
        if bound is None:
            bound = int(self.IDLE_SHARE * (self.book.used() - total))
        for cid in list(self.entries):
            if total <= bound:
                break
            if not idle[cid]:
                continue
            handle = self.entries.pop(cid)
            snap = self.snapshot_id(cid, len(handle.tokens))
            self.seq_rm(cid, 0)
            self.cache_ids.append(cid)
            handle.data, handle.cells = (snap.data if snap is not None else None), 0  # nbytes: as the index counted
            total -= idle[cid]
            self.demoted += 1

    def snapshot(self, seq: Sequence) -> KVHandle | None:
        """A RAM copy of ``seq``'s KV (``llama_state_seq_get_data``), or None."""
        slot: Slot | None = seq.slot
        if slot is None or seq.n_cached <= 0 or self.host.is_embedding:
            return None
        snap = self.snapshot_id(slot.seq_id, seq.n_cached)
        if snap is not None:
            snap.tokens = tuple(seq.tokens[: seq.n_cached])
        return snap

    def snapshot_id(self, seq_id: int, n: int) -> KVHandle | None:
        L, ctx = self.host.lib, self.host.ctx
        size = L.llama_state_seq_get_size(ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(ctx, buf, size, seq_id)
        if written == 0:
            return None
        return KVHandle(tokens=(), nbytes=written, data=(buf, written))

    def restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> int:
        """Give ``seq`` the first ``n_tokens`` of ``handle`` (at least one prompt token is always left to feed, so the
        next step has logits to sample from). Returns the tokens it got (0: a miss, ``n_cached`` stays 0)."""
        slot: Slot = seq.slot
        n_tokens = floor(seq, min(n_tokens, len(handle.tokens), len(seq.tokens) - 1))  # (an M-RoPE image: whole)
        if n_tokens <= 0:
            return 0
        if isinstance(handle.data, int):  # cells of a cache sequence: join them
            self.seq_cp(handle.data, slot.seq_id, n_tokens)
            seq.n_cached = n_tokens
            return n_tokens
        if handle.data is None:  # an entry whose RAM copy failed: a miss
            return 0
        buf, size = handle.data
        if not self.set_state(buf, size, slot.seq_id):
            log.warning("prefix cache: restoring %d tokens failed (KV pool full?); recomputing", n_tokens)
            self.seq_rm(slot.seq_id, 0)
            return 0
        self.book.append(slot.seq_id, len(handle.tokens))
        if not self.seq_rm(slot.seq_id, n_tokens):
            return 0
        seq.n_cached = n_tokens
        return n_tokens

    def put_back(self, seq_id: int, snap: KVHandle, n: int) -> bool:
        """A snapshot of ``n`` positions set into ``seq_id`` of the (new) context, as it was (a layout switch)."""
        buf, size = snap.data
        if not self.set_state(buf, size, seq_id):
            return False
        self.book.append(seq_id, n)
        return True

    def set_state(self, buf: Any, size: int, seq_id: int) -> bool:
        """``llama_state_seq_set_data`` of a snapshot taken in either KV layout (:func:`restream`); all of it must be
        read."""
        L, ctx = self.host.lib, self.host.ctx
        n_stream = 1 if self.host.kv_unified else L.llama_n_seq_max(ctx)
        data = restream(buf, size, n_stream) if self.host.plain_kv else None
        if data is not None:
            buf, size = data
        return L.llama_state_seq_set_data(ctx, buf, size, seq_id) == size

    def free(self, handle: KVHandle) -> None:
        if isinstance(handle.data, int):  # the cells stay while a running sequence shares them
            self.entries.pop(handle.data, None)
            self.seq_rm(handle.data, 0)
            self.cache_ids.append(handle.data)
        handle.data = None  # a snapshot's ctypes buffer is released with the last reference

    # -- disk tier (octo.scheduler.disk_cache) -----------------------------------------------------------------
    def export_bytes(self, handle: KVHandle) -> bytes | None:
        """The llama.cpp sequence state of a cached entry (``llama_state_seq_get_data``): cells or a RAM snapshot."""
        data = handle.data
        if isinstance(data, int):
            snap = self.snapshot_id(data, len(handle.tokens))
            data = snap.data if snap is not None else None
        if data is None:
            return None
        buf, size = data
        return ctypes.string_at(buf, size)

    def import_bytes(self, tokens: tuple[int, ...], data: bytes) -> KVHandle | None:
        """A RAM snapshot from exported bytes; llama.cpp checks them when ``restore`` sets them (a refusal is a
        miss there)."""
        if not tokens or not data or self.host.is_embedding:
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
