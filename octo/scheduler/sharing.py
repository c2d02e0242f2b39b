"""In-flight prefix deduplication: a prefix that several running requests share is computed once.

When a sequence starts, the engine loop looks for a running sequence (its *lead*) whose tokens share a longer prefix
with it than the prefix cache gave: agents fan out several conversations with the same long system prompt and tool
list, ``n > 1`` asks for several choices of one prompt. The new sequence (a *follower*) feeds nothing while the lead
computes the shared part (the lead's prompt goes first, its chunks end where a follower's share ends), then takes
those tokens' KV with ``Engine.kv_share``: llama.cpp's unified pool shares the cells themselves, other engines
copy a snapshot. If the lead leaves early (cancelled, failed, preempted), each follower takes what the lead had
computed and goes on by itself, or follows another sequence.

:class:`PrefixSharing` is a part of the engine loop (:class:`octo.scheduler.engine_loop.EngineLoop`); it runs on the
engine thread, and is given the engine and the loop's list of running sequences.
"""

from __future__ import annotations

import logging
from typing import Any

from octo.engine import Engine, common_prefix
from octo.scheduler.jobs import Ticket

log = logging.getLogger("octo.scheduler.admission")
__all__ = ["MIN_SHARE", "PrefixSharing", "common_prefix"]

# Fewer shared tokens than this are computed rather than waited for.
MIN_SHARE = 32


class PrefixSharing:
    """Leads and followers among the running sequences ``active`` (the engine loop's list, read here; the loop and
    the KV-pressure part move sequences in and out). ``dedup`` turns itself off for good when the engine cannot
    share."""

    def __init__(self, engine: Any, active: list[Ticket], dedup: bool = True) -> None:
        self.engine = engine
        self.active = active
        self.dedup = dedup
        # an engine without kv_drop (ONNX Runtime's) cannot replace the KV a sequence restored from the prefix cache
        # with a lead's: such a sequence computes the rest itself
        self.can_drop = getattr(type(engine), "kv_drop", Engine.kv_drop) is not Engine.kv_drop
        self.total_shared_tokens = 0

    def find_lead(self, t: Ticket) -> None:
        """``t`` just started (or lost its lead): follow the running sequence sharing the longest prefix with it, when
        that is at least ``MIN_SHARE`` tokens more than ``t`` holds."""
        seq = t.seq
        if not self.dedup or (seq.n_cached and not self.can_drop):
            return
        limit = len(seq.tokens) - 1  # the last prompt token is always fed, for the logits
        best, best_n = None, seq.n_cached + MIN_SHARE - 1
        if limit <= best_n:  # a prompt this short shares too little with anyone to follow (and most prompts are)
            return
        for a in self.active:
            if a is t or a.lead is not None or a.seq.sampling.adapter != seq.sampling.adapter:
                continue  # (KV computed with another LoRA adapter is not shared)
            n = common_prefix(a.seq.tokens, seq.tokens, limit)
            if n > best_n:
                best, best_n = a, n
        if best is not None:
            t.lead, t.lead_n = best, best_n

    def join_leads(self) -> None:
        """Followers whose lead has computed their shared prefix take it."""
        for t in self.active:
            a = t.lead
            if a is not None and a.seq.n_cached >= t.lead_n:
                t.lead = None
                self._share(t, a, t.lead_n)

    def release_followers(self, a: Ticket) -> None:
        """``a`` leaves the batch or gives its KV back: its followers take what it has computed, then follow another
        sequence or compute the rest themselves. Call while ``a`` still holds its KV."""
        followers = [t for t in self.active if t.lead is a]
        for t in followers:
            t.lead = None
            n = min(t.lead_n, a.seq.n_cached)
            if n >= t.seq.n_cached + MIN_SHARE:
                self._share(t, a, n)
        for t in followers:
            if t.state == "active":
                self.find_lead(t)

    def lead_stop(self, a: Ticket) -> int | None:
        """Where ``a``'s next chunk should end so that its nearest follower can join after the step."""
        n = a.seq.n_cached
        stops = [t.lead_n for t in self.active if t.lead is a and t.lead_n > n]
        return min(stops) if stops else None

    def _share(self, t: Ticket, a: Ticket, n: int) -> None:
        seq = t.seq
        eng = self.engine
        try:
            if seq.n_cached:
                eng.kv_drop(seq)
                seq.n_cached = 0
            eng.kv_share(a.seq, seq, n)
        except Exception:  # noqa: BLE001 - it computes the prefix itself
            log.exception("sharing %d prefix tokens failed; computing them", n)
            try:
                eng.kv_drop(seq)
            except Exception:  # noqa: BLE001
                log.exception("kv_drop after a failed share")
            seq.n_cached = 0
            self.dedup = False  # an engine that cannot share once will not share later
            return
        if seq.n_cached == 0:  # the engine could not share (no snapshots): stop waiting for leads
            self.dedup = False
            return
        t.cached = seq.n_cached
        self.total_shared_tokens += seq.n_cached
