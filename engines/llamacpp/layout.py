"""Which KV layout serves this model faster on this host: measured while the model is idle, cached per host and load.

llama.cpp offers two layouts, fixed for a context's life:

* **unified** (``kv_unified=true``): one pool of cells for all sequences. Sequences that share a prefix share its
  cells (no copy, no recompute), but every decode row attends over the cells in use up to the last one, its
  neighbours' included (measured in process: 4 x 2,000 distinct tokens decode 0.87-0.89x as fast as in streams).
* **streams** (``kv_unified=false``): a stream of ``n_ctx`` cells per sequence. A sequence attends only over its own
  cells; a shared prefix is copied into each stream (a ``llama_state_seq`` snapshot), and the pool is
  ``max_batch x n_ctx`` cells whatever the load.

Which is faster depends on the model (attention's share of a step), the host and the thread count, so when the user
does not set ``kv_unified`` the engine times both, on its serving contexts, through its own serving paths
(:meth:`kv_save`, :meth:`kv_restore`, :meth:`step`). A prefix of ``PREFIX`` tokens is computed once (the same work in
either layout, untimed) and kept as a prefix-cache entry; then, ``REPS`` times, an agent-shaped probe (``SEQS``
sequences take the prefix, each adds ``OWN`` tokens of its own history, they decode ``DECODE`` tokens together) and a
solo one (one sequence takes it and decodes ``SOLO`` tokens alone: the short-stream case). Each probe's best
repetition counts, and streams must beat unified by ``MARGIN`` on both (unified keeps the memory bound and
KV-pressure preemption; a choice made on noise would cost more than it saves). Streams are not tried when their pool
would take more than ``MEMORY_SHARE`` of the available memory, nor for one sequence (the layouts are then the same).
The verdict is cached under ``OCTO_HOME/probe`` keyed by the
host, the llama.cpp build, the GGUF and every setting the timing depends on. The load itself never measures
(:func:`decide`): without a cached verdict the model serves from the unified pool and :func:`measure` runs when it is
idle (:mod:`.background`); a measurement disturbed by other processes (``octo.benchload``) is not followed, only
recorded with the time of its next try.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from octo.benchload import available_memory, cpu_flags
from octo.engine import Feed, SamplingParams, Sequence
from octo.paths import octo_home

from .background import check as _check
from .native import version

log = logging.getLogger("octo.engines.llamacpp")
SEQS, PREFIX, OWN, DECODE = 4, 384, 48, 16
SOLO = 16  # decode steps of one sequence alone (the short-stream case)
REPS = 2
PREFIX_STEP = 64  # tokens of the untimed shared prefix a step (each step ends with an interruption check)
BUDGET_S = 8.0  # the probe's work on a model whose prefill is fast enough; scaled down for slower ones
DECODE_COST = 4.0
MARGIN = 0.95  # streams must take at most 95% of unified's time, on both probes
MEMORY_SHARE = 0.25
ENV = "OCTO_LLAMACPP_KV_UNIFIED"  # the default of -o kv_unified for this process (the test suite pins it)


def cache_file(engine: Any, n_ctx: int, cell_bytes: int, kind: str = "layout") -> Path:
    st = os.stat(engine.artifact_path)
    parts = [cpu_flags(), version(), os.path.realpath(engine.artifact_path), st.st_size, st.st_mtime_ns,
             n_ctx, engine.config.max_batch, engine.n_threads, engine.opts.get("flash_attn", "auto"),
             engine.opts.get("cache_type", "f16"), engine.prefill_chunk, engine.repack, engine.opts.get("lora"),
             cell_bytes, 5]  # the last: this probe's version
    key = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:20]
    return octo_home() / "probe" / f"llamacpp-{kind}-{key}.json"


def given(engine: Any) -> tuple[bool, dict[str, Any]] | None:
    """The layout when the user (option, environment) or the load's shape decides it; None: measure."""
    choice = engine.opts.get("kv_unified", "auto")
    if choice != "auto":
        return choice == "true", {"source": "option"}
    env = os.environ.get(ENV, "").strip()
    if env and env.lower() != "auto":
        from octo.errors import ConfigError
        from octo.options import auto_bool

        try:
            return auto_bool(env) == "true", {"source": ENV}
        except ValueError:
            raise ConfigError(f"{ENV}={env!r}: expected true, false or auto", param="kv_unified") from None
    if engine.is_embedding:
        return True, {"source": "embedding model (one sequence per input)"}
    if engine.config.max_batch < 2:
        return True, {"source": "max_batch 1: the layouts are the same"}
    if "kv_cells" in engine.opts:
        return True, {"source": "option kv_cells (a unified pool's size)"}
    return None


def decide(engine: Any, n_ctx: int, cell_bytes: int) -> tuple[bool, dict[str, Any]]:
    """(unified?, how it was chosen) at load, without measuring: given, bounded by memory, or cached; else the unified
    pool with ``pending`` set, and :func:`measure` runs when the model is idle (:mod:`.background`)."""
    if (decided := given(engine)) is not None:
        return decided
    streams_bytes = n_ctx * engine.config.max_batch * cell_bytes
    avail = available_memory()
    if avail is not None and streams_bytes > MEMORY_SHARE * avail:
        return True, {"source": "memory", "streams_kv_bytes": streams_bytes, "available_bytes": avail}
    record = read_record(cache_file(engine, n_ctx, cell_bytes))
    if record is not None and not record.get("disturbed"):
        return bool(record["unified"]), {**record["verdict"], "cached": True}
    attempts = record.get("attempts", 0) if record else 0
    return True, {"source": "default (unified pool) until the layout probe concludes in the background",
                  "pending": True, "attempts": attempts, "retry_at": record.get("retry_at", 0.0) if record else 0.0}


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict[str, Any]) -> None:
    from octo.atomic import write_json

    try:
        write_json(path, record)
    except OSError:
        log.debug("could not cache the probe record at %s", path, exc_info=True)


def measure(engine: Any, n_ctx: int, cell_bytes: int, attempts: int = 0) -> tuple[bool, dict[str, Any]]:
    """Time both layouts on the idle engine (switching its context with ``engine.layout.relayout``, back to the one
    it serves from after) and record the verdict: cached when undisturbed, else noted with the time of the next try.
    ProbeInterrupted (:mod:`.background`) passes through."""
    from octo.benchload import LoadMonitor

    from .background import ProbeInterrupted, drop_leftovers, retry_at

    mon = LoadMonitor().start()
    t0 = time.perf_counter()
    serving = engine.kv_unified
    before = set(engine.active)
    times: dict[bool, tuple[list[float], list[float]]] = {}
    try:
        shape = None
        for unified in (True, False):
            engine.layout.relayout(unified, n_ctx)
            if engine.kv_unified is not unified:
                raise RuntimeError(f"could not build the {'unified' if unified else 'streams'} context")
            if shape is None:
                shape = _shape(engine.config.max_batch, n_ctx, engine.kv_cells, rate := _prefill_rate(engine))
            times[unified] = _workload(engine, *shape, reps=REPS)
    except ProbeInterrupted:
        raise
    except Exception as exc:  # noqa: BLE001 - a probe that fails costs the choice, never the serving
        log.warning("llamacpp: the KV layout probe failed (%s: %s); the unified pool stays", type(exc).__name__, exc)
        return True, {"source": f"probe failed ({type(exc).__name__}: {exc})"}
    finally:
        drop_leftovers(engine, before)
        engine.layout.relayout(serving, n_ctx)
    conditions = mon.stop()
    unified_s, streams_s = min(times[True][0]), min(times[False][0])
    unified_solo, streams_solo = min(times[True][1]), min(times[False][1])
    unified = streams_s > MARGIN * unified_s or streams_solo > MARGIN * unified_solo
    verdict = {"source": "measured", "unified_s": round(unified_s, 4), "streams_s": round(streams_s, 4),
               "streams_over_unified": round(streams_s / unified_s, 3) if unified_s else None,
               "solo_unified_s": round(unified_solo, 4), "solo_streams_s": round(streams_solo, 4),
               "solo_streams_over_unified": round(streams_solo / unified_solo, 3) if unified_solo else None,
               "probe": dict(zip(("seqs", "prefix", "own", "decode"), shape, strict=True)),
               "prefill_tok_s": round(rate, 1), "probe_seconds": round(time.perf_counter() - t0, 2),
               "disturbed": conditions["disturbed"]}
    log.debug("llamacpp: KV layout probe: %s (agent probe: unified %.3f s, streams %.3f s%s)",
              "unified" if unified else "streams", unified_s, streams_s,
              "; disturbed by other processes, not followed" if conditions["disturbed"] else "")
    path = cache_file(engine, n_ctx, cell_bytes)
    if conditions["disturbed"]:
        write_record(path, {"disturbed": True, "attempts": attempts + 1, "retry_at": retry_at(attempts + 1),
                            "verdict": verdict})
    else:
        write_record(path, {"unified": unified, "verdict": verdict})
    return unified, verdict


def _shape(max_batch: int, n_ctx: int, pool: int, rate: float | None = None) -> tuple[int, int, int, int]:
    """(sequences, prefix, own, decode): the probe, scaled down to fit a sequence's context, the unified pool and,
    given the model's prefill rate (tok/s), about ``BUDGET_S`` of work (a large model on a CPU gets a small probe)."""
    seqs = min(SEQS, max_batch)
    scale = min(1.0, (n_ctx - 8) / (PREFIX + OWN + DECODE), (pool - 8) / (PREFIX + seqs * (OWN + DECODE)))
    if rate:  # the probe's work in prefill-token equivalents (a decode row costs about DECODE_COST of them)
        work = 2 * PREFIX + 2 * REPS * seqs * (OWN + DECODE_COST * DECODE)
        scale = min(scale, BUDGET_S * rate / work)
    return seqs, max(16, int(PREFIX * scale)), max(4, int(OWN * scale)), max(2, int(DECODE * scale))


def _prefill_rate(engine: Any) -> float:
    """Prompt tokens per second on the current context: 64 tokens after an untimed 8 (the first decode is slow)."""
    vocab = max(2, engine.n_vocab - 1)
    seq = Sequence(799_999, [(11 * i + 5) % vocab for i in range(73)], SamplingParams(temperature=0.0))
    engine.add_sequence(seq)
    try:
        _check(engine.step([Feed(seq, seq.tokens[:8], False)]))
        t0 = time.perf_counter()
        _check(engine.step([Feed(seq, seq.tokens[8:72], False)]))
        return 64 / max(time.perf_counter() - t0, 1e-6)
    finally:
        engine.remove_sequence(seq)


def _workload(engine: Any, seqs: int, prefix: int, own: int, decode: int,
              reps: int = REPS) -> tuple[list[float], list[float]]:
    """Seconds of each repetition of the two probes on the engine's current context. The shared prefix is computed
    once (the same work in either layout, untimed). Agent: ``seqs`` sequences take it (shared cells or a copy), add
    their own history and decode ``decode`` steps together. Solo: one sequence takes it and decodes ``SOLO`` steps
    alone. Its sequences are removed after."""
    vocab = max(2, engine.n_vocab - 1)
    shared = [(13 * i + 7) % vocab for i in range(prefix)]
    cached = _cache_prefix(engine, shared)
    times: list[float] = []
    solo: list[float] = []
    try:
        for r in range(reps):
            run = [Sequence(800_001 + k, shared + [(31 * i + 17 * k + 5 * r + 3) % vocab for i in range(own)],
                            SamplingParams(temperature=0.0)) for k in range(seqs)]
            times.append(_agent(engine, run, cached, prefix, decode))
            one = Sequence(800_100 + r, shared + [(7 * r + 11) % vocab], SamplingParams(temperature=0.0))
            solo.append(_solo(engine, one, cached, prefix))
        return times, solo
    finally:
        engine.kv_free(cached)


def _cache_prefix(engine: Any, shared: list[int]) -> Any:
    """The prefix ``shared`` computed once (untimed, in small steps: a request interrupts the probe soon) and kept as
    a prefix-cache entry: cells of a cache sequence (unified) or a RAM snapshot."""
    prefix = len(shared)
    lead = Sequence(800_000, shared + [1], SamplingParams(temperature=0.0))
    untimed = min(max(1, engine.prefill_chunk), PREFIX_STEP)
    engine.add_sequence(lead)
    try:
        while lead.n_cached < prefix:
            part = lead.tokens[lead.n_cached:min(prefix, lead.n_cached + untimed)]
            _check(engine.step([Feed(lead, part, False)]))
        cached = engine.kv_save(lead)
    finally:
        engine.remove_sequence(lead)
    if cached is None:
        raise RuntimeError("the engine kept no prefix-cache entry")
    return cached


def _agent(engine: Any, run: list[Sequence], cached: Any, prefix: int, decode: int) -> float:
    """Seconds for the sequences of ``run`` to take the cached prefix, add their own history (packed into steps as
    the scheduler does) and decode ``decode`` steps together; they are removed after."""
    chunk = max(1, engine.prefill_chunk)
    t0 = time.perf_counter()
    try:
        for s in run:  # they take the prefix: shared cells (unified) or a copy (streams)
            engine.add_sequence(s)
            engine.kv_restore(s, cached, prefix)
            if s.n_cached != prefix:
                raise RuntimeError(f"the cached prefix was not restored ({s.n_cached} of {prefix} tokens)")
        pending = list(run)
        while pending:  # each one's own history, packed into steps as the scheduler does
            feeds, budget = [], chunk
            for s in pending:
                if budget <= 0:
                    break
                part = s.tokens[s.n_cached:s.n_cached + budget]
                feeds.append(Feed(s, part, s.n_cached + len(part) >= len(s.tokens)))
                budget -= len(part)
            for f, out in zip(feeds, _check(engine.step(feeds)), strict=True):
                if f.sample:
                    f.seq.tokens.append(out)
                    pending.remove(f.seq)
        for _ in range(decode):
            outs = _check(engine.step([Feed(s, s.tokens[-1:], True) for s in run]))
            for s, out in zip(run, outs, strict=True):
                s.tokens.append(out)
        return time.perf_counter() - t0
    finally:
        for s in run:
            engine.remove_sequence(s)


def _solo(engine: Any, one: Sequence, cached: Any, prefix: int) -> float:
    """Seconds for ``one`` (after taking the cached prefix and its first token, untimed) to decode ``SOLO`` steps
    alone; it is removed after."""
    engine.add_sequence(one)
    try:
        engine.kv_restore(one, cached, prefix)
        one.tokens.append(_check(engine.step([Feed(one, one.tokens[one.n_cached:], True)]))[0])
        t0 = time.perf_counter()
        for _ in range(SOLO):
            one.tokens.append(_check(engine.step([Feed(one, one.tokens[-1:], True)]))[0])
        return time.perf_counter() - t0
    finally:
        engine.remove_sequence(one)
