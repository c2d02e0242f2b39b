"""The feeds of one engine step (engine thread): decode tokens first, then prompt chunks.

:class:`Planner` is a part of :class:`octo.scheduler.engine_loop.EngineLoop` (``sched.planner``), given the engine,
the running list, the pacer, the prefix-sharing part and the queue (read only: the pacer looks at its length). A
prompt chunk never crosses the start of a media item (an image) and an item goes whole, once its encode is done
(:func:`octo.scheduler.media.take`).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from octo.engine import Feed
from octo.scheduler.jobs import Ticket
from octo.scheduler.media import in_media, take
from octo.scheduler.pacer import Pacer, work_left
from octo.scheduler.sharing import PrefixSharing


class Planner:
    def __init__(self, engine: Any, active: list[Ticket], pacer: Pacer, sharing: PrefixSharing,
                 queued: Sized) -> None:
        self.engine = engine
        self.active = active
        self.pacer = pacer
        self.sharing = sharing
        self.queued = queued

    def plan(self, n_ctx: int, spare: int) -> tuple[list[Feed], list[Ticket]]:
        """This step's feeds and the ticket of each: decode tokens first (one per sequence), then prompt chunks within
        the engine's prefill budget, the pacer's and the ``spare`` KV cells."""
        eng = self.engine
        feeds: list[Feed] = []
        owners: list[Ticket] = []  # the ticket of each feed
        prefilling: list[Ticket] = []
        for t in self.active:
            seq = t.seq
            remaining = len(seq.tokens) - seq.n_cached
            if remaining == 1 and not (seq.media and in_media(seq)):
                feeds.append(Feed(seq, seq.tokens[-1:], True))
                owners.append(t)
            elif remaining > 0 and t.lead is None:  # a follower waits for its lead's prefix (octo.scheduler.sharing)
                prefilling.append(t)
        budget = 1 << 30 if eng.batching == "window" else max(eng.prefill_chunk, 1)
        paced, least, leads = budget, None, set()
        if prefilling and eng.batching != "window":
            leads = {id(t.lead) for t in self.active if t.lead is not None}
            prefilling.sort(key=lambda t: (id(t) not in leads, work_left(t, n_ctx)))  # a shared prefix first
            budget, paced, least = self.pacer.plan(budget, owners, prefilling, n_ctx, self.queued)
        budget = min(budget, spare)  # under KV pressure a prompt chunk takes only the cells left over
        n_decode = len(feeds)
        for t in prefilling:
            if budget <= 0:
                break
            seq = t.seq
            remaining = len(seq.tokens) - seq.n_cached
            cap = budget if least is None or remaining <= least else min(budget, paced)
            if cap <= 0:
                continue
            n = min(remaining, cap)
            if leads and id(t) in leads:  # end the chunk where a follower can join
                stop = self.sharing.lead_stop(t)
                if stop is not None:
                    n = min(n, stop - seq.n_cached)
            item = None
            if seq.media:  # text up to an image, an encoded image whole (octo.scheduler.media)
                n, item = take(seq, n, budget, len(feeds) == n_decode)
                if not n:
                    continue
            budget -= n
            paced -= n
            feeds.append(Feed(seq, seq.tokens[seq.n_cached:seq.n_cached + n], n == remaining, media=item))
            owners.append(t)
        return feeds, owners
