"""The shared scheduler: bounded FIFO admission queue, continuous batcher and prefix-cache use.

One scheduler per served model. Requests are submitted from the event loop (this module: admission, queue
time-outs, cancellation, stats); a single engine thread admits them in FIFO order and steps the batch
(``octo.scheduler.engine_loop``); ``octo.scheduler.watchdog`` supervises that thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from octo.engine import Engine, SamplingParams
from octo.errors import ContextLengthExceeded, InvalidRequest, OctoError, Overloaded, QueueTimeout
from octo.scheduler.disk_cache import DiskPrefixCache
from octo.scheduler.engine_loop import EngineLoop
from octo.scheduler.events import Failed
from octo.scheduler.jobs import Call, GenerationRequest, Job, Ticket
from octo.scheduler.posting import fail_job, new_engine_thread
from octo.scheduler.prefix_cache import PrefixCache
from octo.scheduler.watchdog import Watchdog

KICK_LATER = 2  # event-loop iterations between the first request queued at a sleeping engine and its wake-up
log = logging.getLogger("octo.scheduler.admission")


class Scheduler(EngineLoop):
    """Admission (this class, on the event loop) on top of the step loop (:class:`EngineLoop`, on the engine thread);
    it owns the watchdog and is the watchdog's :class:`octo.scheduler.watchdog.WatchdogOwner`."""

    def __init__(self, engine: Engine, *, max_batch: int = 8, max_queue: int = 64, queue_timeout: float = 60.0,
                 cache: PrefixCache | None = None, preempt: str = "swap", step_stretch: float = 2.0,
                 dedup: bool = True, disk: DiskPrefixCache | None = None,
                 default_max_tokens: int | None = None) -> None:
        super().__init__(engine, max_batch=max_batch, cache=cache, disk=disk, preempt=preempt,
                         step_stretch=step_stretch, dedup=dedup)
        self.default_max_tokens = default_max_tokens  # a request's max_tokens when it sets none (None: the context)
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.watchdog = Watchdog(self)
        self._thread: Executor | None = None
        self._kick_scheduled = False
        self.max_depth = 0
        self.total_rejected = 0
        self.total_timeouts = 0

    @property
    def disk_tokens_reused(self) -> int:
        """Prompt tokens restored from the disk tier (``--prefix-cache-dir``)."""
        return self.disk.tokens_reused if self.disk is not None else 0

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None, engine_thread: Executor | None = None) -> None:
        """Run the step loop on ``engine_thread`` (the single-thread executor that loaded and measured the engine,
        so that every computation of a model happens on one thread: OpenMP builds such as llama.cpp's keep one
        thread pool per calling thread, and two pools on a small host throttle each other's spinning)."""
        self._loop = loop or asyncio.get_running_loop()
        self._sweep_every = min(0.05, self.queue_timeout / 4)
        self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)
        self._thread = engine_thread or new_engine_thread()
        self._done = self._thread.submit(self._run)
        self._done.add_done_callback(self.watchdog.thread_exited)

    # -- the watchdog's owner interface (octo.scheduler.watchdog uses only these) ---------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the scheduler's event loop, from any thread (nothing once that loop is closed)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def fail_everything(self, err: OctoError) -> None:
        """(event loop) Fail every job the model holds with ``err``: the queued ones leave the queue; the running
        ones (with what a stuck iteration ended or was running: calls, results not posted yet) are cancelled, so
        that should the engine thread come back they leave at its next step, and their streams end with ``err``."""
        with self._lock:
            jobs = list(self._pending)
            self._pending.clear()
            for job in jobs:
                job.state, job.error = "failed", err
        running = [*self._active, *self._preempted, *self._settling]
        for t in running:
            if isinstance(t, Ticket):
                t.cancel()
                if t.events is not None:
                    t.events.put_nowait(Failed(t.index, err))
        for job in [*jobs, *running]:
            fail_job(job, err)

    def restart_loop(self) -> None:
        """(event loop) Run the step loop again on the model's engine thread after it died (the sequences it held
        were failed and cancelled by ``fail_everything``: the new loop retires them at its first step)."""
        self._done = self._thread.submit(self._run)
        self._done.add_done_callback(self.watchdog.thread_exited)

    def stop(self) -> None:
        if getattr(self, "_sweeper", None) is not None:
            self._sweeper.cancel()
        with self._lock:
            self._stopping = True
        self._wake.put(None)
        if self._thread is not None:
            try:
                self._done.result(timeout=30)
            except Exception:  # noqa: BLE001 - a step loop that died was reported when it did
                log.exception("the engine thread ended with an error")
            self._thread = None

    # -- submission (event loop) -------------------------------------------------------------------
    def submit(self, req: GenerationRequest, n: int = 1, events: asyncio.Queue | None = None,
               first_index: int = 0) -> list[Ticket]:
        """Queue ``n`` sequences for ``req`` or raise at once (full queue: 503; too long: 400).

        Streaming events of all the tickets go to ``events`` (a new queue when None), tagged with
        their choice index (``first_index + i``).
        """
        info = self.engine.info
        n_prompt = len(req.prompt_tokens)
        if n_prompt == 0:
            raise ContextLengthExceeded("The prompt is empty after tokenization.", param="messages")
        if info is not None and n_prompt + (req.max_tokens or 1) > info.n_ctx:
            if n_prompt >= info.n_ctx:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {info.n_ctx} tokens, but the prompt has "
                    f"{n_prompt} tokens.", param="messages")
            raise ContextLengthExceeded(
                f"This model's maximum context length is {info.n_ctx} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        if req.max_tokens is None and self.default_max_tokens:  # (after the check: the context still bounds it)
            req = dataclasses.replace(req, max_tokens=self.default_max_tokens)
        tickets = []
        if events is None and req.stream:
            events = asyncio.Queue()
        for i in range(n):
            sampling = req.sampling
            if n > 1 and sampling.seed is not None:
                sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + i})
            tickets.append(self.make_ticket(req, sampling, events, first_index + i))
        self._enqueue(tickets)
        return tickets

    def submit_all(self, gens: list[GenerationRequest], n: int, events: Any = None) -> list[Ticket]:
        """``n`` sequences for each of ``gens`` (a prompt list), choice indices prompt-major, one event queue;
        all or nothing: when one is refused, those already queued are abandoned and the error raised."""
        if len(gens) * n > self.max_queue + self.max_batch:  # could never be admitted: not a load that will pass
            param = "n" if n > 1 else "prompt"
            raise InvalidRequest(f"This request needs {len(gens) * n} sequences ({len(gens)} prompt(s) x n={n}); "
                                 f"this server admits at most {self.max_queue + self.max_batch} at once "
                                 f"(--max-queue {self.max_queue} + --max-batch {self.max_batch}).", param=param)
        tickets: list[Ticket] = []
        try:
            for i, gen in enumerate(gens):
                tickets += self.submit(gen, n, events, first_index=i * n)
        except BaseException:
            for t in tickets:
                self.abandon(t)
            raise
        return tickets

    def make_ticket(self, req: GenerationRequest, sampling: SamplingParams, events: Any, index: int) -> Ticket:
        return Ticket(self._loop, req, sampling, events, index)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread, through the admission queue (embeddings, audio)."""
        return await self._await_call(Call(self._loop, fn))

    async def call_batch(self, key: Any, item: Any, fn: Callable[[Engine, list[Any], Callable], list[Any]]) -> Any:
        """Like :meth:`call`, but calls with the same ``key`` waiting together at the head of the queue run
        as one ``fn(engine, items, done)`` (at most ``max_batch`` items). ``fn`` returns one result per item,
        an exception instance standing for that item's error; it may call ``done(index, result)`` to answer
        an item before the others finish (transcriptions: ``Engine.transcribe_batch``)."""
        return await self._await_call(Call(self._loop, fn, key, item))

    async def _await_call(self, job: Call) -> Any:
        self._enqueue([job])
        try:
            return await job.future  # a queue timeout arrives here as well
        except asyncio.CancelledError:
            self.abandon(job)
            raise

    def _enqueue(self, jobs: list[Job]) -> None:
        self.watchdog.check_open()  # a wedged or dead engine thread: 503 at once, not a wait
        with self._lock:
            if self._stopping:
                raise Overloaded("The server is shutting down.", code="server_shutting_down",
                                 headers={"Retry-After": "5"})
            # free batch slots count as room: requests arriving together at an idle server are admitted at the
            # engine thread's next look at the queue, not refused while a slot waits for them
            # calls (embeddings, audio) run one batch at a time and take no batch slot: no extra room for them
            free = max(0, self.max_batch - len(self._active)) if isinstance(jobs[0], Ticket) else 0
            if len(self._pending) + len(jobs) > self.max_queue + free:
                self.total_rejected += len(jobs)
                raise Overloaded(
                    f"The request queue is full ({self.max_queue} waiting); retry later.",
                    headers={"Retry-After": str(max(1, round(self._retry_after())))})
            deadline = self._loop.time() + self.queue_timeout
            for job in jobs:
                job.deadline = deadline
            self._pending.extend(jobs)
            waiting = len(self._pending) - free  # beyond the free slots: really waiting for one
            if waiting > self.max_depth:
                self.max_depth = waiting
            if self._sleeping and not self._kick_scheduled:
                # Wake the engine thread once per event-loop iteration, not once per request: requests that
                # arrive together are admitted together, and a cross-thread wake-up is costly.
                self._kick_scheduled = True
                self._loop.call_soon(self._kick, KICK_LATER)

    def _kick(self, later: int = 0) -> None:
        """Wake the sleeping engine thread, ``later`` event-loop iterations from now: the requests whose data came in
        meanwhile join its first step, and the handlers that queued them reach their await before the engine thread
        takes the interpreter lock (bench/overhead.py, echo engine, concurrency 8: 1.3 steps a request instead of 1.7
        and 8% less CPU a request; at concurrency 1 the same latency)."""
        if later:
            self._loop.call_soon(self._kick, later - 1)
            return
        self._kick_scheduled = False
        self._wake.put(None)

    def _retry_after(self) -> float:
        return min(self.queue_timeout, 1.0 + len(self._pending) / max(1, self.max_batch))

    async def wait_admitted(self, job: Job) -> None:
        """Wait until the job leaves the queue; QueueTimeout (504) once its deadline has passed."""
        with self._lock:  # the engine thread admits under this lock: it sees the future or we see the state
            if job.state == "pending":
                job.admitted = self._loop.create_future()
        if job.admitted is None:
            if job.error is not None:
                raise job.error
            return
        try:
            await job.admitted
        except asyncio.CancelledError:
            self.abandon(job)
            raise

    def _timeout_error(self) -> QueueTimeout:
        return QueueTimeout(f"The request waited {self.queue_timeout:g} s in the queue without being scheduled.")

    def _sweep(self) -> None:
        """Expire pending jobs past their deadline (one timer per scheduler, not one per request)."""
        now = self._loop.time()
        expired = []
        with self._lock:
            if self._pending and self._pending[0].deadline <= now:  # FIFO: the oldest expire first
                err = self._timeout_error()
                for job in list(self._pending):
                    if job.deadline <= now:
                        job.state, job.error = "expired", err
                        self._pending.remove(job)
                        self.total_timeouts += 1
                        expired.append(job)
        for job in expired:
            fail_job(job, err)
        self.watchdog.check()
        self.media.check()  # the encode thread: a stuck encode costs its requests (octo.scheduler.media)
        if not self._stopping:
            self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)

    def abandon(self, job: Job) -> None:
        """The client is gone: drop a pending job now, cancel an active sequence at the next step, and mark a running
        call gone (engines that poll stop its item early)."""
        with self._lock:
            if job.state == "pending":
                job.state = "cancelled"
                self._pending.remove(job)
                self.total_cancelled += 1
                return
            if isinstance(job, Call) and job.state == "active" and not job.gone:
                job.gone = True
                self.total_cancelled += 1
                return
        if isinstance(job, Ticket):
            job.cancel()  # an active sequence keeps the engine thread awake: it leaves at the next step

    # -- stats ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether requests or calls are queued or running now (read without the lock: a hint, for background
        work that waits for a lull)."""
        return bool(self._pending or self._active or self._preempted or self.calls_running)

    def stats(self) -> dict[str, Any]:
        return {
            "pending": len(self._pending),
            "active": len(self._active),
            "calls_running": self.calls_running,
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "max_depth": self.max_depth,
            "total_processed": self.total_processed,
            "total_rejected": self.total_rejected,
            "total_timeouts": self.total_timeouts,
            "total_cancelled": self.total_cancelled,
            "batching": self.engine.batching,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "preempted": len(self._preempted),
            "total_preemptions": self.kv.total_preemptions,
            "total_resumed": self.kv.total_resumed,
            "prefix_dedup": self.sharing.dedup,
            "total_shared_tokens": self.sharing.total_shared_tokens,
            "isolated_steps": self.isolation.isolated_steps,  # steps that raised, split until the failing one was alone
            "engine_thread": self.watchdog.state,
            "kv": self.engine.kv_stats(),
            "media": self.media.stats(),
        }
