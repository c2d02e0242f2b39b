"""Engine worker processes, as the gateway sees them: :class:`WorkerProcess` (one ``python -m octo.runtime.worker``
child: requests over IPC, heartbeats, exit), the spare worker kept warm (:class:`SpareWorker`, ``SPARE``) and
:func:`start_worker`, which loads a model in a worker with the engine's fallback configurations.
``octo.runtime.remote.RemoteHandle`` serves a model with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine
from octo.errors import EngineCrashed, OctoError
from octo.logsafe import quoted
from octo.runtime import ipc, prespawn, supervision
from octo.runtime.arbiter import ARBITER
from octo.runtime.handle import consume_exception
from octo.runtime.supervision import configs_for, describe_exit, remember, remembered  # noqa: F401 - remembered: loader

log = logging.getLogger("octo.runtime.remote")


def BENCH_GRACE(seconds: float, loaded: dict | None = None) -> float:  # noqa: N802 - a named bound
    """How long a candidate's start-up benchmark may take before it counts as hung: its budget is a ceiling
    checked before every step, so this only passes when a single step never returns. A vision model's benchmark
    encodes a picture first, which takes about what the load's own warm-up encode took: its load time is added."""
    info = (loaded or {}).get("info")
    extra = float(loaded.get("load_seconds") or 0.0) if info is not None and getattr(info, "takes_images", False) else 0
    return 3 * seconds + 20 + extra
IDS = itertools.count(1)  # call and request ids over the IPC, one sequence for both (octo.runtime.remote)


class WorkerProcess:
    """One worker child: requests (``await request(op, ...)``), fire-and-forget messages, exit detection."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.proc: Any = None  # asyncio.subprocess.Process, or PopenProcess for the pre-spawned worker
        self.pid = 0
        self.beat = prespawn.beat_interval(supervision.WORKER_TIMEOUT_S)
        self.member: Any = None
        self._down: ipc.FrameReader | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self.on_events: Callable[[list], None] = lambda events: None
        self.on_exit: Callable[[str], None] = lambda why: None
        self.exited: asyncio.Future | None = None
        self.exit_reason: str | None = None
        self.messages = 0  # event messages received (about one per engine step)
        self.stopping = False
        self.fault: str | None = None
        self._reaping = False
        # the engines it prepared while it waited for a model; one alone: prepared for that engine only
        # (Engine.prepare_own_process, which may hide libraries another engine needs), so no other engine takes it
        self.preloaded: tuple[str, ...] = ()
        self.heard = time.monotonic()  # when the gateway last heard from it (any message, heartbeats included)
        self.silence_limit = supervision.LOAD_SILENCE_S
        self.hung_for: float | None = None  # seconds of silence after which the gateway killed it
        self.returncode: int | None = None
        self.on_tick: Callable[[float], None] = lambda now: None

    @classmethod
    async def spawn(cls, label: str, worker_timeout: float = supervision.WORKER_TIMEOUT_S,
                    engine: str | None = None) -> WorkerProcess:
        """A worker for ``label`` (to load ``engine``): the spare one if there is one that may take it (started ahead,
        its imports done or under way), else a new process."""
        worker = await SPARE.take(worker_timeout, engine)
        if worker is not None:
            worker.relabel(label)
            log.debug("%s: the spare worker (pid %d) takes it", label, worker.pid)
            return worker
        return await cls.start(label, worker_timeout)

    @classmethod
    async def start(cls, label: str, worker_timeout: float = supervision.WORKER_TIMEOUT_S,
                    preload: tuple[str | None, tuple[str, ...]] | None = None) -> WorkerProcess:
        """A new worker process (``preload``: (plugins_dir, engines) it prepares while it waits for a model)."""
        down_g, down_w = socket.socketpair()
        up_g, up_w = socket.socketpair()
        arb_g, arb_w = socket.socketpair()
        beat = prespawn.beat_interval(worker_timeout)
        try:
            fds = (down_w.fileno(), up_w.fileno(), arb_w.fileno())
            env = prespawn.worker_env(logging.getLogger().level, *(preload or (None, None)))
            proc = await asyncio.create_subprocess_exec(*prespawn.worker_argv(fds, beat), pass_fds=fds,
                                                        stdin=asyncio.subprocess.DEVNULL, env=env)
        except BaseException:
            for sock in (down_g, up_g, arb_g):
                sock.close()
            raise
        finally:
            down_w.close()
            up_w.close()
            arb_w.close()
        worker = cls(label)
        worker.preloaded = tuple(preload[1]) if preload else ()
        return await worker._attach(proc, down_g, up_g, arb_g, worker_timeout)

    @classmethod
    async def adopt(cls, pre: prespawn.Prespawned, label: str, worker_timeout: float) -> WorkerProcess:
        """The worker ``octo serve`` started before its imports (``octo.runtime.prespawn``), on this event loop."""
        worker = cls(label)
        worker.preloaded = pre.engines
        return await worker._attach(PopenProcess(pre.popen), pre.down, pre.up, pre.arbiter, worker_timeout)

    async def _attach(self, proc: Any, down_g: socket.socket, up_g: socket.socket, arb_g: socket.socket,
                      worker_timeout: float) -> WorkerProcess:
        loop = asyncio.get_running_loop()
        self.silence_limit = supervision.silence_limit(worker_timeout, serving=False)
        self.beat = prespawn.beat_interval(worker_timeout)
        self.exited = loop.create_future()
        self.proc = proc
        self.pid = proc.pid
        self._down = await ipc.open_reader(down_g, lambda msg: None, self._lost)
        await ipc.open_reader(up_g, self._on_message, self._lost)
        self.member = await ARBITER.attach(arb_g, self.label)
        self.heard = time.monotonic()
        self._watch = loop.create_task(supervision.watch(self))
        return self

    def may_take(self, engine: str | None) -> bool:
        """Whether a load with ``engine`` may use this worker (``prespawn.may_take``)."""
        return prespawn.may_take(self.preloaded, engine)

    def relabel(self, label: str) -> None:
        self.label = label
        if self.member is not None:
            self.member.label = label

    @property
    def alive(self) -> bool:
        return self.exit_reason is None

    def send(self, msg: tuple) -> None:
        if self._down is not None and self.alive:
            self._down.send(msg)

    async def request(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        if not self.alive:
            raise EngineCrashed(f"{self.label}: the worker is not running ({self.exit_reason}).")
        cid = next(IDS)
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        self.send((op, cid, *args))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.CancelledError:  # the caller went away: the worker drops the operation (its queued call)
            if self.alive and op == "call":
                with contextlib.suppress(Exception):
                    self.send(("cancel_op", cid))
            raise
        finally:
            self._pending.pop(cid, None)

    def _on_message(self, msg: tuple) -> None:
        self.heard = time.monotonic()
        kind = msg[0]
        if kind == "hb":
            return
        if kind == "ev":
            self.messages += 1
            self.on_events(msg[1])
        elif kind == "r":
            fut = self._pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[2]:
                    fut.set_result(msg[3])
                else:
                    fut.set_exception(msg[3])
        elif kind == "bye":
            self.stopping = True
        elif kind == "fault":  # its engine thread was wedged or dead; it exits next (octo.scheduler.watchdog)
            self.fault = msg[1]

    def hang(self, silent: float) -> None:
        """Silent past its bound: kill it (it may be stopped, deadlocked or in a C call holding the GIL: nothing
        short of SIGKILL ends that) and reap it now, as a crash."""
        self.hung_for = silent
        self.fault = (f"no sign of life for {silent:.1f} s (bound {self.silence_limit:g} s): stopped, deadlocked or "
                      "holding the GIL; killed")
        log.error("%s: %s", self.label, self.fault)
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        self._lost()

    def _lost(self) -> None:
        if self.exited is not None and not self.exited.done() and not self._reaping:
            self._reaping = True
            asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        try:
            code = await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:  # the socket closed but the process lives on: it is of no use any more
            self.proc.kill()
            try:
                code = await asyncio.wait_for(self.proc.wait(), 5.0)
            except TimeoutError:  # not even SIGKILL ends it yet (uninterruptible I/O): its requests end anyway
                code = -signal.SIGKILL
        self.returncode = code
        self.exit_reason = describe_exit(code) if self.fault is None else f"{self.fault}; {describe_exit(code)}"
        if self._down is not None and self._down.transport is not None:
            self._down.transport.close()
        crash = None if self.stopping and code == 0 else EngineCrashed(
            f"{self.label} crashed ({self.exit_reason}).")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(crash or EngineCrashed(f"{self.label} stopped."))
        self._pending.clear()
        self.exited.set_result(code)
        if crash is not None:
            self.on_exit(self.exit_reason)

    async def stop(self, timeout: float = 10.0) -> None:
        """Unload and exit (the worker fails what it still has with 503 "shutting down"); kill after ``timeout``."""
        if not self.alive:
            return
        self.stopping = True
        try:
            await self.request("stop", timeout=timeout)
        except (TimeoutError, OctoError):
            pass
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), timeout)
        except TimeoutError:
            self.kill()
            await self.exited

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.stopping = True
            self.proc.kill()


class PopenProcess:
    """What ``WorkerProcess`` uses of ``asyncio.subprocess.Process``, for a worker started with ``subprocess.Popen``
    before the event loop ran (``octo.runtime.prespawn``). ``wait`` polls: it is awaited only once the worker's
    sockets closed, when it is exiting."""

    def __init__(self, popen: Any) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    async def wait(self) -> int:
        while self._popen.poll() is None:
            await asyncio.sleep(0.01)
        return self._popen.returncode


class SpareWorker:
    """One idle worker process kept ready (Python started, octo and the engines' plugins imported, the native
    library of the engines the gateway has used loaded, no model), so that a load on demand, a switch under
    ``--max-loaded`` or a restart skips the interpreter's start and imports. One at a time: it costs one idle
    interpreter. It is supervised like any worker (heartbeats; a silent one is killed), replaced 2 s after it is taken
    once the gateway serves, and stopped with the gateway (``close``; it also dies with the gateway's process).
    ``OCTO_SPARE_WORKER=0`` turns it off (the worker ``octo serve`` starts before its imports is still used once)."""

    def __init__(self) -> None:
        self.worker: WorkerProcess | None = None
        self.enabled = False
        self.worker_timeout = supervision.WORKER_TIMEOUT_S
        self.plugins_dir: str | None = None
        self.engines: dict[str, None] = {}  # engines loaded in workers so far: a new spare prepares them
        self._starting: asyncio.Task | None = None
        self._hold: asyncio.Event | None = None  # the task in _starting waits out its delay until this is set
        self.lull: Callable[[], bool] = lambda: True  # whether no request runs (the registry's, once it serves)

    async def take(self, worker_timeout: float, engine: str | None = None) -> WorkerProcess | None:
        """The spare (the pre-spawned worker first), if one is alive, beats as ``worker_timeout`` wants and may take
        ``engine`` (``WorkerProcess.may_take``); a new spare is started behind it. A spare prepared for another engine
        alone stays the spare."""
        beat = prespawn.beat_interval(worker_timeout)
        pre = prespawn.take(engine)
        if pre is not None:
            if pre.beat == beat:
                self._replenish(REPLACE_DELAY_S)
                return await WorkerProcess.adopt(pre, "engine worker", worker_timeout)
            prespawn.discard(pre)
        if self._starting is not None and not self._starting.done():
            self.hurry()  # a replacement still waiting out its delay starts now: no slower than a new process
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._starting)
        if self.worker is not None and self.worker.alive and not self.worker.may_take(engine):
            return None
        worker, self.worker = self.worker, None
        self._replenish(REPLACE_DELAY_S)
        if worker is None or not worker.alive or worker.beat != beat:
            if worker is not None:
                worker.kill()
            return None
        return worker

    def hurry(self) -> None:
        """A load is on its way to take the spare: a replacement still waiting out its delay starts now, so that its
        start and imports overlap what comes before the take (unloading the model it replaces, the model's
        resolution) instead of following it."""
        if self._hold is not None:
            self._hold.set()

    def note(self, engine: str, plugins_dir: str | None) -> None:
        """A model loads with ``engine``: the next spare prepares it."""
        self.engines[engine] = None
        self.plugins_dir = plugins_dir

    async def enable(self, worker_timeout: float, plugins_dir: str | None, delay: float = 5.0,
                     lull: Callable[[], bool] | None = None) -> None:
        """The gateway serves: keep a spare from now on: the pre-spawned worker if no load took it, else (if a model
        loaded in a worker) a new one after ``delay`` seconds, so that it does not take the cores from the first
        requests; else a new one once a worker is taken. A new one waits for a ``lull`` as well (no request
        running; at most ``LULL_WAIT_S`` more)."""
        if os.environ.get("OCTO_SPARE_WORKER", "1") == "0":
            return
        self.enabled, self.worker_timeout, self.plugins_dir = True, worker_timeout, plugins_dir
        if lull is not None:
            self.lull = lull
        pre = prespawn.take()
        if pre is not None and self.worker is None:
            self.worker = await WorkerProcess.adopt(pre, "spare engine worker", worker_timeout)
        elif pre is not None:
            prespawn.discard(pre)
        if self.engines:  # a gateway whose models all run in-process starts one only once a worker is needed
            self._replenish(delay)

    def _replenish(self, delay: float = 0.0) -> None:
        if self.enabled and self.worker is None and (self._starting is None or self._starting.done()):
            self._hold = asyncio.Event() if delay else None
            self._starting = asyncio.get_running_loop().create_task(self._start(delay, self._hold))
            self._starting.add_done_callback(consume_exception)

    async def _start(self, delay: float, hold: asyncio.Event | None) -> None:
        if hold is not None:  # the delay, then a lull (its interpreter start and imports take a core for 0.3 s and
            # more: not from a stream), each cut short by hurry()
            end = time.monotonic() + delay + LULL_WAIT_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hold.wait(), delay)
            while not hold.is_set() and not self.lull() and time.monotonic() < end:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hold.wait(), LULL_POLL_S)
            if self._hold is hold:
                self._hold = None
        worker = await WorkerProcess.start("spare engine worker", self.worker_timeout,
                                           preload=(self.plugins_dir, tuple(self.engines)))
        if self.enabled and self.worker is None:
            self.worker = worker
        else:
            await worker.stop()

    async def close(self) -> None:
        """The gateway stops: so does the spare (and a pre-spawned worker nothing took)."""
        self.enabled = False
        prespawn.discard_all()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            with contextlib.suppress(BaseException):
                await self._starting
        worker, self.worker = self.worker, None
        if worker is not None:
            await worker.stop()

    def info(self) -> dict[str, Any] | None:
        worker = self.worker
        return {"pid": worker.pid, "alive": worker.alive} if worker is not None else None


# seconds between taking the spare and starting its replacement: the load that took it (about a second for a small
# model) and its first request get the cores first; a take meanwhile starts a process at once
REPLACE_DELAY_S = 2.0
LULL_WAIT_S = 30.0  # then it waits for a lull in the requests, this long at most (a gateway busy for good gets one)
LULL_POLL_S = 0.25
SPARE = SpareWorker()


# -- starting a worker with fallbacks ------------------------------------------------------------------------
async def start_worker(cls: type[Engine], artifact: str, name: str, config: ServerConfig, *, first: int = 0,
                       bench: tuple[Any, ...] | None = None, say: Callable[[str], None] = log.info,
                       spawned: Callable[[WorkerProcess], None] | None = None, spare: bool = True
                       ) -> tuple[WorkerProcess, dict[str, Any]]:
    """Spawn a worker (the spare unless not ``spare``; ``spawned`` sees it at once: one to kill) and load ``artifact``
    with ``cls`` in it (warm-up, or the start-up benchmark: ``bench``, micro_benchmark's arguments); on a crash of
    the configuration (``supervision.config_fault``), go on with the next fallback configuration; after a SIGKILL
    from outside, try the same configuration once more. Returns the worker and {"info", "batching", "load_seconds",
    "fallback": overlay, "fallback_reason", "config_index", "benchmark"}; raises the load error, or EngineCrashed."""
    configs = configs_for(cls, config.options)
    i = min(first, len(configs) - 1)
    killed = 0  # outside SIGKILLs so far
    while True:
        overlay, label = configs[i][0], f"{cls.name} worker for '{name}'"
        SPARE.note(cls.name, config.plugins_dir)
        worker = await (WorkerProcess.spawn(label, config.worker_timeout, cls.name) if spare
                        else WorkerProcess.start(label, config.worker_timeout))
        (spawned or bool)(worker)  # the caller sees it at once (bool: no one looks)
        cfg = ServerConfig(**{**config.__dict__, "options": {**config.options, **overlay}})
        spec = {"engine": cls.name, "artifact": artifact, "name": name, "config": cfg,
                "plugins_dir": config.plugins_dir, "warmup": bench is None}
        phase = "loading"
        prespawn.LOAD_HANDED_OVER.set()  # (the request goes out before the first await below)
        try:
            loaded = await worker.request("load", spec, timeout=config.load_timeout)
            if bench is not None:
                phase = "measuring"
                loaded["benchmark"] = await worker.request("bench", *bench, timeout=BENCH_GRACE(bench[0], loaded))
            loaded.update(fallback=overlay, fallback_reason=configs[i][1], config_index=i)
            return worker, loaded
        except EngineCrashed:
            why = worker.exit_reason or "crashed"
            if worker.hung_for is not None:
                raise EngineCrashed(f"{cls.name} hung while {phase} '{name}' ({why}).", code="engine_hung") from None
            if not supervision.config_fault(worker.returncode, False):
                killed += supervision.outside_kill(worker.returncode)
                if killed == 1 and supervision.outside_kill(worker.returncode):
                    say(f"{cls.name}: the worker was killed ({why}) while {phase} '{quoted(name, bare=True)}', by the "
                        "OOM killer or an operator, not by its configuration; trying the same configuration once more")
                    continue
                raise EngineCrashed(f"{cls.name} was stopped ({why}) while {phase} '{name}', from outside (the OOM "
                                    "killer or an operator: see dmesg), not by its configuration, which is kept.") \
                    from None
            if i + 1 >= len(configs):
                raise EngineCrashed(f"{cls.name} crashed ({why}) while {phase} '{name}'"
                                    + (f" with {options_text(overlay)}" if overlay else "")
                                    + "; no safer configuration is left.") from None
            i += 1
            nxt, reason = configs[i]
            say(f"{cls.name}: {reason} ({why}); serving with {options_text(nxt)}")
            remember(cls, artifact, nxt, f"{reason} ({why})")
        except TimeoutError:
            worker.kill()
            bound = f"{config.load_timeout:g} s, --load-timeout" if phase == "loading" else \
                f"{BENCH_GRACE(bench[0], loaded):g} s"
            raise EngineCrashed(f"{cls.name} hung while {phase} '{name}' (no answer in {bound}); the worker was "
                                "stopped.", code="engine_hung") from None
        except BaseException:
            await worker.stop()
            raise


def options_text(overlay: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overlay.items())
