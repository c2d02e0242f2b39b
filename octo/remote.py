"""The gateway's side of engine workers: spawning, requests over IPC, crash containment, restart and fallbacks.

:class:`WorkerProcess` is one ``python -m octo.worker`` child; :class:`RemoteHandle` is a model served by one,
with the same surface as the in-process ``octo.model.ModelHandle``. When a worker dies (any signal or exit),
its running and queued requests end at once with a 502 ``engine_crashed`` naming the model, the engine and the
signal; the next request restarts it. A worker that dies again within ``CRASH_WINDOW`` of its restart marks the
model failed (503 at once, with the reason) instead of restarting in a loop. A worker that dies during load,
warm-up or its first steps is restarted with the engine's next fallback configuration (``Engine.fallbacks``),
which is remembered for this host and artifact so the next start does not crash first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from octo import ipc, serving
from octo.arbiter import ARBITER
from octo.config import ServerConfig
from octo.engine import Engine, ModelInfo
from octo.errors import EngineCrashed, ModelFailed, OctoError, QueueTimeout
from octo.handle import Forwarder, WireTicket
from octo.paths import bench_dir

log = logging.getLogger("octo.remote")
CRASH_WINDOW = 60.0  # a worker that dies again this soon after a restart marks its model failed
EARLY_STEPS = 16  # a crash within this many engine steps of a start counts as a crash of the configuration
LOAD_TIMEOUT = 900.0


def BENCH_GRACE(seconds: float) -> float:  # noqa: N802 - a named bound, like LOAD_TIMEOUT
    """How long a candidate's start-up benchmark may take before it counts as hung: its budget is a ceiling
    checked before every step, so this only passes when a single step never returns."""
    return 3 * seconds + 20
_ids = itertools.count(1)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class WorkerProcess:
    """One worker child: requests (``await request(op, ...)``), fire-and-forget messages, exit detection."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.proc: asyncio.subprocess.Process | None = None
        self.pid = 0
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

    @classmethod
    async def spawn(cls, label: str) -> WorkerProcess:
        self = cls(label)
        loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
        down_g, down_w = socket.socketpair()
        up_g, up_w = socket.socketpair()
        arb_g, arb_w = socket.socketpair()
        try:
            fds = (down_w.fileno(), up_w.fileno(), arb_w.fileno())
            env = {**os.environ, "OCTO_LOG_LEVEL": logging.getLevelName(logging.getLogger().level)}
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "octo.worker", *map(str, fds), str(os.getpid()),
                pass_fds=fds, stdin=asyncio.subprocess.DEVNULL, env=env)
        finally:
            down_w.close()
            up_w.close()
            arb_w.close()
        self.pid = self.proc.pid
        self._down = await ipc.open_reader(down_g, lambda msg: None, self._lost)
        await ipc.open_reader(up_g, self._on_message, self._lost)
        self.member = await ARBITER.attach(arb_g, label)
        return self

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
        kind = msg[0]
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
        elif kind == "fault":  # its engine thread was wedged or dead; it exits next (octo.watchdog)
            self.fault = msg[1]

    def _lost(self) -> None:
        if self.exited is not None and not self.exited.done() and not self._reaping:
            self._reaping = True
            asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        try:
            code = await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:  # the socket closed but the process lives on: it is of no use any more
            self.proc.kill()
            code = await self.proc.wait()
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


# -- starting a worker with fallbacks ------------------------------------------------------------------------
def _memo_file(cls: type[Engine], artifact: str):
    from octo.selection import cache_key

    key = json.dumps(cache_key(cls, artifact), sort_keys=True)
    return bench_dir() / f"fallback-{cls.name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _configs(cls: type[Engine], options: dict[str, str]) -> list[tuple[dict[str, str], str | None]]:
    """The base configuration, then each fallback whose options the user did not set explicitly."""
    return [({}, None), *((o, why) for o, why in cls.fallbacks if not set(o) & set(options))]


def remembered(cls: type[Engine], artifact: str, options: dict[str, str]) -> int:
    """Index into ``_configs`` of the fallback that worked here before (0: the base configuration)."""
    try:
        overlay = json.loads(_memo_file(cls, artifact).read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    for i, (o, _) in enumerate(_configs(cls, options)):
        if o == overlay:
            return i
    return 0


def remember(cls: type[Engine], artifact: str, overlay: dict[str, str], why: str) -> None:
    from octo.atomic import write_json  # atomic, and a writer killed midway leaves no stale file

    write_json(_memo_file(cls, artifact), {"options": overlay, "reason": why})


async def start_worker(cls: type[Engine], artifact: str, name: str, config: ServerConfig, *, first: int = 0,
                       bench: tuple[float, float | None] | None = None,
                       say: Callable[[str], None] = log.info) -> tuple[WorkerProcess, dict[str, Any]]:
    """Spawn a worker and load ``artifact`` with ``cls`` in it (warm-up, or the start-up benchmark with ``bench``:
    (seconds, leader's score)); on a crash, go on with the next fallback configuration.

    Returns the worker and {"info", "batching", "load_seconds", "fallback": overlay, "fallback_reason",
    "config_index", "benchmark"}. Raises the load error, or EngineCrashed when every configuration crashed.
    """
    configs = _configs(cls, config.options)
    i = min(first, len(configs) - 1)
    while True:
        overlay, _ = configs[i]
        label = f"{cls.name} worker for '{name}'"
        worker = await WorkerProcess.spawn(label)
        cfg = ServerConfig(**{**config.__dict__, "options": {**config.options, **overlay}})
        spec = {"engine": cls.name, "artifact": artifact, "name": name, "config": cfg,
                "plugins_dir": config.plugins_dir, "warmup": bench is None}
        phase = "loading"
        try:
            loaded = await worker.request("load", spec, timeout=LOAD_TIMEOUT)
            if bench is not None:
                phase, (seconds, beat) = "measuring", bench
                loaded["benchmark"] = await worker.request("bench", seconds, beat, timeout=BENCH_GRACE(seconds))
            loaded.update(fallback=overlay, fallback_reason=configs[i][1], config_index=i)
            return worker, loaded
        except EngineCrashed:
            why = worker.exit_reason or "crashed"
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
            raise EngineCrashed(f"{cls.name} hung while {phase} '{name}' (no answer in time); the worker was "
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
        self.restarts = 0
        self.shares_cores = False
        self._requests = {}
        self._lock = asyncio.Lock()
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

    def worker_info(self) -> dict[str, Any]:
        member = getattr(self.worker, "member", None)
        return {"pid": self.worker.pid, "alive": self.worker.alive, "crashes": self.crashes,
                "restarts": self.restarts, "fallback": self.fallback or None,
                "fallback_reason": self.fallback_reason, "shares_cores": self.shares_cores,
                "compute_turns": member.turns if member else 0,
                "compute_wait_s": round(member.waited, 3) if member else 0.0,
                "threads_limit": self.threads_limit}

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
        """Compute in turns with the other loaded models (octo.arbiter), or freely when alone."""
        self.shares_cores = on
        if self.worker.alive and self.state == "ready":
            await self.worker.request("share_cores", on)

    # -- life cycle --------------------------------------------------------------------------------------
    async def activate(self, config: ServerConfig) -> None:
        if self.state == "loading":  # once per worker
            await self.worker.request("serve", config)
            self.state = "ready"
            if self.shares_cores:  # a restarted worker takes its turns like the one before it
                await self.worker.request("share_cores", True)

    async def close(self) -> None:
        self.state = "stopped"
        await self.worker.stop()

    async def ensure_ready(self) -> None:
        if self.state == "ready":
            return
        async with self._lock:  # concurrent requests wait for one restart
            if self.state == "failed":
                raise ModelFailed(f"Model '{self.name}' ({self.engine_name}) has failed and is not restarted: "
                                  f"{self.reason}", headers={"Retry-After": "60"})
            if self.state == "crashed":
                try:
                    await asyncio.wait_for(self._restart(), self.config.queue_timeout)
                except TimeoutError:
                    raise QueueTimeout(f"Model '{self.name}' is restarting; it did not come back within "
                                       f"{self.config.queue_timeout:g} s.") from None
            if self.state != "ready":
                raise ModelFailed(f"Model '{self.name}' is not available ({self.state}): {self.reason}",
                                  headers={"Retry-After": "5"})

    def _on_exit(self, why: str) -> None:
        """The worker died: end its requests now; the next request restarts it (or the model fails)."""
        self.crashes += 1
        early = self.worker.messages < EARLY_STEPS
        soon = time.monotonic() - self.started_at < CRASH_WINDOW and self.restarts > 0
        err = EngineCrashed(f"The {self.engine_name} engine serving '{self.name}' crashed ({why}); its running and "
                            "queued requests were ended. The next request restarts it.", param="model")
        self.fail_all(err)
        fault = self.worker.fault  # wedged or dead engine thread: the worker stopped itself (octo.watchdog)
        self.reason = f"the {self.engine_name} worker " + (f"stopped: {why}" if fault else f"crashed ({why})")
        configs = _configs(self.engine_cls, self.config.options)
        can_fall_back = early and not fault and self.config_index + 1 < len(configs)
        if self.state == "stopped":
            return
        if soon and not can_fall_back:
            self.state = "failed"
            self.reason += f" again within {CRASH_WINDOW:g} s of a restart; not restarting it"
        else:
            self.state = "crashed"
            self._next_config = self.config_index + 1 if can_fall_back else self.config_index
        log.error("%s: %s", self.name, self.reason)

    async def _restart(self) -> None:
        cls = self.engine_cls
        self.state = "loading"
        first = self._next_config
        if first != self.config_index:
            overlay, why = _configs(cls, self.config.options)[first]
            log.warning("%s: %s (%s); serving with %s", cls.name, why, self.reason, _opts(overlay))
            remember(cls, self.artifact, overlay, f"{why} ({self.reason})")
        try:
            worker, loaded = await start_worker(cls, self.artifact, self.name, self.config, first=first)
            self._adopt(worker, loaded)
            await self.activate(self.config)
        except BaseException as exc:
            self.state = "failed"
            self.reason = f"restart failed: {getattr(exc, 'message', None) or exc}"
            raise
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
        return await self._op("stats")

    async def _op(self, op: str, *args: Any) -> Any:
        try:
            return await self.worker.request(op, *args)
        except EngineCrashed:
            raise EngineCrashed(f"The {self.engine_name} engine serving '{self.name}' crashed "
                                f"({self.worker.exit_reason}); the next request restarts it.", param="model") from None

