"""An engine worker started before the gateway's own imports: ``octo serve`` calls :func:`prespawn` right after
parsing its flags, so the worker's interpreter start and imports (and its engine plugins') overlap the gateway's,
and the first model load (or a load on demand) skips them. Standard library only: importing this module must cost
nothing.

The worker is the ordinary ``python -m octo.runtime.worker`` (``octo.runtime.process.WorkerProcess``), started with
``subprocess.Popen`` because no event loop runs yet; ``octo.runtime.process`` adopts it (:func:`take`) the first time
it needs a worker, or keeps it as its spare. It is a child of the thread that runs the gateway's event loop (the
main thread), so it dies with the gateway (``PR_SET_PDEATHSIG``, and EOF on its sockets).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("octo.runtime.prespawn")
PRELOAD_ENV = "OCTO_WORKER_PRELOAD"  # "ENGINE,ENGINE" (maybe empty): what a worker prepares while it waits ...
PLUGINS_ENV = "OCTO_WORKER_PLUGINS_DIR"  # ... with the plugins of this folder (octo.runtime.worker.Worker.preload)


@dataclass
class Prespawned:
    """A worker process started with ``Popen`` and the gateway's ends of its three sockets (down, up, arbiter)."""

    popen: subprocess.Popen
    down: socket.socket
    up: socket.socket
    arbiter: socket.socket
    beat: float
    started: float  # time.monotonic() of the spawn
    engines: tuple[str, ...] = ()  # what it prepares (one alone: for that engine only; WorkerProcess.may_take)

    @property
    def pid(self) -> int:
        return self.popen.pid


class Signal(threading.Event):
    """A ``threading.Event`` that also calls back when it is set, so that an event loop waits for it without polling
    and without a thread (its callback hands the wake-up to the loop with ``loop.call_soon_threadsafe``)."""

    def __init__(self) -> None:
        super().__init__()
        self._calls_lock = threading.Lock()
        self._calls: list[Callable[[], object]] = []

    def set(self) -> None:
        with self._calls_lock:
            super().set()
            calls, self._calls = self._calls, []
        for fn in calls:
            fn()

    def add_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once this is set: now if it is, else from the thread that sets it."""
        with self._calls_lock:
            if not self.is_set():
                self._calls.append(fn)
                return
        fn()

    def remove_callback(self, fn: Callable[[], object]) -> None:
        with self._calls_lock:
            if fn in self._calls:
                self._calls.remove(fn)


def beat_interval(timeout: float) -> float:
    """Seconds between a worker's heartbeats for a silence bound of ``timeout`` (ten beats in the bound, at most
    one a second)."""
    return max(0.05, min(1.0, timeout / 10))


_slot: list[Prespawned] = []
# set once a model load is handed to an engine (a worker's load request sent, or an in-process load begun): `octo
# serve` lets that happen before its own imports (octo.cli.startup)
LOAD_HANDED_OVER = Signal()


def worker_argv(fds: tuple[int, int, int], beat: float) -> list[str]:
    """The command line of a worker whose ends of the down, up and arbiter sockets are ``fds``."""
    return [sys.executable, "-m", "octo.runtime.worker", *map(str, fds), str(os.getpid()), str(beat)]


def worker_env(level: int | str, plugins_dir: str | None = None, engines: tuple[str, ...] | None = None
               ) -> dict[str, str]:
    """A worker's environment: the gateway's log level and, for a worker started ahead of its model (``engines`` not
    None), what to prepare while it waits: the plugins of ``plugins_dir`` and the libraries of ``engines``."""
    name = level if isinstance(level, str) else logging.getLevelName(level)
    env = {k: v for k, v in os.environ.items() if k not in (PRELOAD_ENV, PLUGINS_ENV)}
    env["OCTO_LOG_LEVEL"] = name.upper()
    if engines is not None:
        env[PRELOAD_ENV] = ",".join(engines)
        if plugins_dir:
            env[PLUGINS_ENV] = plugins_dir
    return env


def prespawn(beat: float, log_level: str, plugins_dir: str | None = None,
             engines: tuple[str, ...] = ()) -> Prespawned | None:
    """Start one worker now (waiting for a model to load) and keep it for :func:`take`; None if it cannot start
    (the gateway then spawns its workers as they are needed)."""
    pairs = [socket.socketpair() for _ in range(3)]
    fds = tuple(w.fileno() for _, w in pairs)
    try:
        popen = subprocess.Popen(worker_argv(fds, beat), pass_fds=fds, stdin=subprocess.DEVNULL,
                                 env=worker_env(log_level, plugins_dir, engines))
    except OSError as exc:
        for g, w in pairs:
            g.close()
            w.close()
        log.debug("no pre-spawned worker: %s", exc)
        return None
    for _, w in pairs:
        w.close()
    pre = Prespawned(popen, pairs[0][0], pairs[1][0], pairs[2][0], beat, time.monotonic(), tuple(engines))
    _slot.append(pre)
    log.debug("pre-spawned an engine worker (pid %d) before the gateway's imports", popen.pid)
    return pre


def may_take(prepared: tuple[str, ...], engine: str | None) -> bool:
    """Whether a load with ``engine`` may use a worker that prepared ``prepared``: any, unless it prepared another
    engine alone (``Engine.prepare_own_process``, which may hide libraries another engine needs)."""
    return engine is None or len(prepared) != 1 or engine in prepared


def take(engine: str | None = None) -> Prespawned | None:
    """The pre-spawned worker, once (None: none, it already exited, or it was prepared for another engine alone and
    ``engine`` asks: it stays for a later take)."""
    while _slot:
        if not may_take(_slot[-1].engines, engine):
            return None
        pre = _slot.pop()
        if pre.popen.poll() is None:
            return pre
        discard(pre)
    return None


def discard(pre: Prespawned) -> None:
    """Close the sockets (the worker exits at their EOF) and reap it."""
    for sock in (pre.down, pre.up, pre.arbiter):
        sock.close()
    if pre.popen.poll() is None:
        pre.popen.kill()
    try:
        pre.popen.wait(5)
    except subprocess.TimeoutExpired:
        pass


def discard_all() -> None:
    while _slot:
        discard(_slot.pop())
