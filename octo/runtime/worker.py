"""An engine worker process: one loaded model (engine, scheduler, prefix cache, KV) behind socket pairs.

Started by the gateway (``octo.runtime.remote``) as ``python -m octo.runtime.worker DOWN_FD UP_FD ARBITER_FD
PARENT_PID BEAT_S``
(the arbiter socket: see ``octo.runtime.arbiter``; a heartbeat goes up every BEAT_S seconds from a thread of its own, by
which the gateway knows it is alive: ``octo.runtime.supervision``). Its event loop reads the gateway's messages; its
engine
thread runs the ordinary :class:`octo.scheduler.admission.Scheduler` and sends one message per engine step with every
sequence's new text (``WorkerScheduler.post``), straight from that thread.
The engine sees one model in one process, exactly as in-process.

The worker ignores SIGINT/SIGTERM (the gateway drains and then stops it), dies with its parent
(``PR_SET_PDEATHSIG`` on Linux, and EOF on its socket everywhere), and never outlives the gateway.

Messages down (gateway -> worker): ``("gen", rid, kind, req)``, ``("cancel", rid)``, and requests
``(op, cid, *args)`` answered by ``("r", cid, ok, value)``: load, bench, serve, call, prompt_texts, stats, stop.
Up: ``("hb",)`` (the heartbeat), ``("ev", [(rid, code, index, value), ...])``: the requests' events
(``octo.scheduler.events``: text, reasoning, tool-call deltas, logprobs, cached tokens, admission, result, error;
index -1:
every sequence of the request), each encoded by ``octo.scheduler.events.encode``. Admission is sent for every request,
so that
the gateway can hold its own queue deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine, Task
from octo.errors import OctoError
from octo.runtime import ipc
from octo.runtime.loader import check_available
from octo.runtime.model import ModelHandle, load_engine, local_stats, prepare, run_call, serving_api
from octo.runtime.prespawn import PLUGINS_ENV, PRELOAD_ENV
from octo.runtime.supervision import FAULT_EXIT
from octo.scheduler.admission import Scheduler
from octo.scheduler.events import DONE, STREAM_CODES, Admitted, Done, Event, Failed, encode
from octo.scheduler.jobs import Ticket
from octo.scheduler.posting import as_octo_error, new_engine_thread

log = logging.getLogger("octo.runtime.worker")
LOOP_STUCK_S = 5.0  # the event loop blocked this long (at least; the queue time-out when longer): the worker exits


class Outbox:
    """Events waiting to go up. The engine thread flushes after each step; events added on the event loop (queue
    time-outs, shutdown) are flushed at the end of that loop iteration."""

    def __init__(self, sender: ipc.BlockingSender, loop: asyncio.AbstractEventLoop) -> None:
        self._sender = sender
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._items: list[tuple] = []
        self._scheduled = False
        self.requests: dict[int, list] = {}  # rid -> [tickets, results still to send]; guarded by _lock

    def add(self, rid: int, ev: Event) -> None:
        with self._lock:
            self._items.append(encode(rid, ev))
            if ev.code >= DONE and ev.index >= 0:
                entry = self.requests.get(rid)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self.requests[rid]
            schedule = threading.get_ident() == self._loop_thread and not self._scheduled
            if schedule:
                self._scheduled = True
        if schedule:
            self._loop.call_soon(self.flush)

    def track(self, rid: int, sequences: int) -> None:
        """Remember request ``rid`` until its ``sequences`` results are sent (or it is cancelled)."""
        with self._lock:
            self.requests[rid] = [None, sequences]

    def set_tickets(self, rid: int, tickets: list) -> None:
        with self._lock:
            entry = self.requests.get(rid)
            if entry is not None:  # None: every result already went out
                entry[0] = tickets

    def forget(self, rid: int) -> list:
        """Stop tracking ``rid``; its tickets (empty if none were queued or all finished)."""
        with self._lock:
            entry = self.requests.pop(rid, None)
        return (entry[0] or []) if entry else []

    def flush(self) -> None:
        with self._sender.lock:  # one sender at a time, so the order of events is kept across threads
            with self._lock:
                items, self._items = self._items, []
                self._scheduled = False
            if items:
                self._sender.send_locked(("ev", items))


class WireFuture:
    """Stands in for a ticket's asyncio future: setting it sends an event to the gateway (the result future
    ``Done`` or ``Failed``, the admission future ``Admitted``)."""

    __slots__ = ("_outbox", "_rid", "_index", "_admission", "_ticket", "_done")

    def __init__(self, outbox: Outbox, rid: int, index: int, admission: bool, ticket: Ticket) -> None:
        self._outbox, self._rid, self._index, self._admission, self._ticket = outbox, rid, index, admission, ticket
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, value: Any) -> None:
        self._done = True
        ev = Admitted(self._index, self._ticket.n_prompt) if self._admission else Done(self._index, value)
        self._outbox.add(self._rid, ev)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        if not self._admission:  # an admission that fails always fails the result too: one event says it
            self._outbox.add(self._rid, Failed(self._index, exc))

    def add_done_callback(self, fn: Any) -> None:
        pass


class WireQueue:
    """Stands in for a request's event queue: every stream event goes up as it is; a sequence's end (``Done``,
    ``Failed``) goes up once, from its result future."""

    __slots__ = ("_outbox", "rid")

    def __init__(self, outbox: Outbox, rid: int) -> None:
        self._outbox, self.rid = outbox, rid

    def put_nowait(self, ev: Event) -> None:
        if ev.code < STREAM_CODES:
            self._outbox.add(self.rid, ev)


_WIRE = (WireFuture, WireQueue)


class WorkerScheduler(Scheduler):
    """The shared scheduler, delivering to the gateway instead of to asyncio futures of this process."""

    def __init__(self, engine: Engine, *, outbox: Outbox, gate: Any = None, **kw: Any) -> None:
        super().__init__(engine, **kw)
        self.outbox = outbox
        self.gate = gate

    def make_ticket(self, req, sampling, events, index) -> Ticket:
        t = super().make_ticket(req, sampling, events, index)
        t.result = WireFuture(self.outbox, events.rid, index, False, t)
        t.admitted = WireFuture(self.outbox, events.rid, index, True, t)  # the gateway times out what stays queued
        return t

    def post(self, posts: list) -> None:
        rest = []
        for post in posts:
            if isinstance(post[1], _WIRE):
                post[0](post[1], post[2])
            else:
                rest.append(post)  # calls' futures live on this process's loop
        self.outbox.flush()
        if rest:
            super().post(rest)


class Worker:
    def __init__(self, sender: ipc.BlockingSender, loop: asyncio.AbstractEventLoop, gate: Any = None) -> None:
        self.sender = sender
        self.gate = gate
        self.loop = loop
        self.outbox = Outbox(sender, loop)
        self.engine: Engine | None = None
        self.prepared_for: str | None = None  # the one engine this worker prepared for (preload), if one alone
        self.handle: ModelHandle | None = None
        # load, warm-up, benchmark and every step run on this one thread (see Scheduler.start)
        self.engine_thread = new_engine_thread()
        self.spec: dict[str, Any] = {}
        self.closed = asyncio.Event()
        self._ops: dict[int, asyncio.Task] = {}  # operations running as tasks, by call id ("cancel_op" ends them)
        self._engines: dict[str | None, dict[str, type[Engine]]] = {}  # plugins_dir -> engine registry

    # -- dispatch ----------------------------------------------------------------------------------------
    def on_message(self, msg: tuple) -> None:
        op = msg[0]
        if op == "gen":
            self._gen(*msg[1:])
        elif op == "cancel":
            self._cancel(msg[1])
        elif op == "cancel_op":  # the gateway's caller went away: an embedding or audio call leaves the queue
            task = self._ops.get(msg[1])
            if task is not None:
                task.cancel()
        else:
            handler = getattr(self, f"op_{op}", None)
            cid, args = msg[1], msg[2:]
            if handler is None:
                self._reply(cid, False, OctoError(f"worker: unknown operation {op!r}"))
            elif asyncio.iscoroutinefunction(handler):
                self._ops[cid] = self.loop.create_task(self._run(cid, handler, args))
            else:
                self._call(cid, handler, args)

    def _call(self, cid: int, handler: Any, args: tuple) -> None:
        try:
            value = handler(*args)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the gateway
            self._reply(cid, False, as_octo_error(exc))
        else:
            self._reply(cid, True, value)

    async def _run(self, cid: int, handler: Any, args: tuple) -> None:
        try:
            value = await handler(*args)
        except asyncio.CancelledError:  # cancelled by the gateway: nobody waits for a reply
            pass
        except BaseException as exc:  # noqa: BLE001
            self._reply(cid, False, as_octo_error(exc))
        else:
            self._reply(cid, True, value)
        finally:
            self._ops.pop(cid, None)

    def _reply(self, cid: int, ok: bool, value: Any) -> None:
        self.sender.send(("r", cid, ok, value))

    # -- generation --------------------------------------------------------------------------------------
    def _gen(self, rid: int, kind: str, req: Any) -> None:
        sched = self.handle.scheduler
        try:
            gens, n = prepare(self.handle, kind, req)
            expected = serving_api().sequence_count(kind, req)
            if len(gens) * n != expected:
                raise OctoError(f"worker: {len(gens) * n} sequences for a request the gateway counted {expected}")
            self.outbox.track(rid, expected)
            self.outbox.set_tickets(rid, sched.submit_all(gens, n, WireQueue(self.outbox, rid)))
        except BaseException as exc:  # noqa: BLE001 - a refused request: every sequence gets the error
            self.outbox.forget(rid)
            self.outbox.add(rid, Failed(-1, as_octo_error(exc)))

    def _cancel(self, rid: int) -> None:
        for t in self.outbox.forget(rid):
            if t.state in ("pending", "active"):
                self.handle.scheduler.abandon(t)

    # -- operations ----------------------------------------------------------------------------------------
    async def _on_engine_thread(self, fn: Any, *args: Any) -> Any:
        return await self.loop.run_in_executor(self.engine_thread, fn, *args)

    async def op_load(self, spec: dict[str, Any]) -> dict[str, Any]:
        import_serving()
        return await self._on_engine_thread(self._load, spec)

    def _load(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Load the engine (``spec``: engine, artifact, name, config, plugins_dir, warmup); its ModelInfo back."""
        if self.engine is not None:  # one engine a worker: its EngineConfig.own_process says so
            raise OctoError(f"worker: {self.engine.name} is already loaded here")
        if self.prepared_for not in (None, spec["engine"]):
            raise OctoError(f"worker: prepared for {self.prepared_for} alone, not {spec['engine']}")
        self.spec = spec
        cls = self.engine_classes(spec.get("plugins_dir"))[spec["engine"]]
        check_available(cls)  # (checked here, not in the gateway: octo.runtime.loader.canonical_engine)
        t0 = time.perf_counter()
        self.engine = load_engine(cls, spec["config"], spec["artifact"], spec["name"], own_process=True)
        load_s = time.perf_counter() - t0
        if spec.get("warmup"):
            warm_up(self.engine)
        return {"info": self.engine.info, "batching": self.engine.batching, "load_seconds": round(load_s, 3),
                "pid": os.getpid(), "version": cls.version()}

    def engine_classes(self, plugins_dir: str | None) -> dict[str, type[Engine]]:
        """(engine thread) The engine registry of ``plugins_dir``'s plugins, made once."""
        registry = self._engines.get(plugins_dir)
        if registry is None:
            from octo.plugins import engine_registry, load_plugins

            registry = self._engines[plugins_dir] = engine_registry(load_plugins(plugins_dir))
        return registry

    def preload(self, plugins_dir: str | None, engines: list[str]) -> None:
        """(engine thread, while the worker waits for its model) Load the plugins and import the native libraries of
        ``engines`` (``prepare``; ``prepare_own_process`` when it names one alone), so that the model's load starts
        with them done (``OCTO_WORKER_PRELOAD``)."""
        t0 = time.perf_counter()
        try:
            registry = self.engine_classes(plugins_dir)
            if len(engines) == 1:  # started for this engine alone: the gateway gives it to no other (may_take)
                self.prepared_for = engines[0]
            for name in engines:
                if name in registry and registry[name].detect().available:
                    (registry[name].prepare_own_process if self.prepared_for else registry[name].prepare)()
        except Exception:  # noqa: BLE001 - the load itself reports what is wrong
            log.debug("worker: preloading %s failed", engines, exc_info=True)
        log.debug("worker: plugins and %s preloaded in %.3f s", engines or "no engine", time.perf_counter() - t0)
        import_serving()

    async def op_bench(self, seconds: float, beat: float | None, *quiet_wait: float) -> dict[str, Any]:
        from octo.runtime.benchmark import micro_benchmark

        return await self._on_engine_thread(micro_benchmark, self.engine, seconds, beat, *quiet_wait)

    async def op_set_threads(self, n: int) -> None:
        await self._on_engine_thread(self.engine.set_threads, n)

    def op_serve(self, config: ServerConfig) -> None:
        if self.handle is not None:
            raise OctoError("worker: already serving")
        spec = self.spec
        self.handle = ModelHandle(spec["name"], (), self.engine.name, self.engine, spec["artifact"])
        self.handle.engine_thread = self.engine_thread
        counts = self.engine.thread_counts()  # the thread count selection chose comes first; [] when not tunable
        self.full_threads = counts[0] if counts and self.engine.threads_switch_while_serving else None
        self.handle.start(config, WorkerScheduler, outbox=self.outbox, gate=self.gate)
        self.handle.scheduler.watchdog.on_fault = self._fault
        self._beat = time.monotonic()
        self._heartbeat()
        threading.Thread(target=self._watch_loop, args=(max(LOOP_STUCK_S, config.queue_timeout),),
                         name="octo-loop-watch", daemon=True).start()
        # as the gateway does after its start-up: the model's Python objects (a tokenizer's vocabulary, ...) live as
        # long as the worker, so full collections need not walk them while the engine thread holds the GIL
        gc.collect()
        gc.freeze()

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()
        self.loop.call_later(0.25, self._heartbeat)

    def _watch_loop(self, limit: float) -> None:
        """(its own thread) This event loop runs the engine's chat template and tokenizer (``serving.prepare``) and
        delivers every request and cancellation: blocked past ``limit`` (the queue time-out), no request of the
        model can be admitted, answered or time out, so the worker goes as for a wedged engine thread."""
        step = min(1.0, limit / 10)
        late = 0  # checks in a row that found the loop late (twice: not a native call that held the GIL from us)
        while True:
            time.sleep(step)
            stuck = time.monotonic() - self._beat
            late = late + 1 if stuck > limit else 0
            if late >= 2:
                self._fault("wedged", f"the worker's event loop has been blocked for {stuck:.1f} s (in the engine's "
                            "tokenizer or chat template)")

    def _fault(self, state: str, reason: str) -> None:
        """The engine thread is wedged or dead (its requests got a 503): tell the gateway why, and exit, so that
        the gateway reloads the model in a fresh worker (a stuck native call cannot be interrupted)."""
        self.outbox.flush()
        self.sender.send(("fault", reason))
        log.error("worker: %s; exiting so the gateway reloads the model", reason)
        os._exit(FAULT_EXIT)

    async def op_call(self, op: str, payload: Any) -> Any:
        return await run_call(self.handle, op, payload)

    async def op_threads(self, n: int | None) -> int | None:
        """Compute with at most ``n`` threads (None: all it chose at start), switched between two steps: while
        several models are busy on few cores each takes its share instead of oversubscribing them."""
        full = getattr(self, "full_threads", None)
        if full is None or self.handle is None:
            return None
        target = full if n is None else max(1, min(n, full))
        await asyncio.wrap_future(self.handle.scheduler.run_between_steps(lambda: self.engine.set_threads(target)))
        return target

    def op_share_cores(self, on: bool) -> None:
        """Compute only when the gateway's arbiter grants the cores (several models loaded) or freely."""
        if self.gate is not None:
            self.gate.enabled = bool(on)

    async def op_prompt_texts(self, req: Any) -> list[str]:
        return await self.handle.prompt_texts(req)

    async def op_count_tokens(self, kind: str, req: Any) -> int:
        return await self.handle.count_tokens(kind, req)

    async def op_tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> dict[str, Any]:
        return await self.handle.tokenize(text, add_special, parse_special, with_pieces)

    async def op_detokenize(self, tokens: list[int]) -> str:
        return await self.handle.detokenize(tokens)

    def op_stats(self) -> dict[str, Any]:
        return local_stats(self.handle) if self.handle is not None else {"queue": None, "cache": None}

    async def op_stop(self) -> None:
        if self.handle is not None:
            await self.loop.run_in_executor(None, self.handle.stop)
        elif self.engine is not None:
            await self._on_engine_thread(self.engine.unload)
        self.loop.call_soon(self.closed.set)


_SERVING: list[threading.Thread] = []


def import_serving() -> None:
    """Import the serving layer (``octo.serving.openai``: the request models, pydantic) in a thread of its own, once:
    a worker needs it only to serve, so it is imported while the model loads (the native load leaves the GIL free)
    or once the worker waits prepared, not before the load can start."""
    if not _SERVING:
        _SERVING.append(threading.Thread(target=serving_api, name="octo-import", daemon=True))
        _SERVING[0].start()


def warm_up(engine: Engine) -> None:
    """Run the engine once right after its load, so a crash in its first computation happens now (where a
    fallback configuration can take over), not on the first request: a prompt of two tokens (a batch) and one
    decode step (a single token), the least that runs both kinds of step (as llama-server's warm-up of two tokens;
    8 tokens and 2 steps took 0.2 s of a 0.5B model's start on 2 cores, this 0.09 s)."""
    from octo.runtime.benchmark import bench_prompt, decode_steps, free_sequences, start_sequences

    tasks = engine.info.tasks or engine.tasks
    if tasks & {Task.CHAT, Task.COMPLETION}:
        seqs = start_sequences(engine, [900_100], [bench_prompt(engine, 2, 3)])
        try:
            decode_steps(engine, seqs, time.perf_counter() + 5.0, 1)
        finally:
            free_sequences(engine, seqs)
    elif Task.EMBEDDINGS in tasks:
        engine.embed(["warm up"])


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the gateway died before prctl took effect
        os._exit(1)


async def _main(down_fd: int, up_fd: int, arb_fd: int, beat: float) -> None:
    from octo.runtime.arbiter import ComputeGate

    loop = asyncio.get_running_loop()
    sender = ipc.BlockingSender(socket.socket(fileno=up_fd))
    ipc.start_heartbeat(sender, beat)
    worker = Worker(sender, loop, ComputeGate(socket.socket(fileno=arb_fd)))
    preload = os.environ.get(PRELOAD_ENV)
    if preload is not None:  # a load message that comes meanwhile waits for it on the engine thread
        loop.run_in_executor(worker.engine_thread, worker.preload, os.environ.get(PLUGINS_ENV) or None,
                             [e for e in preload.split(",") if e])
    await ipc.open_reader(socket.socket(fileno=down_fd), worker.on_message, lambda: os._exit(0))
    await worker.closed.wait()
    sender.send(("bye",))


def main() -> None:
    down_fd, up_fd, arb_fd, parent = (int(a) for a in sys.argv[1:5])
    beat = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway decides when we stop (drain first)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("OCTO_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s worker[{os.getpid()}] %(name)s: %(message)s")
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(_main(down_fd, up_fd, arb_fd, beat))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip native destructors at exit: the gateway is done with us


if __name__ == "__main__":
    main()
