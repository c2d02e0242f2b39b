"""Which KV cells of llama.cpp's unified pool are in use, when sequences share cells.

In a unified KV pool a cell holds one position and a *set* of sequence ids: ``llama_memory_seq_cp(src, dst, 0, n)``
adds ``dst`` to the cells of ``src``'s first ``n`` positions (no data is copied), and a cell is free again only when
its last sequence leaves it (``llama_memory_seq_rm``). That is the reference count of a shared prefix: the prefix
cache holds a prefix as the cells of a cache sequence id, any number of running sequences share them, and evicting
the entry frees only the cells no sequence still uses.

llama.cpp does not report how many cells are in use, and the scheduler needs that number (admission, preemption).
The book mirrors it exactly: cells are created in *blocks* (the positions one sequence appended in a row); every
sequence id covers a list of (block, how many of its first cells); a block's live cells are the most any holder
covers. Used cells = the sum over blocks of that maximum.
"""

from __future__ import annotations


def _head(segs, n: int) -> list[list]:
    """The segments covering the first ``n`` positions of ``segs`` (new lists: the blocks themselves are shared)."""
    out: list[list] = []
    for block, k in segs:
        if n <= 0:
            break
        out.append([block, min(k, n)])
        n -= k
    return out


class _Block:
    __slots__ = ()


class CellBook:
    def __init__(self) -> None:
        self._segs: dict[int, list[list]] = {}  # seq id -> [[block, cells covered], ...] in position order

    def n_tokens(self, seq_id: int) -> int:
        return sum(n for _, n in self._segs.get(seq_id, ()))

    def append(self, seq_id: int, k: int) -> None:
        """``seq_id`` wrote ``k`` new positions after its last one."""
        if k <= 0:
            return
        segs = self._segs.setdefault(seq_id, [])
        if segs and not self._covered_beyond(seq_id, *segs[-1]):
            segs[-1][1] += k  # its new cells continue its last block
        else:
            segs.append([_Block(), k])

    def _covered_beyond(self, seq_id: int, block: _Block, n: int) -> bool:
        """Whether another holder covers more than the first ``n`` cells of ``block`` (then cells after ``n`` are
        theirs, and ``seq_id``'s new cells start a block of their own)."""
        return any(sid != seq_id and b is block and k > n
                   for sid, segs in self._segs.items() for b, k in segs)

    def copy(self, src: int, dst: int, n: int) -> None:
        """``llama_memory_seq_cp(src, dst, 0, n)`` into an empty ``dst``."""
        self._segs[dst] = _head(self._segs.get(src, ()), n)

    def truncate(self, seq_id: int, n: int) -> None:
        """``llama_memory_seq_rm(seq_id, n, -1)``: keep the first ``n`` positions (0: all gone)."""
        out = _head(self._segs.get(seq_id, ()), n)
        if out:
            self._segs[seq_id] = out
        else:
            self._segs.pop(seq_id, None)

    def shared_prefix(self, seq_id: int) -> int:
        """How many of ``seq_id``'s first positions are cells another sequence id also holds."""
        cover: dict[int, int] = {}  # block -> the most cells another holder covers
        for sid, segs in self._segs.items():
            if sid != seq_id:
                for b, k in segs:
                    cover[id(b)] = max(cover.get(id(b), 0), k)
        n = 0
        for block, k in self._segs.get(seq_id, ()):
            shared = min(k, cover.get(id(block), 0))
            n += shared
            if shared < k:
                break
        return n

    def blocks(self, seq_ids) -> set[int]:
        """The blocks the given sequence ids hold cells of."""
        return {id(b) for sid in seq_ids for b, _ in self._segs.get(sid, ())}

    def cells_outside(self, seq_id: int, blocks: set[int]) -> int:
        """Cells ``seq_id`` holds in blocks other than ``blocks``."""
        return sum(k for b, k in self._segs.get(seq_id, ()) if id(b) not in blocks)

    def used(self) -> int:
        live: dict[int, int] = {}
        for segs in self._segs.values():
            for block, k in segs:
                key = id(block)
                if k > live.get(key, 0):
                    live[key] = k
        return sum(live.values())
