"""The shared scheduler: bounded FIFO admission queue, continuous batcher and prefix-cache use.

One scheduler per served model. Requests are submitted from the event loop; a single engine thread
admits them in FIFO order, runs one ``Engine.step`` per iteration for every active sequence (decode
tokens first, then prompt chunks within the engine's ``prefill_chunk`` budget), and posts results back
with one ``loop.call_soon_threadsafe`` per step. Stop strings, ``max_tokens``, EOS, the context limit
and cancellation are handled here, once, for every engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from octo.engine import Engine, Feed, SamplingParams
from octo.errors import ContextLengthExceeded, EngineError, InvalidRequest, OctoError, Overloaded, QueueTimeout
from octo.jobs import GenerationRequest, Ticket, _Call, _Job
from octo.prefix_cache import PrefixCache

log = logging.getLogger("octo.scheduler")


class Scheduler:
    gate: Any = None  # octo.arbiter.ComputeGate of a worker sharing the cores with other models
    def __init__(self, engine: Engine, *, max_batch: int = 8, max_queue: int = 64, queue_timeout: float = 60.0,
                 cache: PrefixCache | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.cache = cache
        self._pending: deque[_Job] = deque()
        self._active: list[Ticket] = []
        self._lock = threading.Lock()  # guards the queue and the counters shared by both threads
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # the sleeping engine thread waits on it
        self._thread: Executor | None = None
        self._stopping = False
        self._between: list[tuple[Callable[[], Any], Future]] = []  # run on the engine thread between two steps
        self._sleeping = False
        self._kick_scheduled = False
        self._outbox: list = []
        self._out_lock = threading.Lock()
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_depth = 0
        self.total_processed = 0
        self.total_rejected = 0
        self.total_timeouts = 0
        self.total_cancelled = 0
        self.generated_tokens = 0
        self.steps = 0

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
        self._done.add_done_callback(_report_exit)

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
        tickets = []
        if events is None and req.stream:
            events = asyncio.Queue()
        for i in range(n):
            sampling = req.sampling
            if n > 1 and sampling.seed is not None:
                sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + i})
            tickets.append(self._ticket(req, sampling, events, first_index + i))
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

    def _ticket(self, req: GenerationRequest, sampling: SamplingParams, events: Any, index: int) -> Ticket:
        return Ticket(self._loop, req, sampling, events, index)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread, through the admission queue (embeddings, audio)."""
        return await self._await_call(_Call(self._loop, fn))

    async def call_batch(self, key: Any, item: Any, fn: Callable[[Engine, list[Any], Callable], list[Any]]) -> Any:
        """Like :meth:`call`, but calls with the same ``key`` waiting together at the head of the queue run
        as one ``fn(engine, items, done)`` (at most ``max_batch`` items). ``fn`` returns one result per item,
        an exception instance standing for that item's error; it may call ``done(index, result)`` to answer
        an item before the others finish (transcriptions: ``Engine.transcribe_batch``)."""
        return await self._await_call(_Call(self._loop, fn, key, item))

    async def _await_call(self, job: _Call) -> Any:
        self._enqueue([job])
        try:
            return await job.future  # a queue timeout arrives here as well
        except asyncio.CancelledError:
            self.abandon(job)
            raise

    def _enqueue(self, jobs: list[_Job]) -> None:
        with self._lock:
            if self._stopping:
                raise Overloaded("The server is shutting down.", headers={"Retry-After": "5"})
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
                self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_scheduled = False
        self._wake.put(None)

    def _retry_after(self) -> float:
        return min(self.queue_timeout, 1.0 + len(self._pending) / max(1, self.max_batch))

    async def wait_admitted(self, job: _Job) -> None:
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
            _fail_job(job, err)
        if not self._stopping:
            self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)

    def abandon(self, job: _Job) -> None:
        """The client is gone: drop a pending job now, or cancel an active sequence at the next step."""
        with self._lock:
            if job.state == "pending":
                job.state = "cancelled"
                self._pending.remove(job)
                self.total_cancelled += 1
                return
        if isinstance(job, Ticket):
            job.cancel()  # an active sequence keeps the engine thread awake: it leaves at the next step

    # -- stats ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "pending": len(self._pending),
            "active": len(self._active),
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
        }

    # -- engine thread -----------------------------------------------------------------------------
    def run_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine thread before its next step (e.g. ``Engine.set_threads`` while serving)."""
        fut: Future = Future()
        with self._lock:
            self._between.append((fn, fut))
            sleeping = self._sleeping
        if sleeping:
            self._wake.put(None)
        return fut

    def _run_between(self) -> None:
        with self._lock:
            items, self._between = self._between, []
        for fn, fut in items:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                fut.set_exception(exc)

    def _run(self) -> None:
        posts: list[tuple[Any, ...]] = []
        while True:
            if self._between:
                self._run_between()
            with self._lock:
                idle = not self._stopping and not self._pending and not self._active
                self._sleeping = idle
                if not idle:
                    if self._stopping:
                        break
                    calls, admitted = self._admit_locked()
            if idle:
                if self.gate is not None:
                    self.gate.idle()
                self._wake.get()  # a kick (or stop) wakes us; spurious wake-ups just look again
                continue
            for job in admitted + calls:
                if job.admitted is not None:
                    posts.append((_set_result, job.admitted, None))
            if calls and calls[0].batch_key is not None:
                self._run_batch(calls, posts)
            else:
                for job in calls:
                    self._run_call(job, posts)
            for t in admitted:
                self._start(t, posts)
            if self._active:
                self._step(posts)
            if posts:
                self._post(posts)
                posts = []
        self._shutdown()

    def _post(self, posts: list) -> None:
        """Hand results to the event loop; one wake-up covers everything posted until the loop drains."""
        with self._out_lock:
            self._outbox.extend(posts)
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._out_lock:
            posts, self._outbox = self._outbox, []
            self._drain_scheduled = False
        _deliver(posts)

    def _admit_locked(self) -> tuple[list[_Call], list[Ticket]]:
        calls: list[_Call] = []
        admitted: list[Ticket] = []
        window = self.engine.batching == "window"
        if window and self._active:
            return calls, admitted
        while self._pending:
            job = self._pending[0]
            if isinstance(job, _Call):
                if admitted:  # keep FIFO: run the call after this step's admissions
                    break
                self._pending.popleft()
                job.state = "active"
                calls.append(job)
                while (job.batch_key is not None and self._pending and len(calls) < self.max_batch
                       and isinstance(self._pending[0], _Call) and self._pending[0].batch_key == job.batch_key):
                    nxt = self._pending.popleft()
                    nxt.state = "active"
                    calls.append(nxt)
                break
            if len(self._active) + len(admitted) >= self.max_batch:
                break
            self._pending.popleft()
            job.state = "active"
            admitted.append(job)
        return calls, admitted

    def _run_batch(self, jobs: list[_Call], posts: list) -> None:
        self._post(posts[:])  # admissions now: an item answered early (below) must not wait for them
        posts.clear()

        def done(i: int, result: Any) -> None:  # the engine answers one item before the batch ends
            self._post([_outcome(jobs[i].future, result)])

        try:
            results = list(jobs[0].fn(self.engine, [j.item for j in jobs], done))
            if len(results) != len(jobs):
                raise EngineError(f"batched call returned {len(results)} results for {len(jobs)} items")
        except BaseException as exc:  # noqa: BLE001 - the error goes to every caller still waiting
            results = [exc] * len(jobs)
        for job, result in zip(jobs, results, strict=True):
            posts.append(_outcome(job.future, result))  # no-op for futures already answered by done()
            job.state = "done"
            self.total_processed += 1

    def _run_call(self, job: _Call, posts: list) -> None:
        try:
            result = job.fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - the error goes to the caller
            posts.append((_set_exception, job.future, _as_octo_error(exc)))
        else:
            posts.append((_set_result, job.future, result))
        job.state = "done"
        self.total_processed += 1

    def _start(self, t: Ticket, posts: list) -> None:
        seq = t.seq
        try:
            self.engine.add_sequence(seq)
        except BaseException as exc:  # noqa: BLE001
            self._fail(t, exc, posts, remove=False)
            return
        if self.cache is not None:
            handle, n = self.cache.lookup(seq.tokens, len(seq.tokens) - 1)
            if handle is not None:
                try:
                    self.engine.kv_restore(seq, handle, n)
                    t.cached = seq.n_cached
                    if seq.n_cached != n:  # the engine reused less than the index offered
                        self.cache.tokens_reused -= n - seq.n_cached
                except Exception:  # noqa: BLE001 - a failed restore is a miss, never an error
                    log.exception("KV restore failed; recomputing the prompt")
                    self.cache.restore_failed(n)
                    self.engine.remove_sequence(seq)
                    self.engine.add_sequence(seq)
                    seq.n_cached = 0
        self._active.append(t)

    def _step(self, posts: list) -> None:
        eng = self.engine
        n_ctx = eng.info.n_ctx if eng.info else 1 << 30
        for t in [t for t in self._active if t._cancel]:
            self._finish(t, "cancelled", posts)
        # decode tokens first (one per sequence), then prompt chunks within the engine's prefill budget
        feeds: list[Feed] = []
        owners: list[Ticket] = []  # the ticket of each feed
        prefilling: list[Ticket] = []
        for t in self._active:
            seq = t.seq
            remaining = len(seq.tokens) - seq.n_cached
            if remaining == 1:
                feeds.append(Feed(seq, seq.tokens[-1:], True))
                owners.append(t)
            elif remaining > 1:
                prefilling.append(t)
        budget = 1 << 30 if eng.batching == "window" else max(eng.prefill_chunk, 1)
        for t in prefilling:
            if budget <= 0:
                break
            seq = t.seq
            remaining = len(seq.tokens) - seq.n_cached
            take = min(remaining, budget)
            budget -= take
            feeds.append(Feed(seq, seq.tokens[seq.n_cached:seq.n_cached + take], take == remaining))
            owners.append(t)
        if not feeds:
            return
        gate = self.gate
        try:
            if gate is not None:  # several models share the cores: compute in turns (octo.arbiter)
                gate.enter()
            try:
                out = eng.step(feeds)
            finally:
                if gate is not None:
                    gate.exit()
            if len(out) != len(feeds):
                raise EngineError(f"the engine step returned {len(out)} tokens for {len(feeds)} feeds")
        except BaseException as exc:  # noqa: BLE001 - fail this step's sequences, keep serving
            log.exception("engine step failed")
            for t in owners:
                if t.state == "active":
                    self._fail(t, exc, posts)
            return
        self.steps += 1
        eos = eng.info.eos_token_ids if eng.info else frozenset()
        token_bytes = eng.token_bytes
        for t, tok in zip(owners, out, strict=True):
            if tok is None:
                continue
            tokens = t.seq.tokens
            tokens.append(tok)
            self.generated_tokens += 1
            if tok in eos:
                t.hit_eos = True
                self._finish(t, "stop", posts)
                continue
            piece, stopped = t.stream.push(token_bytes(tok))
            if piece:
                t.text.append(piece)
                if t.req.stream:
                    posts.append((_put, t.events, (t.index, "text", piece)))
            if stopped:
                self._finish(t, "stop", posts, flush=False)
            elif (t.req.max_tokens is not None and len(tokens) - t.n_prompt >= t.req.max_tokens) \
                    or len(tokens) >= n_ctx:
                self._finish(t, "length", posts)

    def _finish(self, t: Ticket, reason: str, posts: list, flush: bool = True) -> None:
        t.finish = reason
        tail = t.stream.flush() if flush and reason != "cancelled" else ""
        if tail:
            t.text.append(tail)
            if t.req.stream:
                posts.append((_put, t.events, (t.index, "text", tail)))
        self._retire(t)
        if reason == "cancelled":
            self.total_cancelled += 1
        else:
            self.total_processed += 1
        result = t._result()
        if t.req.stream:
            posts.append((_put, t.events, (t.index, "done", result)))
        posts.append((_set_result, t.result, result))

    def _fail(self, t: Ticket, exc: BaseException, posts: list, remove: bool = True) -> None:
        t.finish = "error"
        if remove:
            self._retire(t, save=False)
        err = _as_octo_error(exc)
        if t.events is not None:
            posts.append((_put, t.events, (t.index, "done", err)))
        posts.append((_set_exception, t.result, err))

    def _retire(self, t: Ticket, save: bool = True) -> None:
        """Take ``t`` out of the batch; offer its KV to the prefix cache first."""
        t.state = "done"
        if t in self._active:
            self._active.remove(t)
        seq = t.seq
        if save and self.cache is not None and seq.n_cached > 0:
            try:
                handle = self.engine.kv_save(seq)
            except Exception:  # noqa: BLE001
                log.exception("KV save failed")
                handle = None
            if handle is not None:
                self.cache.insert(handle)
        try:
            self.engine.remove_sequence(seq)
        except Exception:  # noqa: BLE001
            log.exception("remove_sequence failed")

    def _shutdown(self) -> None:
        posts: list = []
        err = Overloaded("The server is shutting down.", headers={"Retry-After": "5"})
        for t in list(self._active):
            self._fail(t, err, posts)
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            for job in pending:
                job.state, job.error = "failed", err
        if self.cache is not None:
            self.cache.clear()
        if (posts or pending) and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, posts)
            for job in pending:
                self._loop.call_soon_threadsafe(_fail_job, job, err)


def _report_exit(done: Any) -> None:
    exc = done.exception()
    if exc is not None:
        log.error("the engine thread died: %s: %s", type(exc).__name__, exc, exc_info=exc)


def new_engine_thread() -> ThreadPoolExecutor:
    """A model's engine thread: one thread that runs its load, warm-up, benchmark and every step, in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="octo-engine")


def _as_octo_error(exc: BaseException) -> OctoError:
    if isinstance(exc, OctoError):
        return exc
    return EngineError(f"The engine failed: {type(exc).__name__}: {exc}")


def _fail_job(job: _Job, err: OctoError) -> None:
    """On the event loop: a job that never ran gets ``err`` (its admission wait, and its result)."""
    if job.admitted is not None:
        _set_exception(job.admitted, err)
    _set_exception(job.result if isinstance(job, Ticket) else job.future, err)


def _put(queue: asyncio.Queue, item: Any) -> None:
    queue.put_nowait(item)


def _outcome(fut: asyncio.Future, result: Any) -> tuple:
    if isinstance(result, BaseException):
        return (_set_exception, fut, _as_octo_error(result))
    return (_set_result, fut, result)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.add_done_callback(_consume)  # nobody may await it (client gone)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _deliver(posts: list) -> None:
    for fn, target, value in posts:
        fn(target, value)

