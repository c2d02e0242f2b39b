"""Start-up engine selection: the candidate engines measured one at a time (``octo.runtime.benchmark``), the results
cached per host, the winner kept loaded.

A measurement still disturbed by other processes after its repeat (``conditions.disturbed``) decides this start and
is cached as **provisional** (``provisional`` in the result): later starts use it without measuring, and the gateway
measures it again while the model is idle (``octo.runtime.remeasure``), never on the start path and never on every
start. A cached result records its budget and conditions (``conditions``) and is measured again at start only when
it was measured with less than the budget asked (or records no conditions: an older octo's). A candidate that fails
to load or errors during its benchmark gets ``error`` set and can never win. The winner stays loaded (no second
load); losers are unloaded before serving starts. Results are cached in ``OCTO_HOME/bench`` keyed by host
fingerprint, engine name and version, and artifact digest, written atomically (``octo.atomic``).

With ``defer`` (``octo serve --bench-when-idle``) no candidate is measured on the start path: when some have no
usable cached result, the model serves at once with the best one this host has measured (or, with none measured
yet, the first candidate that loads), and the others are **unmeasured** (``"unmeasured": true``, ``score`` null)
until the gateway measures them while the model is idle (``octo.runtime.remeasure``), where the fastest takes
over.

While the first candidate loads, the others' ``Engine.prepare`` (slow imports) runs in a background thread; every
measurement waits for it. Candidates run one at a time, the one with the best earlier result on this host first.
Once a leader exists, a candidate stops as soon as it cannot win even with perfect batching (``upper_bound`` below
the leader's score after its single-stream decode): its result says ``stopped`` and its batch figure stays null.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octo.atomic import sweep, write_json
from octo.engine import Engine
from octo.paths import bench_dir
from octo.quarantine import move_aside, read_json
from octo.runtime import engine_choice as choice
from octo.runtime.benchmark import BATCH

log = logging.getLogger("octo.runtime.selection")


# -- cache key ---------------------------------------------------------------------------------------
def host_fingerprint() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    accel = "none"
    if any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl")):
        accel = "nvidia"
    elif platform.system() == "Darwin" and platform.machine() == "arm64":
        accel = "apple-metal"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem / 2**30, 1), "accelerator": accel,
            "system": platform.system()}


def artifact_digest(path: str | Path) -> str:
    """Cheap content digest: size, mtime and the first/last MiB of every file (a 4 GB model in ms)."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.exists() else []
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if st.st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read(1 << 20))
    if not files:
        h.update(str(path).encode())
    return h.hexdigest()[:32]


def cache_key(engine_cls: type[Engine], artifact: str, options: dict[str, str] | None = None) -> dict[str, Any]:
    """What a measurement is cached under: the host, the engine and its version, octo's version, the artifact, and
    the ``-o`` options the engine ran with (none: the key a plain start has always had), so that a result under
    options (a failure included) never stands for a start without them, nor the other way round."""
    from octo import __version__

    key = {"host": host_fingerprint(), "engine": engine_cls.name, "version": engine_cls.version(),
           "octo": __version__, "artifact": artifact_digest(artifact)}
    if options:
        key["options"] = dict(sorted(options.items()))
    return key


def candidate_key(cand: Any) -> dict[str, Any]:
    """The cache key of a selection candidate (its engine, artifact and the options it runs with)."""
    return cache_key(cand.cls, cand.artifact, getattr(getattr(cand, "config", None), "options", None))


def _cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return bench_dir() / f"{key['engine']}-{digest}.json"


def cached_result(key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached result for ``key``; None when there is none, or (the file set aside with a log line) when it is not
    a regular file of JSON holding a result of the shape this octo writes: a damaged cache is measured again."""
    path = _cache_file(key)
    data = read_json(path, log, what="benchmark cache")
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("key") != key or not sound_result(data.get("result")):
        move_aside(path, "not a benchmark result of this octo's shape", log, what="benchmark cache")
        return None
    return data["result"]


def sound_result(result: Any) -> bool:
    """Whether ``result`` has the shape :func:`store_result` writes (numbers where numbers are read)."""
    def number(v: Any, none: bool = True) -> bool:
        return (v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool))

    if not isinstance(result, dict) or not number(result.get("score"), none=False):
        return False
    cond = result.get("conditions", {})
    return all(number(result.get(k)) for k in ("prefill_tok_s", "decode_tok_s", "batch_decode_tok_s", "seconds")) \
        and isinstance(result.get("error") or "", str) and isinstance(cond, dict) \
        and number(cond.get("budget_s")) and (result.get("threads") is None or number(result.get("threads")))


def distrust(result: dict[str, Any], seconds: float) -> str | None:
    """Why a cached ``result`` must not stand for a measurement with a ``seconds`` budget (None: it may).

    Not trusted: a result that does not say how it was measured (an older octo's), or one measured with a smaller
    budget than asked. A crash or a failed load does not depend on the budget and stands. One disturbed by other
    load stands provisionally (:func:`provisional`).
    """
    cond = result.get("conditions")
    if not isinstance(cond, dict):
        return "it does not record how it was measured"
    err = result.get("error") or ""
    if err.startswith(("crashed", "load failed")):
        return None
    budget = float(cond.get("budget_s") or 0.0)
    if budget + 1e-9 < seconds:
        return f"it was measured with a {budget:g} s budget, less than the {seconds:g} s asked"
    return None


def provisional(result: dict[str, Any]) -> bool:
    """Whether ``result`` was measured while other processes competed for the cores: it decides, but only until it is
    measured again undisturbed (``octo.runtime.remeasure``). A measurement that ran out of time ("hung") while other
    processes kept the cores busy counts too: it says nothing of the engine, so it is measured again when idle."""
    err = result.get("error") or ""
    return bool((result.get("conditions") or {}).get("disturbed")) and (not err or err.startswith("hung"))


def busy_host(window: float = 0.5) -> dict[str, Any] | None:
    """The cores' conditions over ``window`` seconds, ``disturbed``, if other processes keep them busy; else None
    (blocking)."""
    from octo.benchload import DISTURBED_STEAL, QUIET_FOREIGN, LoadMonitor

    mon = LoadMonitor().start()
    time.sleep(window)
    cond = mon.stop()
    foreign = cond["foreign_load"]
    busy = foreign is not None and (foreign >= QUIET_FOREIGN or cond["steal"] >= DISTURBED_STEAL)
    return {**cond, "disturbed": True} if busy else None


def store_result(key: dict[str, Any], result: dict[str, Any]) -> None:
    """Cache ``result``; a disturbed one never replaces an undisturbed one (``--rebench`` on a busy host)."""
    if provisional(result) and (old := cached_result(key)) is not None and not provisional(old) \
            and not distrust(old, float((result.get("conditions") or {}).get("budget_s") or 0.0)):
        return
    # ("cached" and "provisional" describe a result in use; provisional() derives the latter from its conditions)
    write_json(_cache_file(key), {"key": key, "result": {k: v for k, v in result.items()
                                                         if k not in ("cached", "provisional")}}, indent=2)


# -- selection ---------------------------------------------------------------------------------------
class Candidate:
    """One engine that could serve the model. ``octo.runtime.loader`` has two: in this process, and in a worker process
    (where a crash, a hang or running out of memory costs only that candidate)."""

    cls: type[Engine]
    artifact: str
    in_process = True
    wait_prepare: Callable[[], None] = staticmethod(lambda: None)  # set by select: no measurement before it

    async def open(self, bench: tuple[Any, ...] | None) -> tuple[float, dict[str, Any] | None]:
        """Load (and with ``bench`` = (seconds, leader's score[, quiet wait]): ``micro_benchmark``'s arguments,
        measure); returns (load seconds, result)."""
        raise NotImplementedError

    async def set_threads(self, n: int) -> None:
        raise NotImplementedError

    async def discard(self) -> None:
        raise NotImplementedError


async def select(candidates: dict[str, Candidate], seconds: float = 3.0, rebench: bool = False,
                 say: Callable[[str], None] = print, defer: bool = False
                 ) -> tuple[str, Candidate, dict[str, dict[str, Any]], str]:
    """Benchmark ``candidates``; return the winner, still loaded (no second load). With ``defer``, candidates without a
    usable cached result are not measured now (:func:`serve_at_once`).

    Returns (winner name, its candidate, results per engine, reason). Raises RuntimeError when no candidate
    could be loaded and benchmarked.
    """
    results: dict[str, dict[str, Any]] = {}
    best: tuple[str, Candidate, bool, float] | None = None  # name, candidate, loaded?, score
    t0 = time.perf_counter()
    ordered = _ordered(candidates)
    keys = {name: candidate_key(c) for name, c in ordered.items()}
    sweep(bench_dir())  # temporaries of writers that were killed
    cached_results = {name: None if rebench else cached_result(key) for name, key in keys.items()}
    kept = choice.incumbent(keys)  # (--rebench measures again; the choice still needs a clear win to move)
    for name, cached in list(cached_results.items()):
        if cached is not None and (why := distrust(cached, seconds)):
            say(f"octo: bench {name:9s} not using its cached result: {why}")
            cached_results[name] = None
    if defer and any(cached is None for cached in cached_results.values()):
        return await serve_at_once(ordered, keys, cached_results, kept, seconds, say)
    # in-process candidates after the first prepare (slow imports) while the first one loads
    prep = _prepare([c.cls for name, c in ordered.items() if c.in_process and cached_results[name] is None][1:])
    busy = False
    for name, cand in ordered.items():
        key, cached = keys[name], cached_results[name]
        loaded = False
        if cached is not None:
            res = results[name] = _use_cached(name, cached, say)
        else:
            cand.wait_prepare = prep.join
            res, loaded = await measure(name, cand, key, seconds, best[3] if best is not None else None, say,
                                        busy=busy)
            results[name] = res
            busy = busy or provisional(res)  # the host stayed busy through its measurement and wait
        if res.get("error"):
            if loaded:
                await cand.discard()
            continue
        if best is None or choice.beats(name, res, best[0], results[best[0]], kept):
            if best is not None and best[2]:
                await best[1].discard()
            best = (name, cand, loaded, res["score"])
        elif loaded:
            await cand.discard()
    if best is None:
        errors = "; ".join(f"{n}: {r['error']}" for n, r in results.items())
        raise RuntimeError(f"no candidate engine could be benchmarked ({errors})")
    name, cand, loaded, _ = best
    if not loaded:  # the winner's result came from the cache: load it now (its only load)
        await load_winner(cand, results[name].get("threads"))
    ranked = sorted(results, key=lambda n: -results[n]["score"])
    _table(results, ranked, name, say)
    why = choice.reason(name, kept, results) + _provisional_note(results)
    say(f"octo: serving with {why}")  # the one line that says which engine serves and why
    reason = why + f"; selection took {time.perf_counter() - t0:.2f} s"
    choice.keep(keys, name, results[name])
    return name, cand, results, reason


async def measure(name: str, cand: Candidate, key: dict[str, Any], seconds: float, beat: float | None,
                  say: Callable[[str], None], store: bool = True, busy: bool = False) -> tuple[dict[str, Any], bool]:
    """Load and measure ``cand`` (``beat``: the leader's score), cache the result (``store``) and say it; returns
    (the result, whether the candidate is loaded). A candidate that fails, crashes or hangs gets ``error``; one
    disturbed by other processes, ``provisional``. ``busy``: an earlier candidate of this selection saw the host stay
    busy through its measurement and its wait, so a disturbed measurement is not repeated (no wait either)."""
    say(f"octo: bench {name:9s} loading and measuring (at most {seconds:g} s after the load) ...")
    loaded = False
    t_load = time.perf_counter()
    try:
        load_s, res = await cand.open((seconds, beat, 0.0) if busy else (seconds, beat))
        res["load_seconds"] = round(load_s, 3)
        loaded = True
    except Exception as exc:  # noqa: BLE001 - a failed, crashed or hung candidate loses with the reason
        res = failed_result(exc, seconds, time.perf_counter() - t_load)
        if res["error"].startswith("hung") and "while measuring" in res["error"] \
                and (busy := await asyncio.to_thread(busy_host)) is not None:  # out of time on a busy host
            res["conditions"].update(busy)
    cond = res.setdefault("conditions", {"budget_s": seconds, "disturbed": False})
    if provisional(res):
        res["provisional"] = True
    if store:
        store_result(key, res)
    say(f"octo: bench {name:9s} {res['seconds']:6.2f} s  score {res['score']:8.2f}  ({figures(res)}, threads "
        f"{res['threads'] or '-'})" + (f"; stopped early, {res['stopped']}" if res.get("stopped") else "")
        + _notes(cond, seconds) if not res.get("error") else f"octo: bench {name:9s} FAILED: {res['error']}"
        + (BUSY_FAILURE if res.get("provisional") else ""))
    return res, loaded


BUSY_FAILURE = "; other processes kept the cores busy, so it is measured again when the model is idle"


def figures(res: dict[str, Any]) -> str:
    """A result's figures as its progress line says them: a speech engine's speed as a multiple of real time."""
    if res.get("speech_x_realtime") is not None:
        return f"{res['speech_x_realtime']:g}x real time"
    def rate(v: Any) -> str:  # a phase not measured (stopped early, too slow to reach it) says "-", never None
        return "-" if v is None else f"{v:g}"
    text = (f"prefill {rate(res['prefill_tok_s'])} tok/s, decode {rate(res['decode_tok_s'])} tok/s, batch x{BATCH} "
            f"{rate(res['batch_decode_tok_s'])} tok/s")
    if "image_prefill_s" not in res:
        return text
    if res["image_prefill_s"] is None:  # a vision model whose picture failed
        return f"{text}, image FAILED ({res.get('image_error') or 'not measured'})"
    return (f"{text}, image {res['image_prefill_s']:g} s to the first token ({res.get('image_tokens')} image tokens, "
            f"encode {res.get('image_encode_s')} s)")


def failed_result(exc: BaseException, seconds: float, took: float | None) -> dict[str, Any]:
    """The result of a candidate that failed, crashed or hung (``took`` seconds; a measurement's ``seconds`` budget):
    it can never win, and it is cached like a measurement."""
    return {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None, "threads": None,
            "score": 0.0, "cached": False, "seconds": None if took is None else round(took, 3),
            "error": _failure(exc), "conditions": {"budget_s": seconds, "disturbed": False}}


def unmeasured() -> dict[str, Any]:
    """The result of a candidate this host has not measured yet (:func:`serve_at_once`)."""
    return {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None, "threads": None,
            "score": None, "cached": False, "seconds": None, "unmeasured": True}


def _use_cached(name: str, cached: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """A cached result as this start uses it, and its progress line."""
    res = {**cached, "cached": True, **({"provisional": True} if provisional(cached) else {})}
    say(f"octo: bench {name:9s} cached    score {res['score']:8.2f}  ({figures(res)})"
        + ("; measured while other processes were busy: measured again when the model is idle"
           if res.get("provisional") else "")
        if not res.get("error") else f"octo: bench {name:9s} cached    FAILED: {res['error']}"
        + (BUSY_FAILURE if res.get("provisional") else ""))
    return res


async def serve_at_once(ordered: dict[str, Candidate], keys: dict[str, dict[str, Any]],
                        cached: dict[str, dict[str, Any] | None], kept: str | None, seconds: float,
                        say: Callable[[str], None]) -> tuple[str, Candidate, dict[str, dict[str, Any]], str]:
    """Serve without measuring: the best candidate this host has measured (by the start's rule, the engine chosen
    before first), then the others measured, then the unmeasured ones in order, the first that loads; those without
    a cached result are left ``unmeasured`` for the gateway to measure while the model is idle. A candidate that
    fails to load gets its failure cached, as in a measurement, and the next one is tried."""
    t0 = time.perf_counter()
    results = {n: _use_cached(n, c, say) if c is not None else unmeasured() for n, c in cached.items()}
    fresh = [n for n in ordered if cached[n] is None]
    known = [n for n in ordered if cached[n] is not None and not results[n].get("error")]
    best = None
    for n in known:
        if best is None or choice.beats(n, results[n], best, results[best], kept):
            best = n
    known.sort(key=lambda n: (n != best, -results[n]["score"]))
    for name in [*known, *fresh]:
        t_load = time.perf_counter()
        try:
            await load_winner(ordered[name], results[name].get("threads"))
        except Exception as exc:  # noqa: BLE001 - it loses with the reason; the next candidate serves
            results[name] = failed_result(exc, seconds, time.perf_counter() - t_load)
            store_result(keys[name], results[name])
            say(f"octo: bench {name:9s} FAILED: {results[name]['error']}")
            continue
        waiting = [n for n in fresh if not results[n].get("error")]  # (not those whose load failed)
        for n in waiting:
            say(f"octo: bench {n:9s} not measured on this host yet: measured when the model is idle")
        ranked = sorted(results, key=lambda n: -(results[n]["score"] or 0.0))
        _table(results, ranked, name, say)
        why = _at_once_reason(name, name in fresh, kept, results, waiting) + _provisional_note(results)
        say(f"octo: serving with {why}")
        return name, ordered[name], results, why + f"; loaded in {time.perf_counter() - t0:.2f} s"
    errors = "; ".join(f"{n}: {r['error']}" for n, r in results.items() if r.get("error"))
    raise RuntimeError(f"no candidate engine could be loaded ({errors})")


def _at_once_reason(name: str, unmeasured_serves: bool, kept: str | None, results: dict[str, dict[str, Any]],
                    waiting: list[str]) -> str:
    measured = {n: r for n, r in results.items() if not r.get("unmeasured")}
    if unmeasured_serves:
        head = f"{name} at once, the first candidate: no engine that can serve it is measured on this host yet"
    elif any(n != name and not r.get("error") for n, r in measured.items()):
        head = choice.reason(name, kept, measured)
    else:
        head = f"{name}, measured on this host before"
    return head + (f"; not measured yet: {', '.join(waiting)}, measured when the model is idle (the fastest then "
                   "serves)" if waiting else "")


async def load_winner(cand: Candidate, threads: int | None) -> None:
    """Load a winner whose result came from the cache, with the thread count it was measured best with."""
    await cand.open(None)
    if threads is not None:
        await cand.set_threads(threads)


def _provisional_note(results: dict[str, dict[str, Any]]) -> str:
    again = [n for n, r in results.items() if r.get("provisional")]
    return (f"; provisional: {', '.join(again)} measured while other processes were busy, measured again when the "
            "model is idle") if again else ""


def _notes(cond: dict[str, Any], seconds: float) -> str:
    """What the progress line says about how a measurement went: a budget too small, disturbance."""
    notes = ""
    if cond.get("budget_too_small"):
        w = cond.get("work") or {}
        notes += (f"; --bench-seconds {seconds:g} is too small to measure meaningfully: measured the minimum "
                  f"({w.get('prefill_tokens')} prefill, {w.get('decode_tokens')} decode, {w.get('batch_tokens')} "
                  f"batch tokens) anyway")
    tries = cond.get("attempts") or []
    if len(tries) > 1:
        notes += f"; disturbed by other load, measured {len(tries)} times"
    if cond.get("disturbed"):
        notes += (f"; other processes were busy (they used {cond.get('foreign_load')} of the cores, this one "
                  f"waited {cond.get('run_wait')} of the time for a core), so it decides provisionally and is "
                  "measured again when the model is idle")
    return notes


def _failure(exc: BaseException) -> str:
    msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    code = getattr(exc, "code", None)
    if code in ("engine_crashed", "engine_hung"):
        return f"{code.removeprefix('engine_')}: {msg}"
    return f"load failed: {msg}"


def _prepare(classes: list[type[Engine]]) -> threading.Thread:
    """Run ``Engine.prepare`` of ``classes`` in a background thread (started; join it before measuring)."""

    def run() -> None:
        for cls in classes:
            try:
                cls.prepare()
            except Exception:  # noqa: BLE001 - prepare is an optimisation; load reports real failures
                log.debug("prepare of %s failed", cls.name, exc_info=True)

    thread = threading.Thread(target=run, name="octo-prepare", daemon=True)
    thread.start()
    return thread


def _ordered(candidates: dict[str, Candidate]) -> dict[str, Candidate]:
    """Candidates with the best earlier results on this host first (any artifact), then in the given order; the
    order only decides how soon a leader lets the others stop early, never who wins."""
    host = host_fingerprint()
    past: dict[str, float] = {}
    for f in bench_dir().glob("*.json") if bench_dir().is_dir() else ():
        data = read_json(f, log, what="benchmark cache")
        if data is None:
            continue
        key, res = (data.get("key"), data.get("result")) if isinstance(data, dict) else (None, None)
        if not isinstance(key, dict) or not isinstance(key.get("engine"), str) or not sound_result(res):
            move_aside(f, "not a benchmark result of this octo's shape", log, what="benchmark cache")
        elif key.get("host") == host and key["engine"] in candidates and not res.get("error") \
                and not res.get("stopped"):
            past[key["engine"]] = max(past.get(key["engine"], 0.0), float(res["score"]))
    names = sorted(candidates, key=lambda n: -past.get(n, -1.0))  # stable: no history keeps the given order
    return {n: candidates[n] for n in names}


def _table(results: dict[str, dict], ranked: list[str], winner: str, say: Callable[[str], None]) -> None:
    w = max(10, *map(len, ranked))
    speech = any("speech_x_realtime" in r for r in results.values())  # speech engines: x real time, no tokens
    images = any("image_prefill_s" in r for r in results.values())  # a vision model: its image prompt's seconds
    head = f"{'x realtime':>10s}" if speech else f"{'prefill':>9s} {'decode':>9s} {'batch x4':>9s}"
    head += f" {'image s':>9s}" if images else ""
    say(f"{'engine':{w}s} {head} {'threads':>7s} {'score':>9s}  note")
    for n in ranked:
        r = results[n]
        note = "WINNER" if n == winner else (r.get("error") or ("stopped early (cannot win)" if r.get("stopped")
                                                               else ""))
        if r.get("unmeasured"):
            note = ("SERVING, " if n == winner else "") + "not measured yet"
        if r.get("cached"):
            note += " (cached)"

        def f(v, digits=1):
            return f"{v:9.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>9s}"
        rates = (f" {f(r.get('speech_x_realtime'), 2)}" if speech else
                 f"{f(r.get('prefill_tok_s'))} {f(r.get('decode_tok_s'))} {f(r.get('batch_decode_tok_s'))}")
        rates += f" {f(r.get('image_prefill_s'), 2)}" if images else ""
        say(f"{n:{w}s} {rates} {str(r.get('threads') or '-'):>7s} {f(r['score'], 2)}  {note}")
