"""Per-sequence sampling from a logits row, in numpy.

Logits processors first: logit bias (OpenAI's -100 bans the token), then the repetition penalty (Hugging Face /
onnxruntime-genai rule: a seen token's positive logit is divided by the penalty, a negative one multiplied) and
the presence / frequency penalties (OpenAI rule: ``- presence - frequency * count``), all over the last
``penalty_last_n`` tokens of the sequence, prompt included (-1: the whole sequence). Then temperature (0 or a
greedy request: argmax), top_k, min_p and top_p filters, and a draw from the sequence's own
``numpy.random.Generator`` (seeded from ``seed``), so a seeded sequence samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import math

import numpy as np

from octo.engine import SamplingParams

SAMPLING_PARAMS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias",
})
_TOP_P_PROBE = 1024  # top_p first tries the most likely 1024 tokens before sorting the whole vocabulary


class RowSampler:
    """Sampling state of one sequence."""

    def __init__(self, p: SamplingParams, n_vocab: int, penalty_last_n: int = 64) -> None:
        p.validate(n_vocab)
        self.p = p
        self.last_n = penalty_last_n
        bias = {int(t): (-np.inf if b <= -100 else float(b)) for t, b in p.logit_bias.items()}
        self.bias_ids = np.fromiter(bias, np.int64, len(bias))
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))
        self.bias_set = frozenset(bias)
        self.penalised = bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        self.greedy = p.temperature == 0.0 or p.top_k == 1 or p.top_p == 0.0
        # plain greedy rows are sampled together with one argmax over the batch
        self.plain_greedy = self.greedy and not self.penalised and not bias
        self.rng = np.random.default_rng(p.seed)

    def sample(self, logits: np.ndarray, tokens: list[int]) -> int:
        """The next token from a 1-D float logits row, given the sequence so far (``tokens``)."""
        if self.greedy and not self.penalised:
            return self._biased_argmax(logits)
        x = logits.astype(np.float32, copy=True)
        if self.bias_ids.size:
            x[self.bias_ids] += self.bias_values
        if self.penalised and tokens:
            self._penalise(x, tokens)
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

    def _penalise(self, x: np.ndarray, tokens: list[int]) -> None:
        p = self.p
        window = tokens if self.last_n < 0 else tokens[-self.last_n:] if self.last_n else []
        if not window:
            return
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        ids_ok = ids < x.shape[0]
        ids, counts = ids[ids_ok], counts[ids_ok]
        if p.repetition_penalty != 1.0:
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts.astype(np.float32)




def _gumbel_argmax(z: np.ndarray, rng: np.random.Generator) -> int:
    """A draw from softmax(z): argmax of z plus Gumbel noise."""
    u = rng.random(z.shape[0], dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)
    return int(np.argmax(z - np.log(-np.log(u))))
