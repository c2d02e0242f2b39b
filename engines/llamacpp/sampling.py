"""One native llama.cpp sampler chain per sequence, built from the request's SamplingParams.

Order as in llama.cpp's common sampler: logit bias, penalties, then top-k, top-p, min-p, temperature and the final
pick (greedy or seeded dist). Samplers left at their "off" value are not added, so a plain greedy chain is just
``greedy``. Output constraints are not the chain's business: the engine sets the forbidden logits to -inf before
the chain runs (``Feed.mask``, :mod:`.logits`), and every sampler here keeps -inf at -inf.

A greedy chain without penalties picks ``argmax(logits + logit_bias)``, the first of equal maxima, as llama.cpp's
greedy sampler does. That pick is read straight from llama.cpp's logits row (numpy) instead of through
``llama_sampler_sample``, which first copies all n_vocab candidates: 11 us instead of 160 us a token at a 151,936
vocabulary on a 2-core host, per sequence and step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from octo.engine import SamplingParams
from octo.errors import InvalidRequest

from .logits import logits_row
from .native import bindings

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama_sampler_init_dist: draw a random seed


class SamplerChain:
    """Owns a ``llama_sampler`` chain (freed with :meth:`close`)."""

    def __init__(
        self,
        n_vocab: int,
        p: SamplingParams,
        penalty_last_n: int = 64,
        history: list[int] | None = None,
    ) -> None:
        L = bindings()
        self._L = L
        self.n_vocab = n_vocab
        self.argmax: tuple[np.ndarray, np.ndarray] | None = None  # (token ids, biases): the pick is a plain argmax
        self.ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        try:
            self._build(n_vocab, p, penalty_last_n, history or [])
        except BaseException:
            self.close()
            raise

    def _add(self, sampler) -> int:
        self._L.llama_sampler_chain_add(self.ptr, sampler)
        return self._L.llama_sampler_chain_n(self.ptr) - 1

    def _build(self, n_vocab, p, penalty_last_n, history) -> None:
        import numpy as np
        L = self._L
        if p.logit_bias:
            arr = (L.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias.items()):
                tok = int(tok)
                if not 0 <= tok < n_vocab:
                    raise InvalidRequest(
                        f"logit_bias token {tok} is outside the vocabulary (0..{n_vocab - 1}).", param="logit_bias"
                    )
                arr[i].token = tok
                # finite on purpose: a ban that the output constraint overrides (e.g. EOS when the JSON is
                # complete, every other token masked to -inf) must leave a finite logit to pick
                arr[i].bias = float(bias)
            self._add(L.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), arr))
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        if penalised:
            if p.repetition_penalty <= 0:
                raise InvalidRequest("repetition_penalty must be > 0.", param="repetition_penalty")
            idx = self._add(
                L.llama_sampler_init_penalties(
                    n_vocab, penalty_last_n, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
                )
            )
            penalties = L.llama_sampler_chain_get(self.ptr, idx)
            for tok in history[-penalty_last_n:] if penalty_last_n > 0 else []:
                if tok >= 0:  # (an image's positions hold placeholders, no tokens)
                    L.llama_sampler_accept(penalties, tok)  # the prompt counts, as in llama-server
        if p.greedy:
            self._add(L.llama_sampler_init_greedy())
            ids = np.array([int(tok) for tok in p.logit_bias or {}], np.int64)
            bias = np.array(list((p.logit_bias or {}).values()), np.float32)
            # ("5" and "05" are two biases on one token, added in turn; an infinite one can make a NaN)
            if not penalised and len(np.unique(ids)) == len(ids) and np.isfinite(bias).all():
                self.argmax = (ids, bias)
            return
        if p.temperature < 0:
            raise InvalidRequest("temperature must be >= 0.", param="temperature")
        if p.top_k > 0:
            self._add(L.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            self._add(L.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            self._add(L.llama_sampler_init_min_p(p.min_p, 1))
        self._add(L.llama_sampler_init_temp(p.temperature))
        seed = LLAMA_DEFAULT_SEED if p.seed is None else int(p.seed) & 0xFFFFFFFF
        self._add(L.llama_sampler_init_dist(seed))

    def sample(self, ctx, idx: int) -> int:
        """Sample from the logits of batch position ``idx`` and accept the token into the chain."""
        if self.argmax is not None:
            row = logits_row(self._L, ctx, idx, self.n_vocab)
            ids, bias = self.argmax
            saved = row[ids]
            row[ids] += bias  # llama.cpp's buffer, restored at once: nothing else reads this row meanwhile
            tok = int(row.argmax())
            top = row[tok]
            row[ids] = saved
            if not math.isnan(top):  # (numpy's argmax picks a NaN, llama.cpp's greedy does not: it decides then)
                return tok
        return self._L.llama_sampler_sample(self.ptr, ctx, idx)

    def close(self) -> None:
        if self.ptr:
            self._L.llama_sampler_free(self.ptr)
            self.ptr = None
