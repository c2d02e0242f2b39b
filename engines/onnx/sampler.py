"""Per-sequence sampling from a logits row, in numpy.

Logits processors first (:func:`octo.logits.penalise`): logit bias (OpenAI's -100 bans the token), then the
repetition penalty (Hugging Face / onnxruntime-genai rule: a seen token's positive logit is divided by the penalty, a
negative one multiplied) and the presence / frequency penalties (OpenAI rule: ``- presence - frequency * count``),
all over the last ``penalty_last_n`` tokens of the sequence, prompt included (-1: the whole sequence). Logprobs
(``Feed.logprobs``) are the log-softmax of that row. Then the output constraint (``Feed.mask``: forbidden tokens get
-inf), temperature (0 or a greedy request: argmax), top_k, min_p and top_p filters, and a draw from the sequence's
own ``numpy.random.Generator`` (seeded from ``seed``), so a seeded sequence samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from octo.engine import Feed, SamplingParams
from octo.errors import EngineError
from octo.logits import apply_bitmask, penalise, top_logprobs

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

SAMPLING_PARAMS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias",
})
_TOP_P_PROBE = 1024  # top_p first tries the most likely 1024 tokens before sorting the whole vocabulary


class RowSampler:
    """Sampling state of one sequence."""

    def __init__(self, p: SamplingParams, n_vocab: int, penalty_last_n: int = 64) -> None:
        import numpy as np
        p.validate(n_vocab)
        self.p = p
        self.last_n = penalty_last_n
        bias = {int(t): (-np.inf if b <= -100 else float(b)) for t, b in p.logit_bias.items()}
        self.bias_ids = np.fromiter(bias, np.int64, len(bias))
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))
        self.bias_set = frozenset(bias)
        self.penalised = bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        self.greedy = p.temperature == 0.0 or p.top_k == 1 or p.top_p == 0.0
        # plain greedy rows are sampled together with one argmax over the batch (when unconstrained, no logprobs)
        self.plain_greedy = self.greedy and not self.penalised and not bias
        self.rng = np.random.default_rng(p.seed)

    def fast(self, f: Feed) -> bool:
        """Whether ``f`` can take the batch's shared argmax: plain greedy, no mask, no logprobs."""
        return self.plain_greedy and f.mask is None and f.logprobs < 0

    def sample_feed(self, f: Feed, logits: np.ndarray) -> int:
        """The next token of ``f``'s sequence from its logits row: within ``f.mask``, and with ``f.logprob`` set
        when ``f.logprobs`` >= 0. Raises :class:`EngineError` when the mask leaves no token (logit_bias banned
        every token the constraint allows)."""
        if f.logprobs < 0:
            return self.sample(logits, f.seq.tokens, f.mask)
        x = self.processed(logits, f.seq.tokens)
        probs = x.copy()  # logprobs: after bias and penalties, before the mask and temperature
        tok = self._draw(x, f.mask)
        f.logprob = top_logprobs(probs, tok, f.logprobs)
        return tok

    def sample(self, logits: np.ndarray, tokens: list[int], mask: np.ndarray | None = None) -> int:
        """The next token from a 1-D float logits row, given the sequence so far (``tokens``) and an allowed-token
        bitmask (None: any token)."""
        if mask is None and self.greedy and not self.penalised:
            return self._biased_argmax(logits)
        return self._draw(self.processed(logits, tokens), mask)

    def processed(self, logits: np.ndarray, tokens: list[int]) -> np.ndarray:
        """A float32 copy of the row after logit bias and penalties."""
        import numpy as np
        p = self.p
        x = logits.astype(np.float32, copy=True)
        if self.bias_ids.size:
            x[self.bias_ids] += self.bias_values
        if self.penalised and tokens:
            penalise(x, tokens, repetition=p.repetition_penalty, presence=p.presence_penalty,
                     frequency=p.frequency_penalty, last_n=self.last_n)
        return x

    def _draw(self, x: np.ndarray, mask: np.ndarray | None) -> int:
        """A token from the processed row ``x`` (modified in place)."""
        import numpy as np
        if mask is not None:
            apply_bitmask(x, mask)
            if not x.max() > -np.inf:
                raise EngineError("No token is left to sample: logit_bias bans every token the output constraint "
                                  "allows here.")
        if self.greedy:
            return int(np.argmax(x))
        p = self.p
        x /= np.float32(p.temperature)
        # the distribution: softmax over the top_k tokens (renormalised among themselves), else the vocabulary
        idx = np.argpartition(-x, p.top_k - 1)[:p.top_k] if 0 < p.top_k < x.shape[0] else None
        base = x if idx is None else x[idx]
        mx = base.max()
        z = base  # candidate logits; idx maps them back to token ids (None: z is the whole vocabulary)
        if p.min_p > 0:  # p >= min_p * p_max  <=>  logit >= max + log(min_p)
            keep = np.flatnonzero(z >= mx + np.float32(math.log(p.min_p)))
            idx, z = (keep if idx is None else idx[keep]), z[keep]
        if p.top_p >= 1.0:
            pick = _gumbel_argmax(z, self.rng)
            return int(pick if idx is None else idx[pick])
        total = float(np.exp(base - mx).sum(dtype=np.float64))
        if z.shape[0] > _TOP_P_PROBE:  # the most likely 1024 tokens usually hold top_p: sort those only
            probe = np.argpartition(-z, _TOP_P_PROBE - 1)[:_TOP_P_PROBE]
            if np.exp(z[probe] - mx).sum(dtype=np.float64) >= p.top_p * total:
                idx, z = (probe if idx is None else idx[probe]), z[probe]
        order = np.argsort(-z, kind="stable")
        cdf = np.cumsum(np.exp(z[order] - mx), dtype=np.float64) / total
        keep = min(len(cdf), int(np.searchsorted(cdf, p.top_p)) + 1)  # smallest prefix reaching top_p
        pick = min(int(np.searchsorted(cdf[:keep], self.rng.random() * cdf[keep - 1], side="right")), keep - 1)
        return int(order[pick] if idx is None else idx[order[pick]])

    def _biased_argmax(self, logits: np.ndarray) -> int:
        """argmax(logits + bias) without copying the row (the common "ban EOS" greedy request)."""
        import numpy as np
        best = int(np.argmax(logits))
        if not self.bias_ids.size:
            return best
        biased = logits[self.bias_ids] + self.bias_values
        if best in self.bias_set:  # the top token itself is biased: take the slow, exact way
            x = logits.astype(np.float32, copy=True)
            x[self.bias_ids] = biased
            return int(np.argmax(x))
        j = int(np.argmax(biased))
        return int(self.bias_ids[j]) if biased[j] > logits[best] else best


def prompt_entries(f: Feed, first: int, rows: np.ndarray) -> list[tuple[float, list[tuple[int, float]]]]:
    """``Feed.prompt_out`` of ``f`` from the raw logits ``rows[j]`` after each fed position ``first + j``: one
    ``(logprob, top)`` pair per position whose next token is already in the sequence."""
    tokens = f.seq.tokens
    n = min(len(f.tokens), len(tokens) - 1 - first, rows.shape[0])
    return [top_logprobs(rows[j], tokens[first + j + 1], f.prompt_logprobs) for j in range(max(0, n))]


def _gumbel_argmax(z: np.ndarray, rng: np.random.Generator) -> int:
    """A draw from softmax(z): argmax of z plus Gumbel noise."""
    import numpy as np
    u = rng.random(z.shape[0], dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)
    return int(np.argmax(z - np.log(-np.log(u))))
