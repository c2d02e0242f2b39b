"""The KV layout probes run while the model is idle, never between a user and a token.

A model serves as soon as it is loaded: with the cached verdicts of :mod:`.layout` (unified pool or streams) and
:mod:`.adapt` (short traffic in streams) when this host, build, GGUF and settings have them, else with the safe
default (the unified pool, no switching). The probes that would choose better run from the engine loop's idle
moments (``Engine.idle_work``): :func:`check`, called after every engine step of a probe, raises
:class:`ProbeInterrupted` as soon as a request waits; the probe's ``finally`` blocks free its sequences and put the
serving context back as it was, and the probe runs again at a later idle moment. Only a probe that concludes
changes anything:

* a measurement that other processes did not disturb (``octo.benchload``) is cached and followed: the adaptation
  switches on at once; a layout verdict for streams serves from the next load (a stream per sequence holds less
  context than the pool, and the context a model announced stays what it serves);
* a disturbed one is not followed: it is recorded (attempts, next try) so that the next try comes later, in this
  process or a later one (``DISTURBED_RETRY_S``), never on every start.

A probe measures, so it only starts on a quiet host, and it stops as soon as other processes disturb it: a due probe
first looks at the cores for ``QUIET_WINDOW_S`` (``octo.benchload.quiet_now``) and, if others keep them busy, waits
``BUSY_RETRY_S`` without counting an attempt; while it runs, :func:`check` looks at what competed since it started
(every ``LOOK_EVERY_S``, from ``LOOK_AFTER_S`` on) and stops it (:class:`ProbeDisturbed`) once that is a disturbance.
An idle octo on a busy machine (another server being benchmarked, a build) thus costs nothing but a look every half
minute, instead of minutes of probing that would be thrown away.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from octo import benchload

log = logging.getLogger("octo.engines.llamacpp")

INTERRUPTED_RETRY_S = 2.0  # idleness before a probe that a request interrupted starts again
DISTURBED_RETRY_S = (600.0, 3600.0, 6 * 3600.0, 86400.0)  # after the 1st, 2nd, 3rd, 4th+ disturbed measurement

BUSY_RETRY_S = 30.0  # a due probe on a host others keep busy waits this long (not an attempt)
QUIET_WINDOW_S = 0.3  # how long a due probe looks at the cores before it starts
LOOK_AFTER_S, LOOK_EVERY_S = 1.0, 0.5  # a running probe looks for disturbance from 1 s on, every half second

_state = threading.local()  # the engine thread's interruption test (and load monitor) while one of its probes runs


class ProbeInterrupted(Exception):
    """A request arrived while a probe ran: the probe stops and leaves the engine as it serves."""


class ProbeDisturbed(ProbeInterrupted):
    """Other processes competed for the cores while a probe ran: its measurement would be thrown away; it stops."""


def quiet_now() -> bool:
    """Whether the host is quiet enough to start a probe (``octo.benchload.quiet_now``)."""
    return benchload.quiet_now(QUIET_WINDOW_S)


def disturbed(monitor: benchload.LoadMonitor) -> bool:
    """Whether what competed since ``monitor`` started disturbs a measurement."""
    return bool(monitor.stop()["disturbed"])


def check(outs: list[Any]) -> list[Any]:
    """A probe's engine step results, with any per-sequence error raised; ProbeInterrupted once a request waits,
    ProbeDisturbed once other processes disturbed the probe."""
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    interrupted = getattr(_state, "interrupted", None)
    if interrupted is not None and interrupted():
        raise ProbeInterrupted
    monitor = getattr(_state, "monitor", None)
    if monitor is not None:
        now = time.perf_counter()
        if now >= _state.next_look:
            _state.next_look = now + LOOK_EVERY_S
            if disturbed(monitor):
                raise ProbeDisturbed
    return outs


def drop_leftovers(engine: Any, before: set[int]) -> None:
    """Remove the sequences a failed probe left in the engine (any not there in ``before``, the ids it started with)."""
    for seq in [s for sid, s in engine.active.items() if sid not in before]:
        try:
            engine.remove_sequence(seq)
        except Exception:  # noqa: BLE001 - the context is rebuilt after anyway
            log.debug("could not remove a probe's sequence", exc_info=True)


def retry_at(attempts: int, now: float | None = None) -> float:
    """When (epoch seconds) to measure again after ``attempts`` disturbed measurements."""
    return (time.time() if now is None else now) + DISTURBED_RETRY_S[min(attempts, len(DISTURBED_RETRY_S)) - 1]


def pending(verdict: dict[str, Any] | None) -> bool:
    return bool(verdict and verdict.get("pending"))


class Probed(Protocol):
    """What :func:`run` drives: the engine's layout part (:class:`.adapt.AdaptiveLayout`)."""

    verdicts: dict[str, Any]  # "pending" marks a probe to run (the layout's; the adaptation's under "adapt")

    def conclude_probe(self, kind: str) -> None: ...


def run(part: Probed, interrupted: Any, watch_load: bool = True) -> float | None:
    """``Engine.idle_work`` of the llama.cpp engine: the due probes of its layout ``part``, in order (the layout, then
    short traffic). Returns None when none is left, else the idleness to wait before the next call. With
    ``watch_load``, a probe starts only on a quiet host and stops once others disturb it (see the module's text)."""
    lay = part.verdicts
    waits = []
    for kind in ("layout", "adapt"):
        verdict = lay if kind == "layout" else lay.get("adapt")
        if not pending(verdict):
            continue
        wait = verdict.get("retry_at", 0.0) - time.time()
        if wait > 0:
            waits.append(wait)
            continue
        if watch_load and not quiet_now():
            log.debug("llamacpp: the %s probe waits: other processes keep the cores busy", kind)
            return BUSY_RETRY_S
        _state.interrupted = interrupted
        if watch_load:
            _state.monitor, _state.next_look = benchload.LoadMonitor().start(), time.perf_counter() + LOOK_AFTER_S
        try:
            part.conclude_probe(kind)
        except ProbeDisturbed:
            log.debug("llamacpp: the %s probe stopped: other processes competed for the cores", kind)
            return BUSY_RETRY_S
        except ProbeInterrupted:
            log.debug("llamacpp: the %s probe stopped for a request; it goes on at the next idle moment", kind)
            return INTERRUPTED_RETRY_S
        finally:
            _state.interrupted = _state.monitor = None
        if pending(lay if kind == "layout" else lay.get("adapt")):
            waits.append(lay["retry_at"] - time.time() if kind == "layout" else lay["adapt"]["retry_at"] - time.time())
    return max(1.0, min(waits)) if waits else None


def settle(part: Probed) -> None:
    """Run every pending probe of the layout ``part`` to its end now, whatever its retry time (tests, benchmarks)."""
    for verdict in (part.verdicts, part.verdicts.get("adapt")):
        if pending(verdict):
            verdict["retry_at"] = 0.0
    while run(part, lambda: False, watch_load=False) is not None:
        for verdict in (part.verdicts, part.verdicts.get("adapt")):
            if pending(verdict):
                return  # disturbed: recorded for later
