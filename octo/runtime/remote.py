"""The gateway's side of engine workers: spawning, requests over IPC, crash containment, restart and fallbacks.

:class:`WorkerProcess` is one ``python -m octo.runtime.worker`` child; :class:`RemoteHandle` is a model served by one,
with the same surface as the in-process ``octo.runtime.model.ModelHandle``. When a worker dies (any signal or exit),
its running and queued requests end at once with a 502 ``engine_crashed`` naming the model, the engine and the
signal; the next request restarts it. A worker that stops answering (no heartbeat within its bound:
``octo.runtime.supervision``) is killed and handled the same way, its requests ending with ``engine_hung``. A worker
that
dies again within ``CRASH_WINDOW`` of its restart marks the model failed (503 at once, with the reason) until a
back-off passes (10 s, doubling up to 5 minutes) or ``POST /v1/models/{id}/load`` retries it. A worker that dies of
a signal of its own code (SIGSEGV, SIGABRT, ...) during load, warm-up or its first steps is restarted with the
engine's next fallback configuration (``Engine.fallbacks``), which is remembered for this host and artifact so the
next start does not crash first; a SIGKILL (the OOM killer, an operator) never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine, ModelInfo
from octo.errors import EngineCrashed, ModelFailed, OctoError, QueueTimeout
from octo.runtime import ipc, prespawn, supervision
from octo.runtime.arbiter import ARBITER
from octo.runtime.handle import Forwarder, WireTicket, consume_exception
from octo.runtime.supervision import configs_for, describe_exit, remember, remembered  # noqa: F401 - remembered: loader
from octo.serving import openai as serving

log = logging.getLogger("octo.runtime.remote")
CRASH_WINDOW = 60.0  # a worker that dies again this soon after a restart marks its model failed
EARLY_STEPS = 16  # a crash within this many engine steps of a start counts as a crash of the configuration


def BENCH_GRACE(seconds: float) -> float:  # noqa: N802 - a named bound
    """How long a candidate's start-up benchmark may take before it counts as hung: its budget is a ceiling
    checked before every step, so this only passes when a single step never returns."""
    return 3 * seconds + 20
_ids = itertools.count(1)


class WorkerProcess:
    """One worker child: requests (``await request(op, ...)``), fire-and-forget messages, exit detection."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.proc: Any = None  # asyncio.subprocess.Process, or PopenProcess for the pre-spawned worker
        self.pid = 0
        self.beat = supervision.beat_interval(supervision.WORKER_TIMEOUT_S)
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
        self.heard = time.monotonic()  # when the gateway last heard from it (any message, heartbeats included)
        self.silence_limit = supervision.LOAD_SILENCE_S
        self.hung_for: float | None = None  # seconds of silence after which the gateway killed it
        self.returncode: int | None = None
        self.on_tick: Callable[[float], None] = lambda now: None

    @classmethod
    async def spawn(cls, label: str, worker_timeout: float = supervision.WORKER_TIMEOUT_S) -> WorkerProcess:
        """A worker for ``label``: the spare one if there is one (started ahead, its imports done or under way),
        else a new process."""
        worker = await SPARE.take(worker_timeout)
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
        beat = supervision.beat_interval(worker_timeout)
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
        return await cls(label)._attach(proc, down_g, up_g, arb_g, worker_timeout)

    @classmethod
    async def adopt(cls, pre: prespawn.Prespawned, label: str, worker_timeout: float) -> WorkerProcess:
        """The worker ``octo serve`` started before its imports (``octo.runtime.prespawn``), on this event loop."""
        return await cls(label)._attach(PopenProcess(pre.popen), pre.down, pre.up, pre.arbiter, worker_timeout)

    async def _attach(self, proc: Any, down_g: socket.socket, up_g: socket.socket, arb_g: socket.socket,
                      worker_timeout: float) -> WorkerProcess:
        loop = asyncio.get_running_loop()
        self.silence_limit = supervision.silence_limit(worker_timeout, serving=False)
        self.beat = supervision.beat_interval(worker_timeout)
        self.exited = loop.create_future()
        self.proc = proc
        self.pid = proc.pid
        self._down = await ipc.open_reader(down_g, lambda msg: None, self._lost)
        await ipc.open_reader(up_g, self._on_message, self._lost)
        self.member = await ARBITER.attach(arb_g, self.label)
        self.heard = time.monotonic()
        self._watch = loop.create_task(supervision.watch(self))
        return self

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
        cid = next(_ids)
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
    interpreter. It is supervised like any worker (heartbeats; a silent one is killed), replaced as soon as it is taken
    once the gateway serves, and stopped with the gateway (``close``; it also dies with the gateway's process).
    ``OCTO_SPARE_WORKER=0`` turns it off (the worker ``octo serve`` starts before its imports is still used once)."""

    def __init__(self) -> None:
        self.worker: WorkerProcess | None = None
        self.enabled = False
        self.worker_timeout = supervision.WORKER_TIMEOUT_S
        self.plugins_dir: str | None = None
        self.engines: dict[str, None] = {}  # engines loaded in workers so far: a new spare prepares them
        self._starting: asyncio.Task | None = None

    async def take(self, worker_timeout: float) -> WorkerProcess | None:
        """The spare (the pre-spawned worker first), if one is alive and beats as ``worker_timeout`` wants; a new
        spare is started behind it."""
        beat = supervision.beat_interval(worker_timeout)
        pre = prespawn.take()
        if pre is not None:
            if pre.beat == beat:
                self._replenish()
                return await WorkerProcess.adopt(pre, "engine worker", worker_timeout)
            prespawn.discard(pre)
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._starting)
        worker, self.worker = self.worker, None
        self._replenish()
        if worker is None or not worker.alive or worker.beat != beat:
            if worker is not None:
                worker.kill()
            return None
        return worker

    def note(self, engine: str, plugins_dir: str | None) -> None:
        """A model loads with ``engine``: the next spare prepares it."""
        self.engines[engine] = None
        self.plugins_dir = plugins_dir

    async def enable(self, worker_timeout: float, plugins_dir: str | None, delay: float = 5.0) -> None:
        """The gateway serves: keep a spare from now on: the pre-spawned worker if no load took it, else (if a model
        loaded in a worker) a new one after ``delay`` seconds, so that it does not take the cores from the first
        requests; else a new one once a worker is taken."""
        if os.environ.get("OCTO_SPARE_WORKER", "1") == "0":
            return
        self.enabled, self.worker_timeout, self.plugins_dir = True, worker_timeout, plugins_dir
        pre = prespawn.take()
        if pre is not None and self.worker is None:
            self.worker = await WorkerProcess.adopt(pre, "spare engine worker", worker_timeout)
        elif pre is not None:
            prespawn.discard(pre)
        if self.engines:  # a gateway whose models all run in-process starts one only once a worker is needed
            self._replenish(delay)

    def _replenish(self, delay: float = 0.0) -> None:
        if self.enabled and self.worker is None and (self._starting is None or self._starting.done()):
            self._starting = asyncio.get_running_loop().create_task(self._start(delay))
            self._starting.add_done_callback(consume_exception)

    async def _start(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
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


SPARE = SpareWorker()


# -- starting a worker with fallbacks ------------------------------------------------------------------------
async def start_worker(cls: type[Engine], artifact: str, name: str, config: ServerConfig, *, first: int = 0,
                       bench: tuple[float, float | None] | None = None,
                       say: Callable[[str], None] = log.info) -> tuple[WorkerProcess, dict[str, Any]]:
    """Spawn a worker and load ``artifact`` with ``cls`` in it (warm-up, or the start-up benchmark with ``bench``:
    (seconds, leader's score)); on a crash of the configuration (``supervision.config_fault``), go on with the
    next fallback configuration; after a SIGKILL from outside, try the same configuration once more.

    Returns the worker and {"info", "batching", "load_seconds", "fallback": overlay, "fallback_reason",
    "config_index", "benchmark"}. Raises the load error, or EngineCrashed when every configuration crashed.
    """
    configs = configs_for(cls, config.options)
    i = min(first, len(configs) - 1)
    killed = 0  # outside SIGKILLs so far
    while True:
        overlay, _ = configs[i]
        label = f"{cls.name} worker for '{name}'"
        SPARE.note(cls.name, config.plugins_dir)
        worker = await WorkerProcess.spawn(label, config.worker_timeout)
        cfg = ServerConfig(**{**config.__dict__, "options": {**config.options, **overlay}})
        spec = {"engine": cls.name, "artifact": artifact, "name": name, "config": cfg,
                "plugins_dir": config.plugins_dir, "warmup": bench is None}
        phase = "loading"
        prespawn.LOADS[0] += 1  # (the request goes out before the first await below)
        try:
            loaded = await worker.request("load", spec, timeout=config.load_timeout)
            if bench is not None:
                phase, (seconds, beat) = "measuring", bench
                loaded["benchmark"] = await worker.request("bench", seconds, beat, timeout=BENCH_GRACE(seconds))
            loaded.update(fallback=overlay, fallback_reason=configs[i][1], config_index=i)
            return worker, loaded
        except EngineCrashed:
            why = worker.exit_reason or "crashed"
            if worker.hung_for is not None:
                raise EngineCrashed(f"{cls.name} hung while {phase} '{name}' ({why}).", code="engine_hung") from None
            if not supervision.config_fault(worker.returncode, False):
                killed += supervision.outside_kill(worker.returncode)
                if killed == 1 and supervision.outside_kill(worker.returncode):
                    say(f"{cls.name}: the worker was killed ({why}) while {phase} '{name}', by the OOM killer or "
                        "an operator, not by its configuration; trying the same configuration once more")
                    continue
                raise EngineCrashed(f"{cls.name} was stopped ({why}) while {phase} '{name}', from outside (the OOM "
                                    "killer or an operator: see dmesg), not by its configuration, which is kept.") \
                    from None
            if i + 1 >= len(configs):
                raise EngineCrashed(f"{cls.name} crashed ({why}) while {phase} '{name}'"
                                    + (f" with {_opts(overlay)}" if overlay else "")
                                    + "; no safer configuration is left.") from None
            i += 1
            nxt, reason = configs[i]
            say(f"{cls.name}: {reason} ({why}); serving with {_opts(nxt)}")
            remember(cls, artifact, nxt, f"{reason} ({why})")
        except TimeoutError:
            worker.kill()
            bound = f"{config.load_timeout:g} s, --load-timeout" if phase == "loading" else \
                f"{BENCH_GRACE(bench[0]):g} s"
            raise EngineCrashed(f"{cls.name} hung while {phase} '{name}' (no answer in {bound}); the worker was "
                                "stopped.", code="engine_hung") from None
        except BaseException:
            await worker.stop()
            raise


def _opts(overlay: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overlay.items())


# -- a model served by a worker --------------------------------------------------------------------------
class RemoteHandle(Forwarder):
    isolation = "process"

    def __init__(self, name: str, aliases: tuple[str, ...], engine_cls: type[Engine], artifact: str,
                 config: ServerConfig, worker: WorkerProcess, loaded: dict[str, Any],
                 selection: dict[str, Any] | None = None, benchmarks: dict[str, Any] | None = None) -> None:
        self.name, self.aliases, self.engine_cls, self.artifact = name, aliases, engine_cls, artifact
        self.engine_name = engine_cls.name
        self.config = config
        self.selection = selection or {}
        self.benchmarks = benchmarks or {}
        self.state, self.reason = "loading", None
        self.crashes = 0
        self.hangs = 0  # workers killed for silence (octo.runtime.supervision)
        self.restarts = 0
        self.failures = 0  # failures in a row (crashes soon after a restart, failed restarts): the back-off
        self.retry_at = 0.0  # monotonic time after which a failed model is tried again
        self._stats: tuple[float, dict[str, Any]] | None = None  # the worker's last figures, and when
        self.shares_cores = False
        self._requests = {}
        self._restarting: asyncio.Task | None = None
        self._adopt(worker, loaded)

    def _adopt(self, worker: WorkerProcess, loaded: dict[str, Any]) -> None:
        self.worker = worker
        self.info: ModelInfo = loaded["info"]
        self.batching = loaded["batching"]
        self.config_index = loaded.get("config_index", 0)
        self.fallback = loaded.get("fallback") or {}
        self.fallback_reason = loaded.get("fallback_reason")
        self.started_at = time.monotonic()
        self.threads_limit: int | None = None  # set by the registry while several models are busy
        worker.on_events = self.on_wire
        worker.on_exit = self._on_exit
        worker.on_tick = self._expire_queued

    def worker_info(self) -> dict[str, Any]:
        member = getattr(self.worker, "member", None)
        return {"pid": self.worker.pid, "alive": self.worker.alive, "crashes": self.crashes,
                "restarts": self.restarts, "fallback": self.fallback or None,
                "fallback_reason": self.fallback_reason, "shares_cores": self.shares_cores,
                "hangs": self.hangs, "heartbeat_age_s": round(time.monotonic() - self.worker.heard, 3),
                "silence_limit_s": self.worker.silence_limit, "compute_turns": member.turns if member else 0,
                "compute_wait_s": round(member.waited, 3) if member else 0.0,
                "threads_limit": self.threads_limit}

    @property
    def silent(self) -> bool:
        """Not heard from for three heartbeats (2 s at least): /health and /v1/models say "unresponsive"."""
        worker = self.worker
        quiet = max(2.0, 3 * supervision.beat_interval(self.config.worker_timeout))
        return worker.alive and time.monotonic() - worker.heard > quiet

    async def limit_threads(self, n: int | None) -> None:
        """At most ``n`` compute threads for this model while others are busy too (None: its own count again)."""
        self.threads_limit = n
        if self.worker.alive and self.state == "ready":
            try:
                await self.worker.request("threads", n)
            except EngineCrashed:
                pass  # a restarted worker starts with its full thread count
            except OctoError as exc:  # its set_threads failed: it computes with what it has
                log.warning("%s: could not limit its threads to %s: %s", self.name, n, exc.message)

    async def share_cores(self, on: bool) -> None:
        """Compute in turns with the other loaded models (octo.runtime.arbiter), or freely when alone."""
        self.shares_cores = on
        if self.worker.alive and self.state == "ready":
            await self.worker.request("share_cores", on)

    # -- life cycle --------------------------------------------------------------------------------------
    async def activate(self, config: ServerConfig) -> None:
        if self.state == "loading":  # once per worker
            await self.worker.request("serve", config)
            self.worker.silence_limit = supervision.silence_limit(config.worker_timeout, serving=True)
            self.state = "ready"
            if self.shares_cores:  # a restarted worker takes its turns like the one before it
                await self.worker.request("share_cores", True)

    async def close(self) -> None:
        self.state = "stopped"
        await self.worker.stop()

    async def retry_now(self) -> None:
        """``POST /v1/models/{id}/load``: a failed model is restarted now, its back-off notwithstanding."""
        if self.state == "failed":
            self.retry_at = 0.0
        await self.ensure_ready()

    async def ensure_ready(self) -> None:
        """Ready to serve, restarting a crashed worker (or a failed model once its back-off has passed); a restart
        is waited for up to ``--load-timeout``."""
        if self.state == "ready":
            return
        wait = self.retry_at - time.monotonic()
        if self.state == "failed" and wait > 0:
            raise ModelFailed(f"Model '{self.name}' ({self.engine_name}) has failed: {self.reason}. It is tried again "
                              f"in {math.ceil(wait)} s, or now with POST /v1/models/{self.name}/load.",
                              headers=supervision.retry_after(wait))
        if self.state in ("crashed", "failed") and self._restarting is None:
            self._restarting = asyncio.get_running_loop().create_task(self._restart())
            self._restarting.add_done_callback(consume_exception)
        if self._restarting is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._restarting), self.config.load_timeout)
            except TimeoutError:
                raise QueueTimeout(f"Model '{self.name}' is restarting; it did not come back within "
                                   f"{self.config.load_timeout:g} s (--load-timeout).", code="load_timeout",
                                   headers={"Retry-After": "5"}) from None
        if self.state != "ready":
            raise ModelFailed(f"Model '{self.name}' is not available ({self.state}): {self.reason}",
                              headers={"Retry-After": "5"})

    def _on_exit(self, why: str) -> None:
        """The worker died or was killed for silence: end its requests now; the next request restarts it (or the
        model fails for a back-off)."""
        worker = self.worker
        self.crashes += 1
        hung = worker.hung_for is not None
        self.hangs += hung
        soon = time.monotonic() - self.started_at < CRASH_WINDOW and self.restarts > 0
        if hung:
            err = EngineCrashed(f"The {self.engine_name} engine serving '{self.name}' stopped answering: no sign of "
                                f"life for {worker.hung_for:.1f} s (bound {worker.silence_limit:g} s, "
                                "--worker-timeout); the worker was killed and its running and queued requests were "
                                "ended. The next request restarts it.", param="model", code="engine_hung")
            self.reason = f"the {self.engine_name} worker hung ({why})"
        else:
            err = EngineCrashed(f"The {self.engine_name} engine serving '{self.name}' crashed ({why}); its running "
                                "and queued requests were ended. The next request restarts it.", param="model")
            # wedged or dead engine thread: it stopped itself (octo.scheduler.watchdog)
            stopped = worker.fault is not None
            self.reason = f"the {self.engine_name} worker " + (f"stopped: {why}" if stopped else f"crashed ({why})")
        self.fail_all(err)
        configs = configs_for(self.engine_cls, self.config.options)
        # only a signal of its own code soon after a start can be the configuration's fault (never a SIGKILL)
        blame = worker.messages < EARLY_STEPS and worker.fault is None and supervision.config_fault(
            worker.returncode, hung)
        can_fall_back = blame and self.config_index + 1 < len(configs)
        if self.state == "stopped":
            return
        self._next_config = self.config_index + 1 if can_fall_back else self.config_index
        if soon and not can_fall_back:
            self._failed(f" again within {CRASH_WINDOW:g} s of a restart")
        else:
            self.failures = self.failures if soon else 0
            self.state = "crashed"
        log.error("%s: %s", self.name, self.reason)

    def _failed(self, why: str) -> None:
        self.failures += 1
        delay = supervision.backoff(self.failures)
        self.retry_at = time.monotonic() + delay
        self.state = "failed"
        self.reason = f"{self.reason or 'failed'}{why}; retried in {delay:g} s"

    async def _restart(self) -> None:
        cls = self.engine_cls
        self.state, self.loading_since = "loading", time.monotonic()
        first = self._next_config
        if first != self.config_index:
            overlay, why = configs_for(cls, self.config.options)[first]
            log.warning("%s: %s (%s); serving with %s", cls.name, why, self.reason, _opts(overlay))
            remember(cls, self.artifact, overlay, f"{why} ({self.reason})")
        try:
            worker, loaded = await start_worker(cls, self.artifact, self.name, self.config, first=first)
            self._adopt(worker, loaded)
            await self.activate(self.config)
        except BaseException as exc:
            self.reason = f"restart failed: {getattr(exc, 'message', None) or exc}"
            self._failed("")
            log.error("%s: %s", self.name, self.reason)
            if isinstance(exc, Exception):
                raise ModelFailed(f"Model '{self.name}' ({cls.name}) could not be restarted: {self.reason}",
                                  param="model", headers=supervision.retry_after(self.retry_at - time.monotonic())) \
                    from None
            raise
        finally:
            self._restarting = None
        self.restarts += 1
        self.reason = None
        log.warning("%s: %s worker restarted (pid %d)", self.name, cls.name, self.worker.pid)

    # -- requests ----------------------------------------------------------------------------------------
    async def submit(self, kind: str, req: Any, size: int = 0) -> tuple[list[WireTicket], asyncio.Queue | None]:
        """Send the request to the worker, which prepares (templates, tokenizes, validates) and queues it; a
        refusal (400, 503 queue full) comes back on every ticket's result and admission."""
        loop = asyncio.get_running_loop()
        rid = next(_ids)
        tickets = [WireTicket(loop, rid, i) for i in range(serving.sequence_count(kind, req))]
        events = self.open_request(rid, tickets, bool(req.stream))
        self.worker.send(("gen", rid, kind, req))
        return tickets, events

    def _cancel(self, rid: int, tracked: bool) -> None:
        if tracked:
            self.worker.send(("cancel", rid))

    async def stats(self) -> dict[str, Any]:
        if self.state != "ready":  # no worker to ask: nothing is queued or running for this model
            queue = {"pending": 0, "active": 0, "calls_running": 0, "max_batch": self.config.max_batch,
                     "max_queue": self.config.max_queue, "max_depth": 0, "total_processed": 0, "total_rejected": 0,
                     "total_timeouts": 0, "total_cancelled": 0, "batching": self.batching, "steps": 0,
                     "generated_tokens": 0, "state": self.state}
            return {"queue": queue, "cache": None}
        try:
            got = await self.worker.request("stats", timeout=supervision.STATS_WAIT_S)
        except TimeoutError:  # a busy or silent worker: /v1/queue/stats, /metrics, the dashboard answer anyway
            return self._stale_stats()
        except EngineCrashed:
            return await self._op("stats")  # the same error, worded for the model
        self._stats = (time.monotonic(), got)
        return got

    def _stale_stats(self) -> dict[str, Any]:
        """The worker's last figures marked stale, with what the gateway itself knows of its requests now."""
        when, last = self._stats or (None, {"queue": {"max_batch": self.config.max_batch,
                                                      "max_queue": self.config.max_queue}, "cache": None})
        out = supervision.stale_copy(last, None if when is None else time.monotonic() - when)
        tickets = [t for r in self._requests.values() for t in r.tickets]
        out["queue"] = out.get("queue") or {"stale": True, "age_s": None}
        out["queue"].update(pending=sum(t.state == "pending" for t in tickets),
                            active=sum(t.state == "active" for t in tickets), state=self.state)
        return out

    def _expire_queued(self, now: float) -> None:
        """(every supervision tick) A request still not admitted ``QUEUE_GRACE_S`` after ``--queue-timeout`` gets
        its 504 from the gateway: the worker's own deadline should have ended it, so the worker is late or silent."""
        limit = self.config.queue_timeout + supervision.QUEUE_GRACE_S
        late = []
        for rid, req in self._requests.items():  # in the order they came
            if now - req.since < limit:
                break
            if any(t.state == "pending" for t in req.tickets):
                late.append(rid)
        for rid in late:
            self.worker.send(("cancel", rid))
            self.fail_request(rid, QueueTimeout(
                f"The request waited {self.config.queue_timeout:g} s (--queue-timeout) for '{self.name}' without "
                "being admitted; the gateway ended it.", headers={"Retry-After": "5"}))

    async def _op(self, op: str, *args: Any) -> Any:
        try:
            return await self.worker.request(op, *args)
        except EngineCrashed:
            raise EngineCrashed(f"The {self.engine_name} engine serving '{self.name}' crashed "
                                f"({self.worker.exit_reason}); the next request restarts it.", param="model") from None

