"""Speculative decoding on the llama.cpp engine (``-o draft=PATH``, what ``--draft`` passes): a mixin of
:class:`.engine.LlamaCppEngine`.

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

log = logging.getLogger("octo.engines.llamacpp")

# drafting stops when the pool has fewer spare cells than this beyond the step's own tokens (never cause a KV-full)
ROOM_MARGIN = 32


class Speculation:
    drafter: Any = None
    n_draft: int = 4
    draft_max_batch: int = 4

    def _drafts(self, feeds: list[Feed]) -> list[list[int]] | None:
        """Draft tokens per feed (an empty list where none), or None when this step is not speculated."""
        plain = [i for i, f in enumerate(feeds) if f.sample and len(f.tokens) == 1 and f.mask is None
                 and f.logprobs < 0 and f.prompt_logprobs < 0 and not f.no_eos]
        if not plain or len(plain) > self.draft_max_batch:
            return None
        spare = self.batch.capacity - sum(len(f.tokens) for f in feeds)
        room = self.kv_room()
        if room is not None:
            spare = min(spare, room - sum(len(f.tokens) for f in feeds) - ROOM_MARGIN)
        want = [0] * len(feeds)
        for i in plain:
            seq = feeds[i].seq
            k = min(self.n_draft, self.n_ctx_seq - seq.n_cached - 2, spare)
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

    def _verify(self, f: Feed, idx: int, draft: list[int]) -> list[int]:
        """Sample ``f``'s sequence at batch rows ``idx``, ``idx + 1``, ... (the rows of its last token and of each
        draft token) until a sample differs from the draft or ends the sequence; every sample is returned."""
        chain, eog = f.seq.slot.chain, self.info.eos_token_ids
        out = []
        for j in range(len(draft) + 1):
            tok = chain.sample(self.ctx, idx + j)
            out.append(tok)
            if j == len(draft) or tok != draft[j] or tok in eog:
                break
        self.drafter.accepted += len(out) - 1
        return out

    def _load_draft(self, L: Any) -> None:
        from .draft import Drafter

        self.n_draft = self.opts.get("n_draft", 4)
        self.draft_max_batch = self.opts.get("draft_max_batch", 4)
        self.drafter = Drafter(L, self.opts["draft"], self.vocab, n_draft=self.n_draft,
                               max_batch=self.config.max_batch, n_ctx=self.n_ctx_seq, n_threads=self.n_threads,
                               repack=self.repack, n_batch=self.n_batch, p_min=self.opts.get("draft_p_min", 0.75))

    def _close_draft(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None

    def draft_stats(self) -> dict[str, Any] | None:
        """Draft tokens proposed and accepted so far (None without a draft model)."""
        d = self.drafter
        if d is None:
            return None
        return {"n_draft": self.n_draft, "p_min": d.p_min, "proposed": d.proposed, "accepted": d.accepted,
                "acceptance": round(d.accepted / d.proposed, 4) if d.proposed else None}
