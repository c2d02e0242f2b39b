"""The engine-thread half of the shared scheduler (:class:`octo.scheduler.admission.Scheduler` derives from it).

Each iteration of :meth:`EngineLoop._run` resumes preempted sequences, admits queued jobs in FIFO order, runs
calls (embeddings, audio), then one ``Engine.step`` for every active sequence: decode tokens first, then prompt
chunks within the engine's ``prefill_chunk`` budget. Results go back to the event loop with one
``loop.call_soon_threadsafe`` per step. Stop strings, ``max_tokens``, EOS, the context limit, cancellation,
per-sequence engine failures and KV pressure are handled here, once, for every engine.

KV pressure (preemption and resumption) lives in ``octo.scheduler.kv_pressure``, in-flight prefix sharing in
``octo.scheduler.sharing``,
constraints, logprobs and tool-call events in ``octo.scheduler.emission``; all are mixins of :class:`EngineLoop`.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from octo.engine import Feed, KVHandle, common_prefix
from octo.errors import EngineError, KVCacheFull, OctoError, Overloaded
from octo.scheduler.disk_cache import DiskTier
from octo.scheduler.emission import Emission, put_event
from octo.scheduler.events import Cached, Done, Failed
from octo.scheduler.jobs import Call, Job, Ticket
from octo.scheduler.kv_pressure import KVPressure, age_of, check_restored, check_saved
from octo.scheduler.pacer import Pacer
from octo.scheduler.sharing import PrefixSharing
from octo.scheduler.step_isolation import StepIsolation

log = logging.getLogger("octo.scheduler.admission")
# iterations in a row failing outside a step: the loop gives up (octo.scheduler.watchdog takes over)
MAX_LOOP_FAILURES = 3


class EngineLoop(KVPressure, PrefixSharing, Emission, DiskTier, StepIsolation):
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
        failures = 0  # iterations in a row that failed outside a step
        while True:
            admitted: list[Ticket] = []
            try:
                self.watchdog.busy(0)  # engine calls between steps (add/remove_sequence, kv_*) are watched too
                if self._between:
                    self._run_between()
                with self._lock:
                    idle = not self._stopping and not self._pending and not self._active and not self._preempted
                    self._sleeping = idle
                    if self._stopping:
                        break
                if idle:
                    self.watchdog.idle()
                    if self.gate is not None:
                        self.gate.idle()
                    self._idle()
                    continue
                if self._preempted:
                    self._resume(posts)
                with self._lock:
                    calls, admitted = self._admit_locked()
                for job in admitted + calls:
                    if job.admitted is not None:
                        posts.append((set_result, job.admitted, None))
                if calls and calls[0].batch_key is not None:
                    self._run_batch(calls, posts)
                else:
                    for job in calls:
                        self._run_call(job, posts)
                for t in admitted:
                    self._start(t, posts)
                if admitted and posts:  # their answers' headers (and a chat stream's role chunk) go before the step
                    self._post(posts)
                    posts = []
                if self._active:
                    self._step(posts)
                failures = 0
            except BaseException as exc:  # noqa: BLE001 - a fault outside step: fail what runs, keep serving
                log.exception("the engine loop failed; failing the sequences in flight")
                for t in [*self._active, *self._preempted, *(t for t in admitted if t.state == "active")]:
                    if t.state == "active":
                        self._fail(t, exc, posts)
                failures += 1
                if failures >= MAX_LOOP_FAILURES:  # it fails whatever it runs (kv_room raises): the loop is dead
                    self._post(posts)  # and the watchdog fails what waits, and restarts it or the worker
                    self._settling.clear()  # (answered just now)
                    raise
            if posts:
                self._post(posts)
                posts = []
            self._settling.clear()
        self._shutdown()

    def _idle(self) -> None:
        """Nothing to run: sleep until a kick (or stop; spurious wake-ups just look again), or give the engine's
        idle work (``Engine.idle_work``) its turn once the engine has been idle for the delay it asked for."""
        if self._idle_delay is None:
            self._wake.get()
            return
        try:
            self._wake.get(timeout=self._idle_delay)  # a request within the delay: the work waits for the next lull
            return
        except queue.Empty:
            pass
        self.watchdog.busy(None)
        try:
            self._idle_delay = self.engine.idle_work(self._interrupted)
        except Exception:  # noqa: BLE001 - optional work: it never costs serving
            log.exception("the engine's idle work failed; not retried")
            self._idle_delay = None
        finally:
            self.watchdog.idle()

    def _interrupted(self) -> bool:
        return bool(self._pending or self._between or self._stopping)

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

    def _admit_locked(self) -> tuple[list[Call], list[Ticket]]:
        calls: list[Call] = []
        admitted: list[Ticket] = []
        if not self._pending or (self._active and self.engine.batching == "window"):
            return calls, admitted
        room = self._room()
        while self._pending:
            job = self._pending[0]
            if isinstance(job, Call):
                if admitted:  # keep FIFO: run the call after this step's admissions
                    break
                self._pending.popleft()
                job.state = "active"
                calls.append(job)
                while (job.batch_key is not None and self._pending and len(calls) < self.max_batch
                       and isinstance(self._pending[0], Call) and self._pending[0].batch_key == job.batch_key):
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
            job.t_admit = time.perf_counter()
            admitted.append(job)
        return calls, admitted

    def _run_batch(self, jobs: list[Call], posts: list) -> None:
        self._post(posts[:])  # admissions now: an item answered early (below) must not wait for them
        posts.clear()

        def done(i: int, result: Any) -> None:  # the engine answers one item before the batch ends
            self._post([_outcome(jobs[i].future, result)])

        self.watchdog.busy(None)
        self.calls_running = len(jobs)
        self._settling += jobs  # a wedged call: the watchdog answers them
        try:
            results = list(jobs[0].fn(self.engine, [j.item for j in jobs], done))
            if len(results) != len(jobs):
                raise EngineError(f"batched call returned {len(results)} results for {len(jobs)} items")
        except BaseException as exc:  # noqa: BLE001 - the error goes to every caller still waiting
            results = [exc] * len(jobs)
        finally:
            self.calls_running = 0
            self.watchdog.idle(between=True)
        for job, result in zip(jobs, results, strict=True):
            posts.append(_outcome(job.future, result))  # no-op for futures already answered by done()
            job.state = "done"
            self.total_processed += not job.gone  # an abandoned one counts as cancelled (Scheduler.abandon)

    def _run_call(self, job: Call, posts: list) -> None:
        self._settling.append(job)  # a wedged call: the watchdog answers it
        self.watchdog.busy(None)
        self.calls_running = 1
        try:
            result = job.fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - the error goes to the caller
            posts.append((set_exception, job.future, as_octo_error(exc)))
        else:
            posts.append((set_result, job.future, result))
        finally:
            self.calls_running = 0
            self.watchdog.idle(between=True)
        job.state = "done"
        self.total_processed += not job.gone

    def _start(self, t: Ticket, posts: list) -> None:
        seq = t.seq
        try:
            self.engine.add_sequence(seq)
        except BaseException as exc:  # noqa: BLE001 - remove_sequence gives back what it may have taken
            self._fail(t, exc, posts)
            return
        if self.cache is not None and t.prompt_lps is None:  # prompt logprobs need every prompt position computed
            handle, n = self.cache.lookup(seq.tokens, len(seq.tokens) - 1, seq.sampling.adapter)
            fresh = None  # a handle imported from the disk tier: the in-memory cache takes it after the restore
            if self.disk is not None and seq.sampling.adapter is None:  # the disk holds base-model KV only
                handle, n, fresh = self._from_disk(seq, handle, n)
            if handle is not None:
                try:
                    self.engine.kv_restore(seq, handle, n)
                    check_restored(seq, n)
                    t.cached = seq.n_cached
                    if seq.n_cached != n:  # the engine reused less than the index offered
                        self.cache.tokens_reused -= n - seq.n_cached
                except Exception:  # noqa: BLE001 - a failed restore is a miss, never an error
                    log.exception("KV restore failed; recomputing the prompt")
                    self.cache.restore_failed(n)
                    seq.n_cached = 0
                    try:
                        self.engine.remove_sequence(seq)
                        self.engine.add_sequence(seq)
                    except Exception as exc:  # noqa: BLE001 - this request fails alone
                        self._fail(t, exc, posts)
                        return
                if fresh is not None and seq.n_cached > 0:
                    self.cache.insert(fresh)
                elif fresh is not None:  # the engine refused the disk entry's bytes: not kept
                    self._free_kv(fresh)
            if t.cached and t.req.stream:  # before any text: a stream reports it at its start (Anthropic's usage)
                posts.append((put_event, t.events, Cached(t.index, t.cached)))
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
            elif remaining > 1 and t.lead is None:  # a follower waits for its lead's prefix (octo.scheduler.sharing)
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
            # longer than one step's worth of prompt work (the pacer's `short`, never less than its share `paced`) or
            # the least work a decoding request has left (so streams that arrive just after a first one join it
            # together at its next step, instead of one by one behind it: 8 short streams took 1.9 s to all start,
            # against 0.8 s with llama-server)
            least = max(self._pacer.short(budget), min(_work(t, n_ctx) for t in owners)) if owners else budget
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
        n_decode = sum(1 for f in feeds if len(f.tokens) == 1 and f.sample)
        n_fed = sum(len(f.tokens) for f in feeds)
        starts = [f.seq.n_cached for f in feeds]
        started = time.perf_counter()
        out = self._call_step(feeds, owners, starts, posts)
        if out is None:
            return
        self.steps += 1
        self._pacer.observe(time.perf_counter() - started, n_decode, n_fed - n_decode)
        eos = eng.info.eos_token_ids if eng.info else frozenset()
        n_vocab = eng.info.n_vocab if eng.info else 0
        token_bytes = eng.token_bytes
        for f, t, tok, start in zip(feeds, owners, out, starts, strict=True):
            if isinstance(tok, BaseException):  # the engine failed this sequence alone
                self._fail(t, tok, posts)
                continue
            try:
                if t.extra and t.prompt_lps is not None:
                    self._prompt_logprobs(f, t)
                if tok is not None and f.sample:  # (a token for a feed that did not ask for one is ignored)
                    if isinstance(tok, list):  # speculative decoding: several tokens at once, each checked as if alone
                        for x in tok:
                            if not self._take(f, t, x, eos, posts, n_ctx, token_bytes, n_vocab):
                                break
                    else:
                        self._take(f, t, tok, eos, posts, n_ctx, token_bytes, n_vocab)
                seq = f.seq
                if t.state == "active" and not 0 <= seq.n_cached < len(seq.tokens):  # nothing left to feed: a hang
                    raise EngineError(
                        f"The {eng.name} engine broke the step contract: after feeding tokens {start}.."
                        f"{start + len(f.tokens) - 1}{' and sampling' if f.sample else ''}, it holds {seq.n_cached} "
                        f"of the sequence's {len(seq.tokens)} tokens in its KV and gave no new token to feed.")
            except Exception as exc:  # noqa: BLE001 - what the engine gave this sequence (logprobs, ...): it fails alone
                if not isinstance(exc, EngineError):
                    log.exception("taking the engine's output for sequence %d failed", t.seq.id)
                if t.state == "active":
                    self._fail(t, exc, posts)

    def _call_step(self, feeds: list[Feed], owners: list[Ticket], starts: list[int], posts: list) -> list | None:
        """``Engine.step(feeds)`` (``starts``: each sequence's ``n_cached`` before it): its outputs, or None when the
        step is over (failed, or to run again)."""
        eng, gate = self.engine, self.gate
        n_fed = sum(len(f.tokens) for f in feeds)
        self.watchdog.busy(n_fed)
        try:
            if gate is not None:  # several models share the cores: compute in turns (octo.runtime.arbiter)
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
                return None
            if len(self._active) > 1 and eng.kv_room() is not None:  # (no shared pool: preempting frees nothing)
                log.info("%s; preempting the youngest sequence", exc.message)
                self._preempt(max(self._active, key=age_of))
                return None
            for t in owners:
                if t.state == "active":
                    self._fail(t, exc, posts)
            return None
        except BaseException as exc:  # noqa: BLE001 - fail this step's sequences (or only the one that raises)
            log.exception("engine step failed")
            out = self._isolate(feeds, starts, exc)  # engines that can undo a step: octo.scheduler.step_isolation
            if out is None:
                for t in owners:
                    if t.state == "active":
                        self._fail(t, exc, posts)
                return None
        finally:
            self.watchdog.idle(between=True)
        return out

    def _take(self, f: Feed, t: Ticket, tok: Any, eos: frozenset, posts: list, n_ctx: int, token_bytes: Any,
              n_vocab: int) -> bool:
        """A sampled token of ``t``: constraint, text, stop strings, limits; False when the sequence ended."""
        tok = _token_id(tok, n_vocab)
        if isinstance(tok, EngineError):
            self._fail(t, tok, posts)
            return False
        if t.extra and not self._accept(f, t, tok, eos, posts):
            return False
        tokens = t.seq.tokens
        tokens.append(tok)
        if not t.t_first:
            t.t_first = time.perf_counter()
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

    def _finish(self, t: Ticket, reason: str, posts: list, flush: bool = True) -> None:
        self._settling.append(t)
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
            posts.append((put_event, t.events, Done(t.index, result)))
        posts.append((set_result, t.result, result))

    def _fail(self, t: Ticket, exc: BaseException, posts: list) -> None:
        self._settling.append(t)
        t.finish = "error"
        self._retire(t, save=False)
        err = as_octo_error(exc)
        if t.events is not None:
            posts.append((put_event, t.events, Failed(t.index, err)))
        posts.append((set_exception, t.result, err))

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
            self._free_kv(handle)
        seq = t.seq
        # a sequence that ended inside a speculative run holds KV past its last token: only its tokens count
        seq.n_cached = min(seq.n_cached, len(seq.tokens))
        if save and self.cache is not None and seq.n_cached > 0:
            handle = None
            try:  # whatever the engine does here, the request still gets its result
                handle = self.engine.kv_save(seq)
                if handle is not None:
                    check_saved(handle, seq)
                    if self.disk is not None and seq.sampling.adapter is None:
                        self._to_disk(handle, t.n_prompt)
                    self.cache.insert(handle, seq.sampling.adapter)
            except Exception:  # noqa: BLE001
                log.exception("KV save failed")
                if isinstance(handle, KVHandle):  # not kept: the engine gets it back
                    self._free_kv(handle)
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
                self._loop.call_soon_threadsafe(fail_job, job, err)


def _work(t: Ticket, n_ctx: int) -> int:
    """Tokens ``t`` has left to feed and generate (its prompt's rest, and up to max_tokens)."""
    seq = t.seq
    limit = n_ctx if t.req.max_tokens is None else min(n_ctx, t.n_prompt + t.req.max_tokens)
    return (len(seq.tokens) - seq.n_cached) + max(0, limit - len(seq.tokens))


def safe_free(engine: Any) -> Callable[[Any], None]:
    """``engine.kv_free`` that logs instead of raising: a handle the engine cannot free is its leak, not a failure
    of the request (or of the prefix-cache index) that let it go."""
    def free(handle: Any) -> None:
        try:
            engine.kv_free(handle)
        except Exception:  # noqa: BLE001
            log.exception("kv_free failed")
    return free


def _token_id(tok: Any, n_vocab: int) -> int | EngineError:
    """``tok`` as a token id, or the error of an engine that sampled something else (a native engine would crash
    on a negative id, or one past its vocabulary)."""
    try:
        tok = operator.index(tok)  # an int, or a numpy integer
    except TypeError:
        return EngineError(f"The engine sampled {tok!r} ({type(tok).__name__}), which is not a token id.")
    if tok < 0 or (n_vocab and tok >= n_vocab):
        return EngineError(f"The engine sampled token id {tok}, which is outside its vocabulary"
                           + (f" (0..{n_vocab - 1})." if n_vocab else "."))
    return tok


def new_engine_thread() -> ThreadPoolExecutor:
    """A model's engine thread: one thread that runs its load, warm-up, benchmark and every step, in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="octo-engine")


def as_octo_error(exc: BaseException) -> OctoError:
    if isinstance(exc, OctoError):
        return exc
    return EngineError(f"The engine failed: {type(exc).__name__}: {exc}")


def fail_job(job: Job, err: OctoError) -> None:
    """On the event loop: a job that never ran gets ``err`` (its admission wait, and its result)."""
    if job.admitted is not None:
        set_exception(job.admitted, err)
    set_exception(job.result if isinstance(job, Ticket) else job.future, err)


def _outcome(fut: asyncio.Future, result: Any) -> tuple:
    if isinstance(result, BaseException):
        return (set_exception, fut, as_octo_error(result))
    return (set_result, fut, result)


def set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.add_done_callback(_consume)  # nobody may await it (client gone)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _deliver(posts: list) -> None:
    for fn, target, value in posts:
        fn(target, value)
