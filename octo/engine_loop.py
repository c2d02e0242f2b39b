"""The engine-thread half of the shared scheduler (:class:`octo.scheduler.Scheduler` derives from it).

Each iteration of :meth:`EngineLoop._run` resumes preempted sequences, admits queued jobs in FIFO order, runs
calls (embeddings, audio), then one ``Engine.step`` for every active sequence: decode tokens first, then prompt
chunks within the engine's ``prefill_chunk`` budget. Results go back to the event loop with one
``loop.call_soon_threadsafe`` per step. Stop strings, ``max_tokens``, EOS, the context limit, cancellation,
per-sequence engine failures and KV pressure are handled here, once, for every engine.

KV pressure (engines whose sequences share one bounded pool report its free cells with ``Engine.kv_room``): a
new sequence is admitted only when its prompt fits beside what the running ones still have to feed; before each
step, the youngest sequences are preempted until every decoding sequence has its cell. A preempted sequence keeps
its tokens, text, stream and engine slot (sampler state); its KV is saved to host memory (``preempt="swap"``,
through ``Engine.kv_save``) or dropped (``"recompute"``), and it resumes, oldest first, when the pool has room for
all its tokens: its stream pauses and continues with no token lost or repeated.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from octo.disk_cache import DiskTier
from octo.emission import Emission, _put
from octo.engine import Feed, common_prefix
from octo.errors import EngineError, KVCacheFull, OctoError, Overloaded
from octo.jobs import Ticket, _Call, _Job
from octo.sharing import PrefixSharing

log = logging.getLogger("octo.scheduler")


class EngineLoop(PrefixSharing, Emission, DiskTier):
    """Methods that run on the model's engine thread; the state they share lives on the Scheduler."""

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
            admitted: list[Ticket] = []
            try:
                if self._between:
                    self._run_between()
                with self._lock:
                    idle = not self._stopping and not self._pending and not self._active and not self._preempted
                    self._sleeping = idle
                    if self._stopping:
                        break
                if idle:
                    if self.gate is not None:
                        self.gate.idle()
                    self._wake.get()  # a kick (or stop) wakes us; spurious wake-ups just look again
                    continue
                if self._preempted:
                    self._resume(posts)
                with self._lock:
                    calls, admitted = self._admit_locked()
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
            except BaseException as exc:  # noqa: BLE001 - a fault outside step: fail what runs, keep serving
                log.exception("the engine loop failed; failing the sequences in flight")
                for t in [*self._active, *self._preempted, *(t for t in admitted if t.state == "active")]:
                    if t.state == "active":
                        self._fail(t, exc, posts)
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
        room = self._room()
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
            if len(self._active) + len(self._preempted) + len(admitted) >= self.max_batch or self._preempted:
                break  # preempted sequences keep their engine slot and resume before anything new starts
            if room is not None:
                need = len(job.seq.tokens) + 1  # its prompt, and a cell for the first decode step
                if self.dedup and self.engine.kv_shares_cells:  # a prefix it will share with a running one is free
                    need -= max((common_prefix(t.seq.tokens, job.seq.tokens, len(job.seq.tokens) - 1)
                                 for t in [*self._active, *admitted]
                                 if t.seq.sampling.adapter == job.seq.sampling.adapter), default=0)
                if need > room:
                    room += self._reclaim(need - room)  # prefix-cache entries give their pool cells back first
                if need > room and (self._active or admitted):
                    break  # waits until the running sequences give cells back (alone, it always fits)
                room -= need
            self._pending.popleft()
            job.state = "active"
            admitted.append(job)
        return calls, admitted

    def _run_batch(self, jobs: list[_Call], posts: list) -> None:
        self._post(posts[:])  # admissions now: an item answered early (below) must not wait for them
        posts.clear()

        def done(i: int, result: Any) -> None:  # the engine answers one item before the batch ends
            self._post([_outcome(jobs[i].future, result)])

        self.watchdog.busy(None)
        self.calls_running = len(jobs)
        try:
            results = list(jobs[0].fn(self.engine, [j.item for j in jobs], done))
            if len(results) != len(jobs):
                raise EngineError(f"batched call returned {len(results)} results for {len(jobs)} items")
        except BaseException as exc:  # noqa: BLE001 - the error goes to every caller still waiting
            results = [exc] * len(jobs)
        finally:
            self.calls_running = 0
            self.watchdog.idle()
        for job, result in zip(jobs, results, strict=True):
            posts.append(_outcome(job.future, result))  # no-op for futures already answered by done()
            job.state = "done"
            self.total_processed += 1

    def _run_call(self, job: _Call, posts: list) -> None:
        self.watchdog.busy(None)
        self.calls_running = 1
        try:
            result = job.fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - the error goes to the caller
            posts.append((_set_exception, job.future, _as_octo_error(exc)))
        else:
            posts.append((_set_result, job.future, result))
        finally:
            self.calls_running = 0
            self.watchdog.idle()
        job.state = "done"
        self.total_processed += 1

    def _start(self, t: Ticket, posts: list) -> None:
        seq = t.seq
        try:
            self.engine.add_sequence(seq)
        except BaseException as exc:  # noqa: BLE001
            self._fail(t, exc, posts, remove=False)
            return
        if self.cache is not None and t.prompt_lps is None:  # prompt logprobs need every prompt position computed
            handle, n = self.cache.lookup(seq.tokens, len(seq.tokens) - 1, seq.sampling.adapter)
            fresh = None  # a handle imported from the disk tier: the in-memory cache takes it after the restore
            if self.disk is not None and seq.sampling.adapter is None:  # the disk holds base-model KV only
                handle, n, fresh = self._from_disk(seq, handle, n)
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
                if fresh is not None and seq.n_cached > 0:
                    self.cache.insert(fresh)
                elif fresh is not None:  # the engine refused the disk entry's bytes: not kept
                    self.engine.kv_free(fresh)
            if t.cached and t.req.stream:  # before any text: a stream reports it at its start (Anthropic's usage)
                posts.append((_put, t.events, (t.index, "cached", t.cached)))
        if t.prompt_lps is None:
            self._find_lead(t)
        self._active.append(t)

    def _step(self, posts: list) -> None:
        eng = self.engine
        n_ctx = eng.info.n_ctx if eng.info else 1 << 30
        for t in [t for t in self._active if t._cancel]:
            self._finish(t, "cancelled", posts)
        self._join_leads()
        room = eng.kv_room()
        spare = 1 << 30 if room is None else self._fit(room)
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
            elif remaining > 1 and t.lead is None:  # a follower waits for its lead's prefix (octo.sharing)
                prefilling.append(t)
        budget = 1 << 30 if eng.batching == "window" else max(eng.prefill_chunk, 1)
        paced, least, leads = budget, None, set()
        if prefilling and eng.batching != "window":
            # Shortest remaining work first. A long prompt (see `least`) gets at most the pacer's step time per step
            # (so that a request arriving waits one short step), and beside decoding requests only what stretches
            # the step to --step-stretch decode steps: a long prompt never stalls a short request. Short prompts go
            # in whole (many streams arriving together join the batch at once, as llama-server's would).
            leads = {id(t.lead) for t in self._active if t.lead is not None}
            prefilling.sort(key=lambda t: (id(t) not in leads, _work(t, n_ctx)))  # a shared prefix first
            alone = not feeds and len(prefilling) == 1 and not self._pending
            urgent = any(_work(t, n_ctx) <= Pacer.SHORT_WORK for t in (*owners, *prefilling))
            budget, paced = self._pacer.budgets(budget, decoding=bool(feeds), alone=alone, urgent=urgent)
            # short: a prompt that fits one chunk while nothing decodes (nobody waits on it), or beside decoders one no
            # longer than the pacer's share or the least work a decoding request has left
            least = max(paced, min(_work(t, n_ctx) for t in owners)) if owners else budget
        budget = min(budget, spare)  # under KV pressure a prompt chunk takes only the cells left over
        for t in prefilling:
            if budget <= 0:
                break
            seq = t.seq
            remaining = len(seq.tokens) - seq.n_cached
            cap = budget if least is None or remaining <= least else min(budget, paced)
            if cap <= 0:
                continue
            take = min(remaining, cap)
            if leads and id(t) in leads:  # end the chunk where a follower can join
                stop = self._lead_stop(t)
                if stop is not None:
                    take = min(take, stop - seq.n_cached)
            budget -= take
            paced -= take
            feeds.append(Feed(seq, seq.tokens[seq.n_cached:seq.n_cached + take], take == remaining))
            owners.append(t)
        if not feeds:
            return
        for f, t in zip(feeds, owners, strict=True):
            if t.extra:
                self._dress(f, t)
        gate = self.gate
        n_decode = sum(1 for f in feeds if len(f.tokens) == 1 and f.sample)
        n_fed = sum(len(f.tokens) for f in feeds)
        self.watchdog.busy(n_fed)
        started = time.perf_counter()
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
        except KVCacheFull as exc:  # nothing was consumed: make room and run the step again
            if self._reclaim(n_fed):
                return
            if len(self._active) > 1:
                log.info("%s; preempting the youngest sequence", exc.message)
                self._preempt(max(self._active, key=_age))
                return
            self._fail(self._active[0], exc, posts)
            return
        except BaseException as exc:  # noqa: BLE001 - fail this step's sequences, keep serving
            log.exception("engine step failed")
            for t in owners:
                if t.state == "active":
                    self._fail(t, exc, posts)
            return
        finally:
            self.watchdog.idle()
        self.steps += 1
        self._pacer.observe(time.perf_counter() - started, n_decode, n_fed - n_decode)
        eos = eng.info.eos_token_ids if eng.info else frozenset()
        token_bytes = eng.token_bytes
        for f, t, tok in zip(feeds, owners, out, strict=True):
            if t.extra and t.prompt_lps is not None:
                self._prompt_logprobs(f, t)
            if tok is None:
                continue
            if isinstance(tok, BaseException):  # the engine failed this sequence alone
                self._fail(t, tok, posts)
                continue
            if isinstance(tok, list):  # speculative decoding: several tokens at once, each checked as if alone
                for x in tok:
                    if not self._take(f, t, x, eos, posts, n_ctx, token_bytes):
                        break
                continue
            self._take(f, t, tok, eos, posts, n_ctx, token_bytes)

    def _take(self, f: Feed, t: Ticket, tok: int, eos: frozenset, posts: list, n_ctx: int, token_bytes: Any) -> bool:
        """A sampled token of ``t``: constraint, text, stop strings, limits; False when the sequence ended."""
        if t.extra and not self._accept(f, t, tok, eos, posts):
            return False
        tokens = t.seq.tokens
        tokens.append(tok)
        self.generated_tokens += 1
        if tok in eos:
            t.hit_eos = True
            self._finish(t, "stop", posts)
            return False
        try:
            piece, stopped = t.stream.push(token_bytes(tok), len(tokens) - t.n_prompt >= t.req.min_tokens)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot spell its own token: this sequence fails
            log.exception("token_bytes(%d) failed", tok)
            self._fail(t, exc, posts)
            return False
        if piece:
            self._emit(t, piece, posts)
        if stopped:
            self._finish(t, "stop", posts, flush=False)
        elif t.matcher is not None and t.matcher.is_done():  # nothing but the end can follow
            self._finish(t, "stop", posts)
        elif (t.req.max_tokens is not None and len(tokens) - t.n_prompt >= t.req.max_tokens) \
                or len(tokens) >= n_ctx:
            self._finish(t, "length", posts)
        else:
            return True
        return False

    # -- KV pressure -----------------------------------------------------------------------------------
    def _room(self) -> int | None:
        """KV cells free for new work: the engine's free cells less what the active sequences still have to feed
        (the rest of their prompts, and the next decode token); None when the engine's KV is not shared."""
        room = self.engine.kv_room()
        if room is None:
            return None
        return room - sum(len(t.seq.tokens) - t.seq.n_cached for t in self._active)

    def _fit(self, room: int) -> int:
        """Preempt the youngest sequences until every decoding sequence has a cell for this step and something can
        move; return the cells left for prompt chunks."""
        while True:
            decoding = sum(1 for t in self._active if len(t.seq.tokens) - t.seq.n_cached == 1)
            spare = room - decoding
            if spare < 0 or not (decoding or spare > 0):
                room += self._reclaim(max(1, -spare))  # cached prefixes give their cells back before anyone waits
                spare = room - decoding
            if len(self._active) <= 1 or (spare >= 0 and (decoding or spare > 0)):
                return max(spare, 0)
            self._preempt(max(self._active, key=_age))
            room = self.engine.kv_room()  # shared cells stay with their other users: ask, do not add

    def _reclaim(self, cells: int) -> int:
        """Evict prefix-cache entries that hold cells of the engine's shared pool, least recently used first, until
        ``cells`` are free again or none is left; returns the cells freed."""
        if self.cache is None or cells <= 0:
            return 0
        before = self.engine.kv_room() or 0
        freed = 0
        while freed < cells and self.cache.evict_pool():
            freed = (self.engine.kv_room() or 0) - before
        return freed

    def _preempt(self, t: Ticket) -> None:
        """``t`` gives its KV back and waits in ``_preempted``; its tokens, text and sampler stay as they are."""
        seq = t.seq
        self._active.remove(t)
        self._release_followers(t)  # before its KV goes
        t.lead = None
        if self.preempt_mode == "swap" and seq.n_cached > 0:
            try:
                t.swap = self.engine.kv_swap_out(seq)
            except Exception:  # noqa: BLE001 - it is recomputed instead
                log.exception("KV save for preemption failed; the sequence will be recomputed")
        self.engine.kv_drop(seq)
        seq.n_cached = 0
        t.preemptions += 1
        self.total_preemptions += 1
        bisect.insort(self._preempted, t, key=_age)

    def _resume(self, posts: list) -> None:
        """Bring preempted sequences back, oldest first, while the pool has room for all their tokens."""
        for t in [t for t in self._preempted if t._cancel]:
            self._finish(t, "cancelled", posts)
        room = self._room()
        while self._preempted:
            t = self._preempted[0]
            need = len(t.seq.tokens) + 1
            if room is not None and self._active and need > room:
                return
            self._preempted.pop(0)
            handle, t.swap = t.swap, None
            if handle is not None:
                try:
                    self.engine.kv_restore(t.seq, handle, len(handle.tokens))
                except Exception:  # noqa: BLE001 - recompute instead
                    log.exception("KV restore after preemption failed; recomputing")
                    self.engine.kv_drop(t.seq)
                    t.seq.n_cached = 0
                finally:
                    self.engine.kv_free(handle)
            bisect.insort(self._active, t, key=_age)  # the oldest sequences' prompts are fed first
            self.total_resumed += 1
            if room is not None:
                room -= need

    def _finish(self, t: Ticket, reason: str, posts: list, flush: bool = True) -> None:
        t.finish = reason
        tail = t.stream.flush() if flush and reason != "cancelled" else ""
        if tail:
            self._emit(t, tail, posts)
        if reason != "cancelled":
            self._end_output(t, posts)
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
        t.lead = None
        if t in self._active:
            self._active.remove(t)
            self._release_followers(t)
        elif t in self._preempted:
            self._preempted.remove(t)
        if t.swap is not None:
            handle, t.swap = t.swap, None
            self.engine.kv_free(handle)
        seq = t.seq
        # a sequence that ended inside a speculative run holds KV past its last token: only its tokens count
        seq.n_cached = min(seq.n_cached, len(seq.tokens))
        if save and self.cache is not None and seq.n_cached > 0:
            try:
                handle = self.engine.kv_save(seq)
            except Exception:  # noqa: BLE001
                log.exception("KV save failed")
                handle = None
            if handle is not None:
                if self.disk is not None and seq.sampling.adapter is None:
                    self._to_disk(handle, t.n_prompt)
                self.cache.insert(handle, seq.sampling.adapter)
        try:
            self.engine.remove_sequence(seq)
        except Exception:  # noqa: BLE001
            log.exception("remove_sequence failed")

    def _shutdown(self) -> None:
        posts: list = []
        err = Overloaded("The server is shutting down.", code="server_shutting_down", headers={"Retry-After": "5"})
        for t in [*self._active, *self._preempted]:
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


def _work(t: Ticket, n_ctx: int) -> int:
    """Tokens ``t`` has left to feed and generate (its prompt's rest, and up to max_tokens)."""
    seq = t.seq
    limit = n_ctx if t.req.max_tokens is None else min(n_ctx, t.n_prompt + t.req.max_tokens)
    return (len(seq.tokens) - seq.n_cached) + max(0, limit - len(seq.tokens))


def _age(t: Ticket) -> int:
    return t.seq.id  # sequence ids grow with submission: the largest is the youngest


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


class Pacer:
    """How many prompt tokens one step may carry, from the measured cost of a decode-only step and of a prompt token:

    * beside decoding sequences, enough to stretch the step to at most ``stretch`` times a decode-only step
      (2.0: a long prompt never slows the running streams below half their speed, and gets the other half);
      beside a request that is nearly done (``urgent``: at most ``SHORT_WORK`` tokens left to feed and generate),
      at most ``short_stretch`` (1.25): a short request finishes at close to its own speed, shortest work first,
      while a long prompt still moves on every step;
    * in any step, at most ``max_step_s`` seconds of prompt work, so that a request arriving during a long prompt
      waits one short step, not a long chunk (on fast hardware this is more than ``prefill_chunk`` anyway);
    * a prompt alone (nothing else running or queued) reads chunks of at most ``lone_step_s`` seconds (at least
      ``LONE_MIN`` tokens): large enough to cost little prompt speed (128-token chunks read a 1,459-token prompt at
      0.94x the speed of 256-token ones on a 2-core host, 32-token ones at 0.68x), small enough that a request
      arriving meanwhile waits at most that long for the chunk in progress.

    ``stretch`` 0 disables all of it (whole ``prefill_chunk`` steps: the most prompt throughput)."""

    MIN_TOKENS = 4
    LONE_MIN = 64
    SHORT_WORK = 32

    def __init__(self, stretch: float = 2.0, max_step_s: float = 0.25, lone_step_s: float = 0.6,
                 short_stretch: float = 1.25) -> None:
        self.stretch = stretch
        self.max_step_s = max_step_s
        self.lone_step_s = lone_step_s
        self.short_stretch = short_stretch
        self.decode_s = 0.0  # EWMA seconds of a decode-only step
        self.token_s = 0.0  # EWMA marginal seconds per prompt token in a step

    def budgets(self, chunk: int, decoding: bool, alone: bool = False, urgent: bool = False) -> tuple[int, int]:
        """(prompt tokens this step may carry, the part of them for long prompts). ``alone``: one prompt and nothing
        else running or queued; ``urgent``: a nearly done request runs (see the class)."""
        if self.stretch <= 0 or not self.token_s:
            return chunk, chunk
        if alone:
            lone = min(chunk, max(self.LONE_MIN, int(self.lone_step_s / self.token_s)))
            return lone, lone
        step = min(chunk, max(self.MIN_TOKENS, int(self.max_step_s / self.token_s)))
        if not (decoding or urgent) or not self.decode_s:
            return chunk, step
        stretch = min(self.stretch, self.short_stretch) if urgent else self.stretch
        return chunk, min(step, max(self.MIN_TOKENS, int((stretch - 1.0) * self.decode_s / self.token_s)))

    def observe(self, seconds: float, n_decode: int, n_prefill: int) -> None:
        if n_prefill == 0:
            if n_decode:
                self.decode_s = seconds if not self.decode_s else 0.8 * self.decode_s + 0.2 * seconds
            return
        base = self.decode_s if n_decode else 0.0
        if n_decode and not base:
            return
        per = max(seconds - base, 0.0) / n_prefill
        self.token_s = per if not self.token_s else 0.8 * self.token_s + 0.2 * per
