"""The running decode batch: one row per decoding sequence, its KV held in mlx-lm's batch caches.

This is the continuous-batching core of mlx-lm's ``BatchGenerator`` used step by step: a sequence joins by
merging its own prompt cache into the batch caches (``KVCache.merge`` -> ``BatchKVCache``, left-padded and
``extend``-ed), leaves with ``filter`` (and ``extract`` when its KV is kept), and every step is one forward
pass of the model over the batch's last tokens. With a single row the cache is that sequence's own
``KVCache`` list, exactly what a plain ``mlx_lm.generate`` loop uses (no padding mask); the batch caches
are built when a second sequence joins and dropped again when one is left.
"""

from __future__ import annotations

from typing import Any

from octo.engine import Sequence


def cuttable(cache: list[Any]) -> bool:
    """Whether a prefix of this prompt cache (a sequence's own, or the batch's) can be kept by itself: every layer's
    is plain KV, or a sliding window (``RotatingKVCache``: Gemma 2 and 3) that :func:`whole` then checks."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    kinds = (KVCache, BatchKVCache, RotatingKVCache, BatchRotatingKVCache)
    return all(type(c) in kinds for c in cache)


def whole(cache: list[Any]) -> bool:
    """Whether a single-sequence cache holds every one of its positions, in order: a sliding window only while no
    position has left it yet (the window is longer than the sequence)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    for c in cache:
        if type(c) is RotatingKVCache:
            if c.keys is not None and not (c.offset <= c.max_size and c._idx == c.offset):
                return False
        elif type(c) is not KVCache:
            return False
    return True


def _cut(c: Any, n: int, copy: bool) -> Any:
    """A new single-sequence cache of ``c``'s kind over its first ``n`` positions (``copy``: contiguous copies; else
    slices, which the next append copies)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    k = RotatingKVCache(c.max_size, c.keep) if type(c) is RotatingKVCache else KVCache()
    m = min(n, c.offset)
    if c.keys is not None and m > 0:
        keys, values = c.keys[..., :m, :], c.values[..., :m, :]
        k.keys, k.values = (mx.contiguous(keys), mx.contiguous(values)) if copy else (keys, values)
        k.offset = m
        if type(k) is RotatingKVCache:
            k._idx = m
    return k


def snapshot_cache(cache: list[Any]) -> list[Any] | None:
    """A copy of a single-sequence cache (None: one that is not :func:`whole`)."""
    return [_cut(c, c.offset, True) for c in cache] if whole(cache) else None


def prefix_view(cache: list[Any], n: int) -> list[Any]:
    """New caches over the first ``n`` positions of a saved (:func:`whole`) ``cache``."""
    return [_cut(c, n, False) for c in cache]


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)


class DecodeBatch:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[Sequence] = []
        self.cache: list[Any] = []
        self.batched = False  # True: self.cache holds mlx-lm batch caches (2+ rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, seq: Sequence) -> bool:
        return any(r is seq for r in self.rows)

    def _index(self, seq: Sequence) -> int:
        for i, r in enumerate(self.rows):
            if r is seq:
                return i
        raise KeyError(f"sequence {seq.id} is not in the decode batch")

    def join(self, seq: Sequence, cache: list[Any]) -> None:
        """Add ``seq`` with its single-sequence prompt cache (which the batch then owns)."""
        if not self.rows:
            self.cache, self.batched = cache, False
        elif not self.batched:
            self.cache = [type(a).merge([a, b]) for a, b in zip(self.cache, cache, strict=True)]
            self.batched = True
        else:
            for a, b in zip(self.cache, cache, strict=True):
                a.extend(type(b).merge([b]))
        self.rows.append(seq)

    def leave(self, seq: Sequence, keep: bool = False) -> list[Any] | None:
        """Remove ``seq``'s row; with ``keep``, return its KV as a single-sequence prompt cache."""
        i = self._index(seq)
        if not self.batched:
            cache = self.cache
            self.rows, self.cache = [], []
            return cache if keep else None
        out = [c.extract(i) for c in self.cache] if keep else None
        del self.rows[i]
        if len(self.rows) == 1:
            self.cache = [c.extract(1 - i) for c in self.cache]
            self.batched = False
        else:
            keep_rows = [j for j in range(len(self.rows) + 1) if j != i]
            for c in self.cache:
                c.filter(keep_rows)
        return out

    def snapshot(self, seq: Sequence) -> list[Any] | None:
        """A copy of ``seq``'s KV as a single-sequence prompt cache (None: not :func:`whole`); the row stays."""
        i = self._index(seq)
        if not self.batched:
            return snapshot_cache(self.cache)
        cache = [c.extract(i) for c in self.cache]
        return cache if whole(cache) else None

    def forward(self, tokens: list[int]):
        """Logits (B, vocab) after appending one token per row (in row order)."""
        import mlx.core as mx

        x = mx.array(tokens, dtype=mx.uint32)[:, None]
        return self.model(x, cache=self.cache)[:, -1, :]

    def clear(self) -> list[Sequence]:
        rows, self.rows, self.cache, self.batched = self.rows, [], [], False
        return rows
