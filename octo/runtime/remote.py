"""The gateway's side of engine workers: spawning, requests over IPC, crash containment, restart and fallbacks.

``octo.runtime.process.WorkerProcess`` is one ``python -m octo.runtime.worker`` child; :class:`RemoteHandle` is a
model served by one, with the same surface as the in-process ``octo.runtime.model.ModelHandle``. When a worker dies
(any signal or exit), its running and queued requests end at once with a 502 ``engine_crashed`` naming the model,
the engine and the signal; the next request restarts it. A worker that stops answering (no heartbeat within its
bound: ``octo.runtime.supervision``) is killed and handled the same way, its requests ending with ``engine_hung``. A
worker that dies again within ``CRASH_WINDOW`` of its restart marks the model failed (503 at once, with the reason)
until a back-off passes (10 s, doubling up to 5 minutes) or ``POST /v1/models/{id}/load`` retries it. A worker that
dies of a signal of its own code (SIGSEGV, SIGABRT, ...) during load, warm-up or its first steps is restarted with
the engine's next fallback configuration (``Engine.fallbacks``), which is remembered for this host and artifact so
the next start does not crash first; a SIGKILL (the OOM killer, an operator) never is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine, ModelInfo
from octo.errors import EngineCrashed, ModelFailed, OctoError, QueueTimeout
from octo.logsafe import quoted
from octo.runtime import supervision
from octo.runtime.handle import Forwarder, WireTicket, consume_exception
from octo.runtime.prespawn import beat_interval
from octo.runtime.process import IDS, WorkerProcess, options_text, start_worker
from octo.runtime.supervision import configs_for, remember
from octo.serving import openai as serving

log = logging.getLogger("octo.runtime.remote")
CRASH_WINDOW = 60.0  # a worker that dies again this soon after a restart marks its model failed
EARLY_STEPS = 16  # a crash within this many engine steps of a start counts as a crash of the configuration



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
        self.engine_version = loaded.get("version")  # (the system fingerprint: llama_cpp stays out of the gateway)
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
        quiet = max(2.0, 3 * beat_interval(self.config.worker_timeout))
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
                log.warning("%s: could not limit its threads to %s: %s", quoted(self.name, bare=True), n, exc.message)

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
        log.error("%s: %s", quoted(self.name, bare=True), self.reason)

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
            log.warning("%s: %s (%s); serving with %s", cls.name, why, self.reason, options_text(overlay))
            remember(cls, self.artifact, overlay, f"{why} ({self.reason})")
        try:
            worker, loaded = await start_worker(cls, self.artifact, self.name, self.config, first=first)
            self._adopt(worker, loaded)
            await self.activate(self.config)
        except BaseException as exc:
            self.reason = f"restart failed: {getattr(exc, 'message', None) or exc}"
            self._failed("")
            log.error("%s: %s", quoted(self.name, bare=True), self.reason)
            if isinstance(exc, Exception):
                raise ModelFailed(f"Model '{self.name}' ({cls.name}) could not be restarted: {self.reason}",
                                  param="model", headers=supervision.retry_after(self.retry_at - time.monotonic())) \
                    from None
            raise
        finally:
            self._restarting = None
        self.restarts += 1
        self.reason = None
        log.warning("%s: %s worker restarted (pid %d)", quoted(self.name, bare=True), cls.name, self.worker.pid)

    # -- requests ----------------------------------------------------------------------------------------
    async def submit(self, kind: str, req: Any, size: int = 0) -> tuple[list[WireTicket], asyncio.Queue | None]:
        """Send the request to the worker, which prepares (templates, tokenizes, validates) and queues it; a
        refusal (400, 503 queue full) comes back on every ticket's result and admission."""
        loop = asyncio.get_running_loop()
        rid = next(IDS)
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

