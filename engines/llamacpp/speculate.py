"""Speculative decoding on the llama.cpp engine (``-o draft=PATH``, what ``--draft`` passes): the engine's ``spec``
part (None without a draft model), which owns the draft model (:class:`.draft.Drafter`) and its settings.

Each step, plain decoding feeds (one token, sampled with the native chain alone: no output constraint, logprobs or
``min_tokens``) of a batch no larger than ``draft_max_batch`` get up to ``n_draft`` tokens proposed by the draft
model (:class:`.draft.Drafter`). They ride in the same ``llama_decode`` as the rest of the batch, with logits at every
drafted position; the sequence's own sampler chain then samples position after position and stops at the first
sample that differs from the draft (or ends the sequence): every sample is kept, so a step yields 1 to ``n_draft + 1``
tokens, each sampled exactly as decoding without a draft would (greedy: the same tokens). KV of rejected drafts is
removed at once. The scheduler takes a list of tokens as consecutive steps, applying its stop, length and cancel rules
to each (``octo.scheduler.engine_loop``).
"""

from __future__ import annotations

import logging
from typing import Any

from octo.engine import Feed

from .draft import Drafter

log = logging.getLogger("octo.engines.llamacpp")

# drafting stops when the pool has fewer spare cells than this beyond the step's own tokens (never cause a KV-full)
ROOM_MARGIN = 32


class Speculation:
    """The draft model and the per-step drafting and verification (the engine calls :meth:`drafts` before its decode
    and :meth:`verify` for each drafted row after it)."""

    def __init__(self, drafter: Drafter, n_draft: int, max_batch: int, eog: frozenset[int]) -> None:
        self.drafter = drafter
        self.n_draft = n_draft
        self.max_batch = max_batch  # the most plain decoding feeds a step may have to be speculated
        self.eog = eog  # the target's end-of-generation tokens: verification stops at one

    @classmethod
    def load(cls, L: Any, opts: dict[str, Any], vocab: Any, eog: frozenset[int], *, max_batch: int, n_ctx: int,
             n_threads: int, repack: bool, n_batch: int) -> Speculation:
        """The draft model of ``opts["draft"]`` for a target of ``vocab`` (the same vocabulary is checked)."""
        n_draft = opts.get("n_draft", 4)
        drafter = Drafter(L, opts["draft"], vocab, n_draft=n_draft, max_batch=max_batch, n_ctx=n_ctx,
                          n_threads=n_threads, repack=repack, n_batch=n_batch, p_min=opts.get("draft_p_min", 0.75))
        return cls(drafter, n_draft, opts.get("draft_max_batch", 4), eog)

    def drafts(self, feeds: list[Feed], capacity: int, n_ctx_seq: int,
               kv_room: Any) -> list[list[int]] | None:
        """Draft tokens per feed (an empty list where none), or None when this step is not speculated. ``capacity``:
        the batch's tokens; ``kv_room()``: the pool's free cells (None: streams)."""
        plain = [i for i, f in enumerate(feeds) if f.sample and len(f.tokens) == 1 and f.mask is None
                 and f.logprobs < 0 and f.prompt_logprobs < 0 and not f.no_eos]
        if not plain or len(plain) > self.max_batch:
            return None
        spare = capacity - sum(len(f.tokens) for f in feeds)
        room = kv_room()
        if room is not None:
            spare = min(spare, room - sum(len(f.tokens) for f in feeds) - ROOM_MARGIN)
        want = [0] * len(feeds)
        for i in plain:
            seq = feeds[i].seq
            k = min(self.n_draft, n_ctx_seq - seq.n_cached - 2, spare)
            if k > 0:
                want[i] = k
                spare -= k
        if not any(want):
            return None
        rows = [i for i in range(len(feeds)) if want[i]]
        try:
            proposed = self.drafter.propose([(feeds[i].seq.slot.seq_id, feeds[i].seq.tokens) for i in rows],
                                            [want[i] for i in rows])
        except Exception as exc:  # noqa: BLE001 - the draft model failing (its KV full) costs speed, never a request
            log.warning("draft model failed (%s); this step decodes without it", exc)
            for i in rows:
                self.drafter.drop(feeds[i].seq.slot.seq_id)
            return None
        drafts: list[list[int]] = [[] for _ in feeds]
        for i, d in zip(rows, proposed, strict=True):
            drafts[i] = d
        return drafts

    def verify(self, f: Feed, ctx: Any, idx: int, draft: list[int]) -> list[int]:
        """Sample ``f``'s sequence at batch rows ``idx``, ``idx + 1``, ... of ``ctx`` (the rows of its last token and of
        each draft token) until a sample differs from the draft or ends the sequence; every sample is returned."""
        chain, eog = f.seq.slot.chain, self.eog
        out = []
        for j in range(len(draft) + 1):
            tok = chain.sample(ctx, idx + j)
            out.append(tok)
            if j == len(draft) or tok != draft[j] or tok in eog:
                break
        self.drafter.accepted += len(out) - 1
        return out

    def drop(self, seq_id: int) -> None:
        """The target's sequence ``seq_id`` is gone: so is its draft KV."""
        self.drafter.drop(seq_id)

    def set_threads(self, L: Any, n: int) -> None:
        L.llama_set_n_threads(self.drafter.ctx, n, n)

    def close(self) -> None:
        self.drafter.close()

    def stats(self) -> dict[str, Any]:
        """Draft tokens proposed and accepted so far."""
        d = self.drafter
        return {"n_draft": self.n_draft, "p_min": d.p_min, "proposed": d.proposed, "accepted": d.accepted,
                "acceptance": round(d.accepted / d.proposed, 4) if d.proposed else None}
