"""The KV layout follows the load: the unified pool, or per-sequence streams while the traffic is many short sequences.

Neither layout wins everywhere (:mod:`.layout`). The unified pool shares prefixes without copies and lets any one
sequence grow to the full context, but ggml's CPU flash attention walks every cell in use for each decode row,
skipping the other sequences' cells one by one: with 16 short streams each row walks ~2,600 cells to attend over its
own ~160 (octo's default decoded 0.94x llama-server's tok/s at 16 streams, 1.00x with streams). Streams of the full
context cost ``max_batch`` times the memory (6.4 GB for 16 x 32,768 cells of a 0.5B model), which is why the default
is the pool.

So a model served from the unified pool may run its **short traffic in streams of the same memory**: ``max_batch``
streams of ``cells = pool // max_batch`` each (2,048 for that model). The layout changes only between bursts of
traffic, when no sequence runs: a *busy period* runs from the first sequence added after an idle moment to the last
one removed, and the next one starts in streams when the last one ran several sequences at once (``peak >= 2``), each
within ``HEADROOM`` of a stream (``longest <= cells / 2``), sharing little of its prompts (``reused <= prompt / 2``:
shared prefixes are what the pool does best), and the first prompt of the new one fits too; any other period starts
in the pool. A stream that would overflow (a sequence grows past its cells, a long prompt arrives) moves every running
sequence into a new unified context at once (``llama_state_seq`` snapshots, copied back to the same sequence ids:
the KV, hence the text, is unchanged) and the period goes on there. A switch costs a context build (about 0.2 s for
that model) plus the copies; idle prefix-cache entries leave the pool for RAM snapshots first
(:meth:`.kvcache.KVCells.demote_idle`).

:class:`AdaptiveLayout` is the engine's ``layout`` part: the verdicts of both probes (``verdicts``, shown as
``kv_layout``), the policy (``policy``, None while off) and the switch (:meth:`AdaptiveLayout.relayout`). It asks the
engine (:class:`LayoutHost`) for a new context and the KV cells part for the copies.

Whether streams pay for short traffic on this host is measured while the model is idle (:func:`probe` from
:mod:`.background`; cached like the layout's verdict, off until then): ``max_batch`` sequences of ``PREFIX`` cells
each decode ``DECODE`` steps in each layout; streams must take at most ``MARGIN`` of the pool's time a step. ``-o
kv_adapt=true`` skips the probe, ``false`` turns this off; it applies only where the pool was chosen (``kv_unified``
auto, or true). With ``--max-batch`` of ``DEFAULT_ON_BATCH`` (16) or more it is on until the probe concludes, and a
probe that concludes "no" turns it off.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from octo.engine import Feed, ModelInfo, SamplingParams, Sequence
from octo.errors import EngineError

from . import layout
from .background import check as _check
from .background import retry_at as _retry
from .kvcache import KVCells

log = logging.getLogger("octo.engines.llamacpp")

HEADROOM = 0.5  # a period whose sequences stayed within this share of a stream may run in streams
MIN_CELLS = 256  # smaller streams are not worth a switch
PREFIX, DECODE, REPS = 192, 8, 3
MARGIN = 1.0  # streams at least as fast as the pool a step: the probe is the pool's best case (its cells contiguous)
# From this many sequences a step the adaptation is on until the probe concludes otherwise: the pool's waste grows with
# them (each row walks every sequence's cells), and at 16 the probe seldom concludes on a busy host while 16 short
# streams decoded 0.93x llama-server's tok/s from the pool and 1.06x in streams (bench/paired.py, 6 of 6 rounds ahead)
DEFAULT_ON_BATCH = 16
BUDGET_S = 6.0
VERSION = 2  # of the probe (part of its cache key)


class Adaptive:
    """The switching policy and its counters (the switch itself: :meth:`AdaptiveLayout.relayout`)."""

    def __init__(self, cells: int, verdict: dict[str, Any]) -> None:
        self.cells = cells
        self.verdict = verdict
        self.switches = 0
        self.forced = 0
        self.period: dict[str, int] | None = None  # the busy period under way
        self.last: dict[str, int] | None = None  # the last one that ended

    def opening(self, n_active: int, n_prompt: int, unified: bool) -> bool | None:
        """A sequence of ``n_prompt`` tokens is added beside ``n_active`` running ones: the layout it needs (True: the
        pool), or None to keep the current one."""
        if not unified and n_prompt + 1 > self.cells:
            return True  # it cannot fit a stream, whatever runs
        if n_active:
            return None
        last = self.last
        if n_prompt + 1 > HEADROOM * self.cells:
            return True
        if last is None or last["peak"] < 2:
            return None  # one sequence at a time: the layouts cost the same
        short = last["longest"] <= HEADROOM * self.cells and 2 * last["reused"] <= last["prompt"]
        return not short

    def added(self, n_active: int, n_prompt: int) -> None:
        p = self.period
        if p is None:
            p = self.period = {"peak": 0, "longest": 0, "prompt": 0, "reused": 0, "sequences": 0}
        p["peak"] = max(p["peak"], n_active)
        p["prompt"] += n_prompt
        p["sequences"] += 1
        p["longest"] = max(p["longest"], n_prompt)

    def reused(self, n_tokens: int) -> None:
        if self.period is not None:
            self.period["reused"] += n_tokens

    def removed(self, n_tokens: int, n_active: int) -> None:
        p = self.period
        if p is None:
            return
        p["longest"] = max(p["longest"], n_tokens)
        if n_active == 0:
            self.last, self.period = p, None

    def overflows(self, feeds: list[Feed], extra: int) -> bool:
        """Whether a step would take a sequence past its stream (``extra``: the draft tokens it may add)."""
        return any(f.seq.n_cached + len(f.tokens) + extra + 1 > self.cells for f in feeds)


def setup(engine: Any, pool: int) -> tuple[Adaptive | None, dict[str, Any] | None]:
    """The policy for an engine serving from a unified pool of ``pool`` cells (None: off, or not worth it) and the
    verdict it follows (None: off)."""
    choice = engine.opts.get("kv_adapt", "auto")
    cells = min(engine.n_ctx_seq, pool // max(1, engine.config.max_batch))
    if choice == "false" or engine.is_embedding or engine.config.max_batch < 2 or not engine.kv_unified:
        return None, None
    if not engine.plain_kv:  # sliding-window or recurrent memory: snapshots cannot move between layouts (.kvcache)
        return None, None
    if cells < MIN_CELLS:
        return None, None
    if choice == "true":
        verdict = {"source": "option"}
        return Adaptive(cells, verdict), verdict
    if layout.given(engine) is not None:  # the user (or the environment) fixed the layout
        return None, None
    record = layout.read_record(_cache_path(engine, cells))
    if record is not None and not record.get("disturbed") and "pays" in record:
        verdict = {**record, "cached": True}
        return (Adaptive(cells, verdict) if verdict["pays"] else None), verdict
    attempts = record.get("attempts", 0) if record else 0
    verdict = {"source": "off until the short-traffic probe concludes in the background", "pending": True,
               "cells": cells, "attempts": attempts, "retry_at": record.get("retry_at", 0.0) if record else 0.0}
    if engine.config.max_batch >= DEFAULT_ON_BATCH:
        verdict["source"] = (f"on (--max-batch >= {DEFAULT_ON_BATCH}) until the short-traffic probe concludes in the "
                             "background")
        return Adaptive(cells, verdict), verdict
    return None, verdict


def _cache_path(engine: Any, cells: int) -> Any:
    return layout.cache_file(engine, engine.n_ctx_opt, engine.cell_bytes, f"adapt-{cells}-v{VERSION}")


def measure(engine: Any, cells: int, attempts: int = 0) -> tuple[Adaptive | None, dict[str, Any]]:
    """Run :func:`probe` on the idle engine (from the pool, back to it after) and record the verdict: cached when
    undisturbed, else noted with the time of the next try. ProbeInterrupted (:mod:`.background`) passes through."""
    from octo.benchload import LoadMonitor

    from .background import ProbeInterrupted, drop_leftovers, retry_at

    before = set(engine.active)
    mon = LoadMonitor().start()
    try:
        verdict = probe(engine, cells)
    except ProbeInterrupted:
        raise
    except Exception as exc:  # noqa: BLE001 - a probe that fails costs the adaptation, never the serving
        log.warning("llamacpp: the short-stream layout probe failed (%s: %s); the pool stays", type(exc).__name__, exc)
        return None, {"source": f"probe failed ({type(exc).__name__}: {exc})", "pays": False}
    finally:
        drop_leftovers(engine, before)
        engine.layout.relayout(True)
    conditions = mon.stop()
    verdict["disturbed"] = conditions["disturbed"]
    log.debug("llamacpp: short traffic in streams: %s (a step: pool %.4f s, streams %.4f s%s)",
              "yes" if verdict["pays"] else "no", verdict["unified_step_s"], verdict["streams_step_s"],
              "; disturbed by other processes, not followed" if conditions["disturbed"] else "")
    path = _cache_path(engine, cells)
    if conditions["disturbed"]:
        layout.write_record(path, {"disturbed": True, "attempts": attempts + 1, "retry_at": retry_at(attempts + 1),
                                   "verdict": verdict})
        return None, {"source": "off: the short-traffic probe was disturbed by other processes", "pending": True,
                      "cells": cells, "attempts": attempts + 1, "retry_at": retry_at(attempts + 1), "last": verdict}
    layout.write_record(path, verdict)
    return (Adaptive(cells, verdict) if verdict["pays"] else None), verdict


def probe(engine: Any, cells: int) -> dict[str, Any]:
    """Seconds of a step of ``max_batch`` sequences of distinct short contexts decoding together, in the pool and in
    streams of ``cells``. A prefix is computed once in each layout (untimed) and copied into every sequence (a
    snapshot: distinct cells); the first decode step of each run is untimed. A model whose steps are slow gets fewer
    of them (``BUDGET_S``)."""
    n = engine.config.max_batch
    vocab = max(2, engine.n_vocab - 1)
    prefix = min(PREFIX, cells // 2)
    times: dict[bool, list[float]] = {True: [], False: []}
    steps = DECODE
    t_start = time.perf_counter()
    snaps: dict[bool, Any] = {}  # the prefix, computed once in each layout
    for rep in range(REPS):
        for unified in (True, False) if rep % 2 == 0 else (False, True):
            engine.layout.relayout(unified, cells)
            if unified not in snaps:
                snaps[unified] = _prefix(engine, [(13 * i + 7) % vocab for i in range(prefix + 1)], prefix)
            snap = snaps[unified]
            run = [Sequence(810_001 + k, [*snap.tokens, (17 * k + 3) % vocab], SamplingParams(temperature=0.0))
                   for k in range(n)]
            try:
                for s in run:
                    engine.add_sequence(s)
                    engine.kv_restore(s, snap, prefix)
                    if s.n_cached != prefix:
                        raise RuntimeError("the probe's prefix was not restored")
                outs = _check(engine.step([Feed(s, s.tokens[s.n_cached:], True) for s in run]))
                t0 = time.perf_counter()
                for _ in range(steps):
                    for s, out in zip(run, outs, strict=True):
                        s.tokens.append(out)
                    outs = _check(engine.step([Feed(s, s.tokens[-1:], True) for s in run]))
                took = time.perf_counter() - t0
                times[unified].append(took / steps)  # per step: a slow model's later runs take fewer
                if took > BUDGET_S / (2 * REPS):
                    steps = max(2, int(steps * BUDGET_S / (2 * REPS) / took))
            finally:
                for s in run:
                    engine.remove_sequence(s)
    unified_s, streams_s = min(times[True]), min(times[False])
    return {"source": "measured", "pays": streams_s <= MARGIN * unified_s, "unified_step_s": round(unified_s, 5),
            "streams_step_s": round(streams_s, 5), "streams_over_unified": round(streams_s / unified_s, 3),
            "probe": {"seqs": n, "prefix": prefix, "decode": steps},
            "probe_seconds": round(time.perf_counter() - t_start, 2)}


def _prefix(engine: Any, tokens: list[int], prefix: int) -> Any:
    """A snapshot of ``prefix`` tokens computed in the engine's current context."""
    lead = Sequence(810_000, tokens, SamplingParams(temperature=0.0))
    engine.add_sequence(lead)
    try:
        while lead.n_cached < prefix:
            part = lead.tokens[lead.n_cached:min(prefix, lead.n_cached + min(engine.prefill_chunk,
                                                                              layout.PREFIX_STEP))]
            _check(engine.step([Feed(lead, part, False)]))
        snap = engine.cells.snapshot(lead)
    finally:
        engine.remove_sequence(lead)
    if snap is None:
        raise RuntimeError("no snapshot of the probe's prefix")
    return snap


class LayoutHost(Protocol):
    """What :class:`AdaptiveLayout` needs of the engine (the probes drive it through its public serving methods)."""

    kv_unified: bool
    kv_cells: int
    stream_cells: int | None  # cells of each stream (None: the pool)
    active: dict[int, Sequence]
    n_ctx_opt: int
    cell_bytes: int
    info: ModelInfo | None
    cells: KVCells

    def rebuild_context(self, unified: bool, stream_cells: int | None) -> None:
        """Serve from a new context of that layout; running sequences keep their slots (not their KV)."""


class AdaptiveLayout:
    """The engine's KV layout part: verdicts, the short-traffic policy and the layout switch."""

    def __init__(self, host: LayoutHost) -> None:
        self.host = host
        self.policy: Adaptive | None = None  # short traffic in streams (None: off)
        self.verdicts: dict[str, Any] = {}  # how the layout was chosen, and the adaptation's verdict under "adapt"

    def start(self, verdicts: dict[str, Any]) -> None:
        """The load chose the layout (``verdicts``: how, :func:`.layout.decide`) and built its context: set up the
        short-traffic policy from the pool's size."""
        self.verdicts = verdicts
        self.policy, verdict = setup(self.host, self.host.kv_cells)  # short traffic in streams of the same memory
        if verdict is not None:
            verdicts["adapt"] = verdict

    def describe(self) -> dict[str, Any]:
        """``kv_layout`` of the model's info."""
        return {"chosen": "unified" if self.host.kv_unified else "streams", **self.verdicts}

    def conclude_probe(self, kind: str) -> None:
        """Run the pending ``kind`` probe ("layout", "adapt") to its end and follow a verdict that concludes."""
        lay, host = self.verdicts, self.host
        if kind == "layout":
            adapt, self.policy = self.policy, None  # the probe's switches are not the policy's
            try:
                unified, verdict = layout.measure(host, host.n_ctx_opt, host.cell_bytes, lay.get("attempts", 0))
            finally:
                self.policy = adapt
            adapt_verdict = lay.get("adapt")
            if verdict.get("disturbed"):
                lay.update(attempts=lay.get("attempts", 0) + 1, retry_at=_retry(lay.get("attempts", 0) + 1),
                           last=verdict)
                return
            lay.clear()
            lay.update(verdict)
            if unified and adapt_verdict is not None:
                lay["adapt"] = adapt_verdict
            elif not unified:
                lay["next_load"] = "streams"  # a stream holds less context than the pool: from the next load on
            log.info("llamacpp: KV layout measured: %s", "the unified pool" if unified else
                     "streams, from the next load of this model")
        else:
            before, self.policy = self.policy, None  # (as above: the probe switches the layout itself)
            cells = lay["adapt"]["cells"]
            try:
                policy, verdict = measure(host, cells, lay["adapt"].get("attempts", 0))
            finally:
                self.policy = before
            if verdict.get("pending") and before is not None:  # disturbed: the default stays on, tried again later
                policy, verdict = before, {**verdict, "source": lay["adapt"]["source"]}
            self.policy, lay["adapt"] = policy, verdict
        if host.info is not None:
            host.info.extra["kv_layout"] = self.describe()

    # -- the engine's hooks ----------------------------------------------------------------------------------
    def before_add(self, seq: Sequence) -> None:
        """Before ``seq`` takes a slot: the layout its busy period wants (or a stream it cannot fit)."""
        host = self.host
        want = self.policy.opening(len(host.active), len(seq.tokens), host.kv_unified)
        if want is not None and want != host.kv_unified:
            self.relayout(want, forced=bool(host.active))

    def before_step(self, feeds: list[Feed], extra: int) -> None:
        """Before a step (``extra``: the draft tokens a row may add): a sequence that would outgrow its stream moves
        everything to the pool."""
        if not self.host.kv_unified and self.policy.overflows(feeds, extra):
            self.relayout(True, forced=True)

    def added(self, n_active: int, n_prompt: int) -> None:
        if self.policy is not None:
            self.policy.added(n_active, n_prompt)

    def removed(self, n_tokens: int, n_active: int) -> None:
        if self.policy is not None:
            self.policy.removed(n_tokens, n_active)

    def reused(self, n_tokens: int) -> None:
        if self.policy is not None:
            self.policy.reused(n_tokens)

    def stats(self) -> dict[str, Any]:
        """The live numbers of ``Engine.kv_stats`` (plain attributes: called from another thread; a period that ended
        is never changed again). ``last_period``: what the policy saw of the last busy period (``peak`` sequences at
        once, ``longest``, ``prompt`` and ``reused`` tokens, ``sequences``), which decides the next one's layout."""
        adapt = self.policy
        return {"adaptive": adapt is not None, "stream_cells": adapt.cells if adapt is not None else None,
                "layout_switches": adapt.switches if adapt is not None else 0,
                "forced_switches": adapt.forced if adapt is not None else 0,
                "last_period": dict(adapt.last) if adapt is not None and adapt.last is not None else None}

    # -- the switch --------------------------------------------------------------------------------------------
    def relayout(self, unified: bool, cells: int | None = None, forced: bool = False) -> None:
        """Serve from a new context with the other layout (streams: of ``cells`` each, default the policy's), keeping
        every running sequence: its KV is copied out (``llama_state_seq_get_data``) and back into the same sequence
        id."""
        host = self.host
        if unified == host.kv_unified:
            return
        kv = host.cells
        t0 = time.perf_counter()
        snaps = []
        for sid, seq in host.active.items():
            if seq.n_cached > 0:
                snap = kv.snapshot_id(sid, seq.n_cached)
                if snap is None:
                    raise EngineError(f"moving sequence {seq.id} to a new KV layout failed (no snapshot)")
                snaps.append((sid, seq, snap))
        if kv.entries:  # cached entries leave the pool's cells for RAM snapshots (the new context has none)
            kv.demote_idle(bound=0)
        before = host.stream_cells  # the current context's (None: the pool)
        if not unified and cells is None:
            cells = self.policy.cells
        try:
            self._rebuild(unified, cells, snaps)
        except Exception as exc:  # (a context it cannot build): back to the one it had, and no more switching
            self._rebuild(not unified, before, snaps)
            log.warning("llamacpp: switching the KV layout failed (%s: %s); staying with the %s", type(exc).__name__,
                        exc, "streams" if unified else "unified pool")
            self.policy = None
            if forced:
                raise EngineError(f"a sequence outgrew its KV stream and the unified pool could not be built: {exc}") \
                    from exc
            return
        if self.policy is not None:
            self.policy.switches += 1
            self.policy.forced += forced
            log.info("llamacpp: KV layout now %s (%s%d running sequences moved, %.3f s)",
                     "the unified pool" if unified else f"streams of {cells} cells",
                     "forced: a sequence outgrew its stream; " if forced else "", len(snaps), time.perf_counter() - t0)

    def _rebuild(self, unified: bool, cells: int | None, snaps: list) -> None:
        self.host.rebuild_context(unified, None if unified else cells)
        kv = self.host.cells
        for sid, seq, snap in snaps:
            if not kv.put_back(sid, snap, seq.n_cached):
                raise EngineError(f"moving sequence {seq.id} ({seq.n_cached} tokens) to a new KV layout failed")
