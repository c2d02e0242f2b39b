"""Output constraints and logprobs on llama.cpp's logits rows (``Feed.mask``, ``Feed.logprobs``,
``Feed.prompt_logprobs``).

A feed with none of them never comes here: its sequence's native chain samples straight from llama.cpp's logits (the
speed of llama-server). Otherwise the logits row of the feed's last batch position is read as a numpy view of
``llama_get_logits_ith`` (no copy), and:

- logprobs: a copy of the raw row gets the chain's logit bias and penalties (``octo.logits.penalise``, over the same
  window the chain's penalties sampler holds: the last ``penalty_last_n`` tokens of the sequence, prompt included),
  and its log-softmax gives the sampled token's logprob and the top alternatives (before temperature, top-k/p and
  the mask, as on every octo engine);
- the mask sets forbidden tokens to -inf *in llama.cpp's own buffer*; the native chain then samples from it (logit
  bias, penalties, top-k/p, min-p and temperature all keep -inf at -inf), so only an allowed token can come out;
- prompt logprobs: every position of the feed asked llama.cpp for logits (``llama_batch.logits``), and each position
  whose next token is already in the sequence gets that token's logprob from its raw row.

``llama_get_logits_ith(ctx, i)`` takes a *batch* position ``i`` (llama.cpp maps it through its ``output_ids`` to the
output row), so the sampling index stays the feed's last batch position however many positions output logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from octo.engine import Feed
from octo.errors import EngineError
from octo.logits import apply_bitmask, penalise, top_logprobs

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

Entry = tuple[float, list[tuple[int, float]]]


def logits_row(L: Any, ctx: Any, idx: int, n_vocab: int) -> np.ndarray:
    """The float32 logits of batch position ``idx`` after the last ``llama_decode``, as a writable view of
    llama.cpp's buffer (valid until the next decode)."""
    import numpy as np
    ptr = L.llama_get_logits_ith(ctx, idx)
    if not ptr:
        raise EngineError(f"llama.cpp returned no logits for batch position {idx}.")
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))


def sample(L: Any, ctx: Any, n_vocab: int, f: Feed, idx: int, last_n: int) -> int | EngineError:
    """Sample ``f``'s next token from batch position ``idx`` with its sequence's native chain, within ``f.mask``,
    setting ``f.logprob`` when ``f.logprobs`` >= 0. An :class:`EngineError` (returned, for this sequence alone) when
    the mask allows no token."""
    import numpy as np
    row = logits_row(L, ctx, idx, n_vocab)
    x = None
    if f.logprobs >= 0:
        p = f.seq.sampling
        x = penalise(row.copy(), f.seq.tokens, repetition=p.repetition_penalty, presence=p.presence_penalty,
                     frequency=p.frequency_penalty, last_n=last_n, bias=p.logit_bias)
    if f.mask is not None:
        apply_bitmask(row, f.mask)
        if not row.max() > -np.inf:  # the chain's dist sampler would divide by a zero sum
            return EngineError("The output constraint allows no token here (an empty mask).")
    tok = f.seq.slot.chain.sample(ctx, idx)
    if x is not None:
        f.logprob = top_logprobs(x, tok, f.logprobs)
    return tok


def prompt_entries(L: Any, ctx: Any, n_vocab: int, f: Feed, first_idx: int, first_pos: int) -> list[Entry]:
    """``Feed.prompt_out`` of ``f``, whose tokens sit at batch positions ``first_idx``... and sequence positions
    ``first_pos``...: for each one whose next token is known, that token's logprob from the raw logits, and the top
    ``f.prompt_logprobs`` alternatives."""
    tokens, n_top = f.seq.tokens, f.prompt_logprobs
    n = min(len(f.tokens), len(tokens) - 1 - first_pos)
    return [top_logprobs(logits_row(L, ctx, first_idx + j, n_vocab), tokens[first_pos + j + 1], n_top)
            for j in range(max(0, n))]
