"""Per-sequence sampling with mlx-lm's samplers and logits processors.

Logits processors (``mlx_lm.sample_utils.make_logits_processors``): logit bias (OpenAI's -100 bans the token),
repetition, presence and frequency penalties over the last ``penalty_last_n`` tokens (prompt included, as in
llama.cpp); the same rules as ``octo.logits.penalise``. Logprobs (``Feed.logprobs``) are the log-softmax of that
row. Then the output constraint (``Feed.mask``: forbidden tokens get -inf) and, as in
``mlx_lm.sample_utils.make_sampler``: top_p, min_p and top_k filters on the log-probabilities, and a categorical draw
at ``temperature`` (0: argmax). The draw uses a per-sequence key derived from (seed, draw number), so a seeded
sequence samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
import secrets

from octo.engine import SamplingParams
from octo.logits import top_logprobs

SAMPLING_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    }
)
_MASK64 = (1 << 64) - 1


class RowSampler:
    """Sampling state of one sequence: its logits processors, filters, temperature and key."""

    def __init__(self, p: SamplingParams, n_vocab: int, penalty_last_n: int = 64) -> None:
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

        p.validate(n_vocab)
        bias = {int(t): (-math.inf if b <= -100 else float(b)) for t, b in p.logit_bias.items()}
        self.processors = make_logits_processors(
            logit_bias=bias or None,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
            repetition_context_size=penalty_last_n,
            presence_penalty=p.presence_penalty or None,
            presence_context_size=penalty_last_n,
            frequency_penalty=p.frequency_penalty or None,
            frequency_context_size=penalty_last_n,
        )
        self.context = max(1, penalty_last_n)
        self.temperature = p.temperature
        top_k = 1 if p.top_p == 0 else p.top_k  # top_p 0 keeps only the most likely token
        self.filters = []
        if 0 < p.top_p < 1:
            self.filters.append(lambda x, v=p.top_p: apply_top_p(x, v))
        if p.min_p > 0:
            self.filters.append(lambda x, v=p.min_p: apply_min_p(x, v))
        if 0 < top_k < n_vocab:
            self.filters.append(lambda x, v=top_k: apply_top_k(x, v))
        self.seed = (p.seed if p.seed is not None else secrets.randbits(63)) & _MASK64
        self.draws = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: rows like this are sampled together in one call."""
        return self.greedy and not self.processors

    def process(self, logits, tokens: list[int], n: int):
        """``logits`` (1, vocab) after logit bias and penalties over ``tokens[:n]``."""
        import mlx.core as mx

        if self.processors and n > 0:
            window = tokens[max(0, n - self.context) : n]
            if min(window) < 0:  # an image's positions (placeholder ids, octo.engine.media_token_ids) take no penalty
                window = [t for t in window if t >= 0]
            context = mx.array(window, dtype=mx.int32)
            for proc in self.processors:
                logits = proc(context, logits)
        return logits

    def draw(self, logits):
        """One token (a shape-(1,) array) from processed (and masked) ``logits`` of shape (1, vocab)."""
        import mlx.core as mx

        if self.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for f in self.filters:
            logprobs = f(logprobs)
        key = mx.random.key((self.seed * 0x9E3779B97F4A7C15 + self.draws * 0xBF58476D1CE4E5B9 + 1) & _MASK64)
        self.draws += 1
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)

    def __call__(self, logits, tokens: list[int], n: int):
        """One token (a shape-(1,) array) from ``logits`` of shape (1, vocab) after ``tokens[:n]``."""
        return self.draw(self.process(logits, tokens, n))


def apply_mask(logits, mask):
    """``logits`` (1, vocab) with the tokens an int32 allowed-token bitmask (``Feed.mask``) forbids at -inf (and every
    column past the bitmask's tokens)."""
    import mlx.core as mx
    import numpy as np

    width = logits.shape[-1]
    words = np.ascontiguousarray(mask, dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=min(width, words.size * 32))
    if bits.size < width:
        bits = np.concatenate([bits, np.zeros(width - bits.size, np.uint8)])
    return mx.where(mx.array(bits.view(np.bool_)), logits, mx.array(-math.inf, dtype=logits.dtype))


def sample_rows(feeds: list, logits):
    """Tokens (shape (B,)) for a batch of ``logits`` (B, vocab), one :class:`octo.engine.Feed` per row (its
    sequence's ``slot.sampler`` samples it within ``feed.mask``; its tokens up to ``n_cached`` are the penalties'
    history), and ``[(row, processed logits (1, vocab))]`` for the feeds that asked for logprobs (see
    :func:`set_logprobs`)."""
    import mlx.core as mx

    if all(f.seq.slot.sampler.plain_greedy and f.mask is None and f.logprobs < 0 for f in feeds):
        return mx.argmax(logits, axis=-1), []
    rows, kept = [], []
    for i, f in enumerate(feeds):
        seq = f.seq
        sampler = seq.slot.sampler
        x = sampler.process(logits[i : i + 1], seq.tokens, seq.n_cached)
        if f.logprobs >= 0:
            kept.append((i, x))
        if f.mask is not None:
            x = apply_mask(x, f.mask)
        rows.append(sampler.draw(x))
    return (mx.concatenate(rows) if len(rows) > 1 else rows[0]), kept


def set_logprobs(feeds: list, kept: list, tokens: list[int]) -> None:
    """``feed.logprob`` of the rows :func:`sample_rows` kept, once their sampled ``tokens`` are known."""
    import mlx.core as mx
    import numpy as np

    for i, x in kept:
        row = np.array(x[0].astype(mx.float32))
        feeds[i].logprob = top_logprobs(row, int(tokens[i]), feeds[i].logprobs)


def prompt_entries(f, first: int, rows) -> list:
    """``Feed.prompt_out`` of ``f`` from the raw logits ``rows`` (m, vocab) after its positions ``first``,
    ``first + 1``, ... (those whose next token is already in the sequence)."""
    import mlx.core as mx
    import numpy as np

    tokens = f.seq.tokens
    x = np.array(rows.astype(mx.float32))
    return [top_logprobs(x[j], tokens[first + j + 1], f.prompt_logprobs) for j in range(x.shape[0])]
