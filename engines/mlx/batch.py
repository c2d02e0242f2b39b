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


def copy_prompt_cache(cache: list[Any], n: int | None = None) -> list[Any]:
    """Fresh ``KVCache`` objects holding (a copy of) the first ``n`` tokens of a single-sequence cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        m = c.offset if n is None else min(n, c.offset)
        k = KVCache()
        if c.keys is not None and m > 0:
            k.keys = mx.contiguous(c.keys[..., :m, :])
            k.values = mx.contiguous(c.values[..., :m, :])
            k.offset = m
        out.append(k)
    return out


def prefix_view(cache: list[Any], n: int) -> list[Any]:
    """New ``KVCache`` objects over the first ``n`` tokens of ``cache`` (slices: the next append copies)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        k = KVCache()
        if c.keys is not None and n > 0:
            k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(k)
    return out


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

    def snapshot(self, seq: Sequence) -> list[Any]:
        """A copy of ``seq``'s KV as a single-sequence prompt cache; the row stays."""
        i = self._index(seq)
        if not self.batched:
            return copy_prompt_cache(self.cache)
        return [c.extract(i) for c in self.cache]

    def forward(self, tokens: list[int]):
        """Logits (B, vocab) after appending one token per row (in row order)."""
        import mlx.core as mx

        x = mx.array(tokens, dtype=mx.uint32)[:, None]
        return self.model(x, cache=self.cache)[:, -1, :]

    def clear(self) -> list[Sequence]:
        rows, self.rows, self.cache, self.batched = self.rows, [], [], False
        return rows
