"""Numpy helpers engines share for constrained decoding and logprobs (server-free: engines may import this).

- :func:`apply_bitmask`: forbid, in place, the tokens an allowed-token bitmask (``Feed.mask``) does not allow.
- :func:`penalise`: logit bias and the repetition / presence / frequency penalties, the rules every octo sampler
  uses (llama.cpp's penalties sampler, Hugging Face's repetition penalty, OpenAI's presence/frequency penalties).
- :func:`top_logprobs`: the ``(logprob of a token, top n alternatives)`` pair of ``Feed.logprob`` from a logits row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np


_NEG_INF_BITS = 0xFF800000  # float32 -inf's bits (np.float32(-np.inf).view(np.uint32))


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set forbidden logits to -inf in place: ``logits`` ``(n,)`` or ``(batch, n)``, ``bitmask`` ``(words,)`` or
    ``(batch, words)`` int32 (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed). Columns past the bitmask's
    tokens are forbidden too."""
    import numpy as np
    rows = logits if logits.ndim == 2 else logits[None, :]
    masks = bitmask if bitmask.ndim == 2 else bitmask[None, :]
    if rows.shape[0] != masks.shape[0]:
        raise ValueError(f"logits batch {rows.shape[0]} != bitmask batch {masks.shape[0]}")
    n = min(rows.shape[1], masks.shape[1] * 32)
    if rows.shape[1] > n:
        rows[:, n:] = -np.inf
    for row, words in zip(rows, masks, strict=True):
        bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little", count=n)
        if row.dtype == np.float32 and row.flags.c_contiguous:
            keep = bits.astype(np.int32)
            np.negative(keep, out=keep)  # 0xFFFFFFFF where allowed, 0 where forbidden
            u = row[:n].view(np.uint32)
            keep_u = keep.view(np.uint32)
            u &= keep_u
            np.invert(keep_u, out=keep_u)
            keep_u &= _NEG_INF_BITS
            u |= keep_u
        else:
            np.putmask(row[:n], ~bits.view(bool), -np.inf)


def allowed(bitmask: np.ndarray, token: int) -> bool:
    """Whether ``bitmask`` allows ``token``."""
    return 0 <= token < bitmask.shape[-1] * 32 and bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


def penalise(x: np.ndarray, tokens: Sequence[int], *, repetition: float = 1.0, presence: float = 0.0,
             frequency: float = 0.0, last_n: int = 64, bias: dict[int, float] | None = None) -> np.ndarray:
    """Apply logit ``bias`` (<= -100 bans: -inf) and the penalties over the last ``last_n`` of ``tokens`` (-1: all)
    to the float row ``x`` in place; returns it. Repetition: a seen token's positive logit is divided by the
    penalty, a negative one multiplied; then ``- presence - frequency * count``."""
    import numpy as np
    if bias:
        for tok, b in bias.items():
            if 0 <= int(tok) < x.shape[0]:
                x[int(tok)] = -np.inf if b <= -100 else x[int(tok)] + b
    if repetition == 1.0 and not presence and not frequency:
        return x
    window = list(tokens) if last_n < 0 else list(tokens[-last_n:]) if last_n else []
    if not window:
        return x
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ok = (ids >= 0) & (ids < x.shape[0])
    ids, counts = ids[ok], counts[ok]
    if repetition != 1.0:
        v = x[ids]
        x[ids] = np.where(v > 0, v / repetition, v * repetition)
    if presence or frequency:
        x[ids] -= presence + frequency * counts.astype(x.dtype)
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a 1-D row (-inf entries stay -inf)."""
    import numpy as np
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    if not np.isfinite(m):
        return np.full_like(x, -np.inf)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def top_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of token, [(token, logprob)] for the n most likely tokens, most likely first)`` from a logits row
    (ties: lower token id first). One exp pass over the row (float32, summed in float64) for the normaliser; only the
    reported entries are computed (0.3 ms on a 151,936-token row instead of a whole float64 log-softmax)."""
    import numpy as np
    x = np.asarray(logits, dtype=np.float32)
    m = float(np.max(x))
    if not np.isfinite(m):
        return float("-inf"), []
    lse = m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if n > 0:
        k = min(n, x.shape[0])
        idx = np.array([int(np.argmax(x))]) if k == 1 else np.argpartition(x, x.shape[0] - k)[x.shape[0] - k:]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i]) - lse) for i in idx]
    lp = float(x[token]) - lse if 0 <= token < x.shape[0] else float("-inf")
    return lp, top
