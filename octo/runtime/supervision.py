"""The gateway's supervision of its engine workers: heartbeats, silence bounds, crash blame and retry back-off.

Liveness is judged here, in the gateway, never only inside the worker: a worker that is stopped (SIGSTOP), frozen in
a native deadlock or held in a C call that keeps the GIL cannot report itself. Each worker runs a heartbeat thread
(``octo.runtime.ipc.start_heartbeat``) that sends a small message every ``beat_interval`` seconds, independent of its
engine thread and event loop; native engines release the GIL while they compute, so a long prefill or load does not
stop it, while SIGSTOP or a C loop holding the GIL stops every thread, heartbeat included. Any message counts as a
sign of life. A worker silent past its bound (``--worker-timeout`` while it serves; ``max(--worker-timeout,
LOAD_SILENCE_S)`` while it starts, loads, warms up or is measured) is killed with SIGKILL and handled as a crash:
its requests end at once with ``engine_hung`` and the next request restarts it.

Crash blame: a death by a signal of the code itself (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGSYS, SIGTRAP) or a
non-zero exit during load, warm-up or the first steps may be the configuration's fault, and only that moves to the
engine's next fallback configuration (remembered for the host). SIGKILL comes from outside (the OOM killer, an
operator, or the gateway after a hang): it never moves to a fallback and is never remembered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import signal
import time
from typing import Any

from octo.engine import Engine
from octo.paths import bench_dir

WORKER_TIMEOUT_S = 10.0  # default --worker-timeout: a serving worker silent this long is killed
LOAD_SILENCE_S = 30.0  # the silence bound while a worker starts, loads, warms up or is measured (at least)
LOAD_TIMEOUT_S = 300.0  # default --load-timeout (Ollama's OLLAMA_LOAD_TIMEOUT is 5 minutes too)
STATS_WAIT_S = 0.5  # a worker's figures are waited for this long; then the last ones are shown, marked stale
QUEUE_GRACE_S = 1.0  # the gateway ends a request still queued this long after --queue-timeout (the worker did not)
TICK_S = 0.25  # how often the gateway looks at each worker
BACKOFF_FIRST_S = 10.0  # a failed model is retried after this, then twice as long each time ...
BACKOFF_MAX_S = 300.0  # ... up to this
FAULT_EXIT = 70  # a worker exits with this after its own watchdog found the engine thread wedged or dead
CONFIG_SIGNALS = frozenset(s.value for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                                              signal.SIGABRT, getattr(signal, "SIGSYS", signal.SIGABRT),
                                              getattr(signal, "SIGTRAP", signal.SIGABRT)))


def silence_limit(worker_timeout: float, serving: bool) -> float:
    return worker_timeout if serving else max(worker_timeout, LOAD_SILENCE_S)


def config_fault(returncode: int | None, hung: bool) -> bool:
    """Whether a worker's death can be its configuration's fault (see the module's docstring)."""
    if hung or returncode is None or returncode == 0:
        return False
    if returncode < 0:
        return -returncode in CONFIG_SIGNALS
    return returncode != FAULT_EXIT


def outside_kill(returncode: int | None) -> bool:
    return returncode == -signal.SIGKILL


def backoff(failures: int) -> float:
    """Seconds before a model that failed ``failures`` times in a row is tried again."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, failures - 1))


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


async def watch(worker: Any) -> None:
    """(a task per worker, on the gateway's loop) Kill ``worker`` once it has been silent past
    ``worker.silence_limit``; call ``worker.on_tick(now)`` every tick (the gateway-side queue deadlines)."""
    last = time.monotonic()
    while worker.alive:
        await asyncio.sleep(TICK_S)
        now = time.monotonic()
        held_up, last = now - last > TICK_S + 1.0, now
        if held_up:  # this loop itself was blocked: what the worker sent meanwhile is read first
            continue
        silent = now - worker.heard
        if silent > worker.silence_limit:
            worker.hang(silent)
            return
        worker.on_tick(now)


def stale_copy(stats: dict[str, Any], age: float | None) -> dict[str, Any]:
    """The last figures a worker sent, marked as such (it did not answer within ``STATS_WAIT_S``); ``age``: seconds
    since they came (None: it never sent any)."""
    out = dict(stats)
    for key in ("queue", "cache"):
        if isinstance(out.get(key), dict):
            out[key] = {**out[key], "stale": True, "age_s": None if age is None else round(age, 3)}
    return out


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


# -- fallback configurations, remembered per host and artifact ------------------------------------------
def _memo_file(cls: type[Engine], artifact: str):
    from octo.runtime.selection import cache_key

    key = json.dumps(cache_key(cls, artifact), sort_keys=True)
    return bench_dir() / f"fallback-{cls.name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def configs_for(cls: type[Engine], options: dict[str, str]) -> list[tuple[dict[str, str], str | None]]:
    """The base configuration, then each fallback whose options the user did not set explicitly."""
    return [({}, None), *((o, why) for o, why in cls.fallbacks if not set(o) & set(options))]


def remembered(cls: type[Engine], artifact: str, options: dict[str, str]) -> int:
    """Index into ``configs_for`` of the fallback that worked here before (0: the base configuration)."""
    try:  # none for this engine at all (the usual case): no key to make (its version: importing its library)
        if not any(f.startswith(f"fallback-{cls.name}-") for f in os.listdir(bench_dir())):
            return 0
    except OSError:
        return 0
    try:
        memo = json.loads(_memo_file(cls, artifact).read_text())
        overlay, why = memo["options"], str(memo.get("reason"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    if "SIGKILL" in why:  # written by an earlier octo after an outside kill: not the configuration's fault
        return 0
    for i, (o, _) in enumerate(configs_for(cls, options)):
        if o == overlay:
            return i
    return 0


def remember(cls: type[Engine], artifact: str, overlay: dict[str, str], why: str) -> None:
    from octo.atomic import write_json  # atomic, and a writer killed midway leaves no stale file

    write_json(_memo_file(cls, artifact), {"options": overlay, "reason": why})
