"""Engine measurements taken while the model is idle, never on the start path: of the engines this host has not
measured yet, and again of those that other processes disturbed.

Start-up selection (``octo.runtime.selection``) decides with what it has. With ``--bench-when-idle`` a gateway serves
at once with the best engine measured on this host, or the first candidate when none is (``serve_at_once``): the
others are *unmeasured*. A measurement that other processes disturbed decides that start and every later one (it
is cached as *provisional*). This module measures both in the gateway's background, in a worker process of its own,
under the rules the llama.cpp engine's KV-layout probes follow (``engines/llamacpp/background.py``):

* only once every model has been idle for ``IDLE_S`` (no request running, none ended since) and no model is loading,
  and only on a quiet host: it first looks at the cores for ``QUIET_WINDOW_S`` (``octo.benchload.quiet_now``) and,
  if other processes keep them busy, waits ``BUSY_RETRY_S`` without counting an attempt;
* the first request that arrives stops it at once: the candidate's worker is killed and the measurement is taken
  again at the next idle moment (an interrupted measurement counts no attempt);
* a measurement disturbed again is retried later: after ``RETRY_S`` (10 minutes, then an hour, 6 hours, a day), a
  schedule kept in the cached result (``remeasure``), so a restarted gateway keeps it: never on every start;
* a first measurement that is disturbed is cached as provisional, as at a start, and measured again later;
* one that concludes undisturbed replaces the provisional (or missing) result in the cache; when every result has
  been measured undisturbed, the engine choice (``octo.runtime.engine_choice``) is settled by the same rule as at
  start (the engine chosen before, or the one serving, stays unless a challenger wins by ``MARGIN``, undisturbed;
  an engine that serves only because nothing was measured yet has no such lead: the highest score wins) and one
  line says it;
* a challenger that won takes over at once (:func:`switch`): it is loaded in a worker beside the engine that serves
  while every model is idle (a request stops that load too), swapped in between two requests, and the old engine's
  worker is stopped. Where memory has no room for both, or the engine would serve in the gateway's own process
  (``--isolation thread``), the model's next load serves with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octo import benchload
from octo.logsafe import quoted
from octo.runtime import engine_choice as choice
from octo.runtime.selection import Candidate, cached_result, load_winner, measure, provisional, store_result

log = logging.getLogger("octo.runtime.remeasure")

IDLE_S = 8.0  # every model idle this long before a measurement starts (the llama.cpp probes wait 5 s)
QUIET_WINDOW_S = 0.3
BUSY_RETRY_S = 30.0
RETRY_S = (600.0, 3600.0, 6 * 3600.0, 86400.0)  # after the 1st, 2nd, 3rd, 4th+ disturbed measurement again
LOOK_S = 0.05  # how often a running measurement looks for a request
SWAP_WAIT_S = 30.0  # how long a loaded challenger waits for a moment without requests before it is stopped again


@dataclass
class Pending:
    """What a model's selection left to measure again (``octo.runtime.loader.open_model`` makes it)."""

    model: str
    serving: str  # the engine that serves the model now
    seconds: float  # the selection's budget
    keys: dict[str, dict[str, Any]]  # every candidate's cache key
    results: dict[str, dict[str, Any]]  # the selection's results (updated in place: /v1/engines shows them)
    make: Callable[[str], Candidate]  # a fresh candidate of that engine, in a worker process of its own
    artifacts: dict[str, str]  # every candidate's artifact path
    names: list[str] = field(default_factory=list)  # the engines whose result is provisional
    # the model served by another engine: its serving candidate (None: not in a worker, no switch while running),
    # and its handle and /v1/engines rows once that candidate is loaded
    serving_candidate: Callable[[str], Candidate | None] = lambda name: None
    handle_of: Callable[[Candidate, str, str], tuple[Any, Any]] | None = None
    switch: Callable[[str], Any] | None = None  # set by start(): serve with that engine now
    first: bool = False  # some were never measured on this host (``octo.runtime.selection.serve_at_once``)
    unchosen: bool = False  # the serving engine serves without a measurement that chose it: no incumbent's margin

    def start(self, registry: Any, slot: Any) -> asyncio.Task | None:
        """Measure again in the background of ``registry``, for its ``slot`` (:func:`start`)."""
        return start(self, registry, slot)


class Activity:
    """What the gateway's models are doing, as the registry sees it: ``busy()`` while a request runs or a model loads,
    ``last()`` the time the last request ended."""

    def __init__(self, busy: Callable[[], bool], last: Callable[[], float]) -> None:
        self.busy, self.last = busy, last

    def idle_for(self) -> float:
        return 0.0 if self.busy() else time.monotonic() - self.last()


def watch(registry: Any) -> Activity:
    """The activity of every model of ``registry`` (``octo.runtime.registry``): a request running, or a load, on any
    of them makes it busy (one model's measurement must not compete with another's requests either)."""
    slots = registry.slots
    return Activity(lambda: any(s.inflight or s.loading is not None for s in slots),
                    lambda: max((s.last_used for s in slots), default=0.0))


def due_at(result: dict[str, Any]) -> float:
    """When a provisional ``result`` may be measured again (wall-clock seconds; 0: at the first idle moment)."""
    return float((result.get("remeasure") or {}).get("next_at") or 0.0)


async def run(pending: Pending, activity: Activity, say: Callable[[str], None]) -> None:
    """Measure ``pending.names`` again, one at a time, as the module's rules allow; returns when none is left."""
    while pending.names:
        name = min(pending.names, key=lambda n: due_at(pending.results[n]))
        wait = due_at(pending.results[name]) - time.time()
        if wait > 0:
            await asyncio.sleep(min(wait, 60.0))
            continue
        if not await _idle_with_room(pending, name, activity):
            continue
        if not await asyncio.to_thread(benchload.quiet_now, QUIET_WINDOW_S):
            log.debug("%s: the host is busy; looking again in %g s before measuring %s",
                      quoted(pending.model, bare=True), BUSY_RETRY_S, name)
            await asyncio.sleep(BUSY_RETRY_S)
            continue
        res = await measure_once(pending, name, activity)
        if res is not None and (best := record(pending, name, res, say)) not in (None, pending.serving) \
                and pending.switch is not None:
            await pending.switch(best)


def _leader(pending: Pending, name: str) -> float | None:
    """The best undisturbed score of the other engines: a candidate that cannot reach it stops early, as at start."""
    scores = [r["score"] for n, r in pending.results.items() if n != name and not r.get("error")
              and not provisional(r) and not r.get("stopped") and not r.get("unmeasured")]
    return max(scores, default=None)


async def _idle_with_room(pending: Pending, name: str, activity: Activity) -> bool:
    """Whether every model has been idle for ``IDLE_S`` and memory has room to load ``name`` beside them; if not,
    wait for the next look (the rest of ``IDLE_S``, or ``RETRY_S[0]`` for memory) and say False."""
    if activity.idle_for() < IDLE_S:
        await asyncio.sleep(max(0.5, IDLE_S - activity.idle_for()))
        return False
    if not _room_for(pending, name):
        log.info("%s: too little free memory to load %s beside the models; trying again later",
                 quoted(pending.model, bare=True), name)
        await asyncio.sleep(RETRY_S[0])
        return False
    return True


def _room_for(pending: Pending, name: str) -> bool:
    """Whether this host has the memory to load ``name``'s artifact beside what it serves (a second copy of the
    serving engine's model, for that one)."""
    from pathlib import Path

    from octo.runtime.memguard import available, model_bytes

    room = available()
    return room is None or model_bytes(Path(pending.artifacts[name])) <= room[0]


async def measure_once(pending: Pending, name: str, activity: Activity) -> dict[str, Any] | None:
    """One measurement of ``name`` in a worker of its own; None when a request (or a load) stopped it."""
    cand = pending.make(name)
    log.info("%s: measuring %s %swhile the model is idle", quoted(pending.model, bare=True), name,
             "" if pending.results[name].get("unmeasured") else "again ")
    got = await unless_busy(measure(name, cand, pending.keys[name], pending.seconds, _leader(pending, name),
                                    log.debug, store=False), cand, activity)
    if got is None:
        log.info("%s: a request came; measuring %s again at the next idle moment", quoted(pending.model, bare=True),
                 name)
        return None
    res, loaded = got
    if loaded:
        await cand.discard()
    return res


async def unless_busy(work: Any, cand: Candidate, activity: Activity) -> Any:
    """Await ``work`` (a coroutine that loads ``cand`` in a worker) unless a request or a load comes first: then its
    worker is killed at once (the request must not share the cores with it) and None is returned."""
    mark = activity.last()
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=LOOK_S)
            if not task.done() and (activity.busy() or activity.last() != mark):
                break
        else:
            return task.result()
    except asyncio.CancelledError:  # the gateway stops or unloads the model
        await _stop(task, cand)
        raise
    await _stop(task, cand)
    return None


async def _stop(task: asyncio.Task, cand: Candidate) -> None:
    task.cancel()
    worker = getattr(cand, "spawned", None)
    if worker is not None:
        worker.kill()
    await asyncio.gather(task, return_exceptions=True)


def record(pending: Pending, name: str, res: dict[str, Any], say: Callable[[str], None]) -> str | None:
    """Cache a new measurement of ``name``: an undisturbed one (or a failure) replaces the provisional (or missing)
    result; a disturbed one keeps the provisional result (a first one stands as provisional) and sets the next try.
    Once none is left, settle the choice, say it and return the chosen engine (None before)."""
    key, row = pending.keys[name], pending.results[name]
    if provisional(res):
        old = cached_result(key) or row
        if old.get("unmeasured"):  # its first measurement, disturbed: it stands provisionally, as at a start
            old = res
        tries = int((old.get("remeasure") or {}).get("attempts") or 0) + 1
        delay = RETRY_S[min(tries, len(RETRY_S)) - 1]
        kept = {**old, "remeasure": {"attempts": tries, "next_at": time.time() + delay}}
        store_result(key, kept)
        row.clear()  # in place: /v1/engines rows made before show the new result
        row.update(kept, cached=True, provisional=True)
        log.info("%s: %s was disturbed by other processes again; next try in %g s", quoted(pending.model, bare=True),
                 name, delay)
        return None
    store_result(key, res)
    row.clear()
    row.update(res)
    pending.names.remove(name)
    log.info("%s: %s measured undisturbed: score %.2f", quoted(pending.model, bare=True), name, res.get("score") or 0.0)
    if pending.names:
        return None
    best, line = settle(pending)
    say(line)
    return best


def settle(pending: Pending) -> tuple[str | None, str]:
    """Choose among the results as start-up selection does and keep the choice; returns it and a line that says
    it."""
    ok = {n: r for n, r in pending.results.items() if not r.get("error")}
    before = choice.incumbent(pending.keys)
    # the engine serving now was this host's choice too, unless it serves only because nothing was measured yet
    kept = before or (None if pending.unchosen else pending.serving)
    best = kept if kept in ok else next(iter(ok), None)
    if best is None:
        return None, f"octo: '{pending.model}': no engine could be measured"
    for n in sorted(ok, key=lambda n: -ok[n]["score"]):
        if n != best and choice.beats(n, ok[n], best, ok[best], kept):
            best = n
    choice.keep(pending.keys, best, ok[best])
    # none kept before this start: the serving engine stands for the choice, made at this start
    why = choice.reason(best, kept, pending.results, **({} if before else {"when": "at this start"}))
    done = f"octo: '{pending.model}': {measured_while_idle(pending)}"
    if best == pending.serving:
        return best, f"{done}: {why}"
    if pending.switch is not None and pending.serving_candidate(best) is not None:
        return best, f"{done}: switching to {why}"
    return best, f"{done}: the next start serves it with {why}"


def measured_while_idle(pending: Pending) -> str:
    return "measured while idle" if pending.first else "measured again while idle"


def start(pending: Pending, registry: Any, slot: Any) -> asyncio.Task | None:
    """The background task of a model (``slot`` of ``registry``) whose selection left provisional results (None:
    nothing to measure)."""
    if not pending.names:
        return None
    activity = watch(registry)
    pending.switch = lambda best: switch(pending, registry, slot, best, activity)
    task = asyncio.get_running_loop().create_task(run(pending, activity, registry.say),
                                                  name=f"remeasure {pending.model}")
    task.add_done_callback(_log_failure)
    return task


async def switch(pending: Pending, registry: Any, slot: Any, best: str, activity: Activity) -> None:
    """Serve the model with ``best`` now: loaded beside the engine that serves it while every model is idle (a request
    stops the load: tried again at the next idle moment), swapped in between two requests, the old one stopped. With
    too little memory for both, or an engine that serves in the gateway's process, the next load switches."""
    say, old_name, t0 = registry.say, pending.serving, time.monotonic()
    while pending.serving == old_name and slot.handle is not None:
        cand = pending.serving_candidate(best)
        if cand is None or pending.handle_of is None:
            return
        if not await _idle_with_room(pending, best, activity):
            continue
        try:
            if await unless_busy(_loaded(cand, pending.results[best]), cand, activity) is None:
                continue
        except Exception as exc:  # noqa: BLE001 - the engine that serves goes on serving
            log.warning("%s: could not load %s to switch to it: %s", quoted(pending.model, bare=True), best, exc)
            return
        why = f"{best}: {measured_while_idle(pending)}, switched from {old_name}"
        handle, rows = pending.handle_of(cand, best, why)
        try:
            await handle.activate(registry.config_for(slot.spec))
            gap = time.monotonic() + SWAP_WAIT_S
            while slot.inflight and slot.handle is not None and time.monotonic() < gap:  # between two requests
                await asyncio.sleep(0.01)
            if slot.handle is None or slot.inflight:  # unloaded meanwhile, or traffic without a gap: later
                await handle.close()
                continue
            old, slot.handle, slot.rows = slot.handle, handle, rows
        except BaseException:
            await handle.close()
            raise
        pending.serving = best
        await old.close()
        say(f"octo: '{quoted(pending.model, bare=True)}' now served by {best} (switched from {old_name} in "
            f"{time.monotonic() - t0:.2f} s, between two requests)")


async def _loaded(cand: Candidate, result: dict[str, Any]) -> bool:
    await load_winner(cand, result.get("threads"))
    return True


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("measuring again failed", exc_info=task.exception())
