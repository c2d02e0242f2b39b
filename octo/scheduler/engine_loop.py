"""The engine-thread half of the shared scheduler (:class:`octo.scheduler.admission.Scheduler` derives from it).

Each iteration of :meth:`EngineLoop._run` resumes preempted sequences, admits queued jobs in FIFO order, runs
calls (embeddings, audio), then one ``Engine.step`` for every active sequence: decode tokens first, then prompt
chunks within the engine's ``prefill_chunk`` budget. Results go back to the event loop with one
``loop.call_soon_threadsafe`` per step. Stop strings, ``max_tokens``, EOS, the context limit, cancellation,
per-sequence engine failures and KV pressure are handled here, once, for every engine.

The loop holds its parts, each an object with its own state, given what it needs when it is made:

- ``kv`` (:class:`octo.scheduler.kv_pressure.KVPressure`): admission room, preemption and resumption;
- ``sharing`` (:class:`octo.scheduler.sharing.PrefixSharing`): in-flight prefix sharing (leads and followers);
- ``emission`` (:class:`octo.scheduler.emission.Emission`): masks, logprobs, reasoning, text and tool-call events;
- ``reuse`` (:class:`octo.scheduler.reuse.PrefixReuse`, or None): the prefix cache in use, with
  ``disk`` (:class:`octo.scheduler.disk_cache.DiskTier`, or None), its disk tier;
- ``isolation`` (:class:`octo.scheduler.step_isolation.StepIsolation`): a raising step costs one request;
- ``pacer`` (:class:`octo.scheduler.pacer.Pacer`): how much prompt a step may carry;
- ``planner`` (:class:`octo.scheduler.planner.Planner`): a step's feeds;
- ``media`` (:class:`octo.scheduler.media.MediaEncoder`): the encodes of the prompts' images, on a thread of their own;
- ``watchdog`` (:class:`octo.scheduler.watchdog.Watchdog`, made by the Scheduler, its owner).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from octo.engine import Engine, Feed, common_prefix
from octo.errors import EngineError, KVCacheFull, Overloaded
from octo.scheduler.disk_cache import DiskPrefixCache, DiskTier
from octo.scheduler.emission import Emission, put_event, token_id
from octo.scheduler.events import Cached, Done, Failed, Text
from octo.scheduler.jobs import Call, Job, Ticket
from octo.scheduler.kv_pressure import KVPressure
from octo.scheduler.media import MediaEncoder
from octo.scheduler.pacer import Pacer
from octo.scheduler.planner import Planner
from octo.scheduler.posting import (
    as_octo_error,
    deliver,
    fail_job,
    outcome,
    safe_free,
    set_exception,
    set_result,
)
from octo.scheduler.prefix_cache import PrefixCache
from octo.scheduler.reuse import PrefixReuse
from octo.scheduler.sharing import PrefixSharing
from octo.scheduler.step_isolation import StepIsolation
from octo.scheduler.watchdog import Watchdog

log = logging.getLogger("octo.scheduler.admission")
# iterations in a row failing outside a step: the loop gives up (octo.scheduler.watchdog takes over)
MAX_LOOP_FAILURES = 3
IDLE_WORK_DELAY_S = 5.0  # idleness before the engine's idle work (probes): not between a burst's requests, nor
# in the moment after a load, when the request that asked for the model is on its way


class EngineLoop:
    """The step loop (engine thread) and the state it shares with admission (the queue, under ``_lock``)."""

    gate: Any = None  # octo.runtime.arbiter.ComputeGate of a worker sharing the cores with other models
    watchdog: Watchdog  # made by the Scheduler (the watchdog's owner)

    def __init__(self, engine: Engine, *, max_batch: int, cache: PrefixCache | None, disk: DiskPrefixCache | None,
                 preempt: str, step_stretch: float, dedup: bool) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.cache = cache
        self._free_kv = safe_free(engine)
        self._lock = threading.Lock()  # guards the queue and the counters shared by both threads
        self._pending: deque[Job] = deque()
        self._active: list[Ticket] = []
        self._settling: list[Job] = []  # calls running and sequences ended in this iteration, not posted yet
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # the sleeping engine thread waits on it
        self._between: list[tuple[Callable[[], Any], Future]] = []  # run on the engine thread between two steps
        self._stopping = False
        self._sleeping = False
        # Engine.idle_work: seconds of idleness before its first call (None: the engine has none; it asks again)
        self.idle_delay: float | None = IDLE_WORK_DELAY_S if type(engine).idle_work is not Engine.idle_work else None
        self._outbox: list = []
        self._out_lock = threading.Lock()
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.total_processed = 0
        self.total_cancelled = 0
        self.generated_tokens = 0
        self.steps = 0
        self.calls_running = 0  # embedding / audio items the engine thread is working on now
        # the parts
        self.pacer = Pacer(step_stretch)
        self.sharing = PrefixSharing(engine, self._active, dedup)
        self.kv = KVPressure(engine, self._active, cache=cache, sharing=self.sharing, mode=preempt,
                             free_kv=self._free_kv)
        self._preempted = self.kv.preempted  # (the same list: the loop reads it, the kv part changes it)
        self.emission = Emission(engine)
        self.disk = DiskTier(disk, engine, cache) if disk is not None else None
        self.reuse = PrefixReuse(engine, cache, self.disk, self._free_kv) if cache is not None else None
        self.isolation = StepIsolation(engine, self._engine_step)
        self.media = MediaEncoder(engine, functools.partial(self._wake.put, None), lambda: self.gate)
        self.planner = Planner(engine, self._active, self.pacer, self.sharing, self._pending)
        # the per-token path calls the emission part through these (one attribute look-up, as when it was a mixin)
        self._dress, self._accept, self._emit = self.emission.dress, self.emission.accept, self.emission.emit

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
                    for t in [t for t in self._preempted if t.cancel_requested]:
                        self._finish(t, "cancelled", posts)
                    self.kv.resume()
                if self._pending:  # (read without the lock: what arrives meanwhile is admitted next time round)
                    self._admit(admitted, posts)
                if admitted and len(admitted) == len(self._active):  # an idle engine's first step
                    self._gather(admitted, posts)
                if admitted and posts:  # their answers' headers (and a chat stream's role chunk) go before the step
                    self.post(posts)
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
                    self.post(posts)  # and the watchdog fails what waits, and restarts it or the worker
                    self._settling.clear()  # (answered just now)
                    raise
            if posts:
                self.post(posts)
                posts = []
            self._settling.clear()
        self._shutdown()

    def _admit(self, admitted: list[Ticket], posts: list) -> None:
        """Take queued jobs, FIFO: run the calls (embeddings, audio), start the sequences (into ``admitted``)."""
        with self._lock:
            calls, tickets = self._admit_locked()
        admitted += tickets
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

    def _gather(self, admitted: list[Ticket], posts: list) -> None:
        """Requests sent together that arrive just after the first ones join their step when it is long
        (``Pacer.gather_s``)."""
        wait = self.pacer.gather_s(max(len(t.seq.tokens) - t.seq.n_cached for t in admitted))
        if wait and len(admitted) < self.max_batch:  # (requests that came together, short each: no wait)
            if posts:  # the admissions (a stream's headers) go out now
                self.post(posts[:])
                posts.clear()
            time.sleep(wait)
            if self._pending:
                more: list[Ticket] = []
                self._admit(more, posts)
                admitted += more

    def _idle(self) -> None:
        """Nothing to run: sleep until a kick (or stop; spurious wake-ups just look again), or give the engine's
        idle work (``Engine.idle_work``) its turn once the engine has been idle for the delay it asked for."""
        if self.idle_delay is None:
            self._wake.get()
            return
        try:
            self._wake.get(timeout=self.idle_delay)  # a request within the delay: the work waits for the next lull
            return
        except queue.Empty:
            pass
        self.watchdog.busy(None)
        try:
            self.idle_delay = self.engine.idle_work(self._interrupted)
        except Exception:  # noqa: BLE001 - optional work: it never costs serving
            log.exception("the engine's idle work failed; not retried")
            self.idle_delay = None
        finally:
            self.watchdog.idle()

    def _nap(self) -> None:
        """Nothing to feed but images being encoded: sleep until an encode ends or a request comes (a cancellation
        is seen within the nap's 50 ms)."""
        with self._lock:
            if self._pending or self._stopping:
                return
            self._sleeping = True
        self.watchdog.idle()
        try:
            self._wake.get(timeout=0.05)
        except queue.Empty:
            pass
        with self._lock:
            self._sleeping = False

    def _interrupted(self) -> bool:
        return bool(self._pending or self._between or self._stopping)

    def post(self, posts: list) -> None:
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
        deliver(posts)

    def _admit_locked(self) -> tuple[list[Call], list[Ticket]]:
        calls: list[Call] = []
        admitted: list[Ticket] = []
        if not self._pending or (self._active and self.engine.batching == "window"):
            return calls, admitted
        room = self.kv.room()
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
                need, keep = self._cells_needed(job, admitted)
                if need > room:  # prefix-cache entries give their pool cells back first (not the one it restores)
                    room += self.kv.reclaim(need - room, keep)
                if need > room and keep is not None:  # not enough: that one too, and the prompt is computed
                    need = len(job.seq.tokens) + 1
                    room += self.kv.reclaim(need - room)
                if need > room and (self._active or admitted):
                    break  # waits until the running sequences give cells back (alone, it always fits)
                room -= need
            self._pending.popleft()
            job.state = "active"
            job.t_admit = time.perf_counter()
            admitted.append(job)
        return calls, admitted

    def _cells_needed(self, job: Ticket, admitted: list[Ticket]) -> tuple[int, Any]:
        """The pool cells ``job`` takes when admitted: its prompt and a cell for the first decode step, less a prefix
        it shares with a running sequence (prefix sharing) or restores from prefix-cache cells in the pool; and that
        cache entry, which making room must not evict (a 20,000-token agent prompt's entry in a 32,768-cell pool was
        evicted to admit its own next turn)."""
        seq = job.seq
        shared = 0
        if self.sharing.dedup and self.engine.kv_shares_cells:  # a prefix shared with a running one is free
            shared = max((common_prefix(t.seq.tokens, seq.tokens, len(seq.tokens) - 1) for t in [*self._active,
                          *admitted] if t.seq.sampling.adapter == seq.sampling.adapter), default=0)
        keep, cached = self.kv.cached_cells(seq)
        return len(seq.tokens) + 1 - max(shared, cached), keep

    def _run_batch(self, jobs: list[Call], posts: list) -> None:
        self.post(posts[:])  # admissions now: an item answered early (below) must not wait for them
        posts.clear()

        def done(i: int, result: Any) -> None:  # the engine answers one item before the batch ends
            self.post([outcome(jobs[i].future, result)])

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
            posts.append(outcome(job.future, result))  # no-op for futures already answered by done()
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
        if self.reuse is not None and t.prompt_lps is None:  # prompt logprobs need every prompt position computed
            cached, err = self.reuse.restore(seq)
            if err is not None:
                self._fail(t, err, posts)
                return
            if cached:
                t.cached = cached
                if t.req.stream:  # before any text: a stream reports it at its start (Anthropic's usage)
                    posts.append((put_event, t.events, Cached(t.index, t.cached)))
        if seq.media:  # its images' encodes start now, beside what runs (octo.scheduler.media)
            self.media.start(t)
        if t.prompt_lps is None:
            self.sharing.find_lead(t)
        self._active.append(t)

    def _step(self, posts: list) -> None:
        """One ``Engine.step`` for the batch: cancelled sequences leave, followers take their leads' prefixes, KV
        pressure is settled, then the feeds are planned, stepped, and their outputs taken."""
        eng = self.engine
        n_ctx = eng.info.n_ctx if eng.info else 1 << 30
        for t in [t for t in self._active if t.cancel_requested]:
            self._finish(t, "cancelled", posts)
        for t, err in self.media.failed():  # an image that could not be encoded
            self._fail(t, err, posts)
        self.sharing.join_leads()
        room = eng.kv_room()
        spare = 1 << 30 if room is None else self.kv.fit(room)
        feeds, owners = self.planner.plan(n_ctx, spare)
        if not feeds:
            if self.media.busy:  # sequences wait for their images' encodes (octo.scheduler.media)
                self._nap()
            return
        dress = self._dress
        for f, t in zip(feeds, owners, strict=True):
            if t.extra:
                dress(f, t)
        n_decode = n_fed = 0
        starts = []
        for f in feeds:  # (one loop, no generators: this runs every step)
            n_fed += (k := len(f.tokens))
            n_decode += k == 1 and f.sample  # (a bool: the planner makes the feeds)
            starts.append(f.seq.n_cached)
        started = time.perf_counter()
        out = self._call_step(feeds, owners, starts, posts, n_fed)
        if out is None:
            return
        self.steps += 1
        self.pacer.observe(time.perf_counter() - started, n_decode, n_fed - n_decode)
        self._take_outputs(feeds, owners, out, starts, n_ctx, posts)

    def _take_outputs(self, feeds: list[Feed], owners: list[Ticket], out: list, starts: list[int], n_ctx: int,
                      posts: list) -> None:
        """Each sequence takes what the step gave it: prompt logprobs, its sampled token(s); it fails alone when the
        engine failed it, gave it something unusable, or broke the step contract."""
        eng = self.engine
        eos = eng.info.eos_token_ids if eng.info else frozenset()
        n_vocab = eng.info.n_vocab if eng.info else 0
        token_bytes = eng.token_bytes
        take = self._take
        for f, t, tok, start in zip(feeds, owners, out, starts, strict=True):
            if isinstance(tok, BaseException):  # the engine failed this sequence alone
                self._fail(t, tok, posts)
                continue
            try:
                if t.extra and t.prompt_lps is not None:
                    self.emission.prompt_logprobs(f, t)
                if tok is not None and f.sample:  # (a token for a feed that did not ask for one is ignored)
                    if isinstance(tok, list):  # speculative decoding: several tokens at once, each checked as if alone
                        for x in tok:
                            if not take(f, t, x, eos, posts, n_ctx, token_bytes, n_vocab):
                                break
                    else:
                        take(f, t, tok, eos, posts, n_ctx, token_bytes, n_vocab)
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

    def _engine_step(self, feeds: list[Feed], n_fed: int = -1) -> list:
        """``Engine.step(feeds)`` (``n_fed`` tokens) as the loop runs it: watched by the watchdog, in the compute gate's
        turn where several models share the cores (octo.runtime.arbiter), one output per feed; raises what it raised."""
        gate = self.gate
        self.watchdog.busy(n_fed if n_fed >= 0 else sum(len(f.tokens) for f in feeds))
        try:
            if gate is not None:
                gate.enter()
            try:
                out = self.engine.step(feeds)
            finally:
                if gate is not None:
                    gate.exit()
            if len(out) != len(feeds):
                raise EngineError(f"the engine step returned {len(out)} tokens for {len(feeds)} feeds")
        finally:
            self.watchdog.idle(between=True)
        return out

    def _call_step(self, feeds: list[Feed], owners: list[Ticket], starts: list[int], posts: list,
                   n_fed: int) -> list | None:
        """``Engine.step(feeds)`` (``starts``: each sequence's ``n_cached`` before it; ``n_fed``: their tokens): its
        outputs, or None when the step is over (failed, or to run again)."""
        try:
            return self._engine_step(feeds, n_fed)
        except KVCacheFull as exc:  # nothing was consumed: make room and run the step again
            if self.kv.reclaim(n_fed):
                return None
            if len(self._active) > 1 and self.engine.kv_room() is not None:  # (no shared pool: preempting frees none)
                log.info("%s; preempting the youngest sequence", exc.message)
                self.kv.preempt_youngest()
                return None
            err: BaseException = exc
        except BaseException as exc:  # noqa: BLE001 - fail this step's sequences (or only the one that raises)
            log.exception("engine step failed")
            out = self.isolation.isolate(feeds, starts, exc)  # engines that can undo a step try again without it
            if out is not None:
                return out
            err = exc
        for t in owners:
            if t.state == "active":
                self._fail(t, err, posts)
        return None

    def _take(self, f: Feed, t: Ticket, tok: Any, eos: frozenset, posts: list, n_ctx: int, token_bytes: Any,
              n_vocab: int) -> bool:
        """A sampled token of ``t``: constraint, text, stop strings, limits; False when the sequence ended."""
        if tok.__class__ is not int or tok < 0 or (n_vocab and tok >= n_vocab):  # (a plain valid id: no call)
            tok = token_id(tok, n_vocab)
            if isinstance(tok, EngineError):
                self._fail(t, tok, posts)
                return False
        if t.extra:
            err = self._accept(f, t, tok, eos, posts)
            if err is not None:
                self._fail(t, err, posts)
                return False
        tokens = t.seq.tokens
        tokens.append(tok)
        n = len(tokens)
        if not t.t_first:
            t.t_first = time.perf_counter()
        self.generated_tokens += 1
        if tok in eos:
            t.hit_eos = True
            self._finish(t, "stop", posts)
            return False
        try:
            piece, stopped = t.stream.push(token_bytes(tok), n >= t.min_len)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot spell its own token: this sequence fails
            log.exception("token_bytes(%d) failed", tok)
            self._fail(t, exc, posts)
            return False
        if piece:
            if t.plain:  # no reasoning split, no tool-call parser: Emission.emit's work for it, inline
                t.text.append(piece)
                if t.req.stream:
                    posts.append((put_event, t.events, Text(t.index, piece)))
            else:
                self._emit(t, piece, posts)
        if stopped:
            self._finish(t, "stop", posts, flush=False)
        elif t.matcher is not None and t.matcher.is_done():  # nothing but the end can follow
            self._finish(t, "stop", posts)
        elif n >= t.stop_len or n >= n_ctx:  # max_tokens, or the context
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
            self.emission.end_output(t, posts)
        self._retire(t)
        if reason == "cancelled":
            self.total_cancelled += 1
        else:
            self.total_processed += 1
        result = t.build_result()
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
            self.sharing.release_followers(t)
        self.kv.discard(t)  # out of the preempted queue, its swapped KV freed
        seq = t.seq
        # a sequence that ended inside a speculative run holds KV past its last token: only its tokens count
        seq.n_cached = min(seq.n_cached, len(seq.tokens))
        if save and self.reuse is not None and seq.n_cached > 0:
            self.reuse.save(seq, t.n_prompt)
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
        self.media.close()
        if (posts or pending) and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(deliver, posts)
            for job in pending:
                self._loop.call_soon_threadsafe(fail_job, job, err)
