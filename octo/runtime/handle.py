"""The model-handle seam: what the gateway's routes, registry and dashboard use of a loaded model, wherever it runs.

:class:`Handle` is the surface as a ``typing.Protocol``. Three classes implement it:

- ``octo.runtime.model.ModelHandle``: the model in this process (``--isolation thread``, and inside every worker and
replica);
- ``octo.runtime.remote.RemoteHandle``: the model in an engine worker process (``--isolation process``);
- ``octo.cluster.deploy.ClusterHandle``: the model's replicas on a Ray Serve deployment (``--cluster ray``).

The last two share :class:`Forwarder`: the gateway's half of a request whose sequences run elsewhere (its tickets,
the wire events decoded into ``octo.scheduler.events`` objects, admission, results, failure of every sequence at once)
and the
operations forwarded as they are (``call``, ``prompt_texts``, ``count_tokens``, ``tokenize``, ``detokenize``). A
subclass says only how a request and an operation travel (``_op``, ``_cancel``, its ``submit``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

from octo.config import ServerConfig
from octo.engine import ModelInfo, Task
from octo.errors import OctoError
from octo.scheduler.events import ADMITTED, DECODE, STREAM_CODES, Done, Failed


class HandleInfo:
    """What every handle derives from its name, aliases, engine and ModelInfo (shared by both kinds)."""

    name: str
    aliases: tuple[str, ...]
    engine_name: str
    engine_version: str | None = None  # as the engine's process reported it (None: the class says, importing it)

    @property
    def tasks(self) -> frozenset[Task]:
        return self.info.tasks or self.engine_cls.tasks

    @property
    def task(self) -> str:
        """The main task: "transcription", "embeddings" or "chat"."""
        for t in (Task.TRANSCRIPTION, Task.CHAT, Task.EMBEDDINGS):
            if t in self.tasks:
                return t.value
        return next(iter(self.tasks)).value

    @functools.cached_property
    def fingerprint(self) -> str:
        return f"octo-{self.engine_name}-{self.engine_version or self.engine_cls.version()}"

    def matches(self, model: str | None) -> bool:
        """Whether a request's ``model`` field names this model (absent means the served one)."""
        if not model or model == self.name or model in self.aliases:
            return True
        # OpenAI clients name their hosted models; accept those names for the matching task
        return model == "whisper-1" and self.task == "transcription"


class TicketView(Protocol):
    """What the routes read of one sequence of a request (``octo.scheduler.jobs.Ticket`` in process,
    :class:`WireTicket`)."""

    index: int
    state: str  # pending -> active -> done | failed | cancelled
    n_prompt: int
    result: Awaitable[Any]  # the sequence's Result, or its OctoError raised


@runtime_checkable
class Handle(Protocol):
    """One loaded model as the gateway sees it (the in-process, worker and cluster handles)."""

    name: str
    aliases: tuple[str, ...]
    engine_name: str
    isolation: str  # "thread" | "process" | "cluster"
    info: ModelInfo
    selection: dict[str, Any]  # how the engine was chosen (/v1/engines)
    benchmarks: dict[str, Any]
    fingerprint: str
    state: str  # "ready", or why not ("loading", "crashed", "failed", "wedged", "stopped")
    reason: str | None  # why not ready

    @property
    def task(self) -> str: ...

    def matches(self, model: str | None) -> bool: ...

    async def activate(self, config: ServerConfig) -> None: ...

    async def close(self) -> None: ...

    async def ensure_ready(self) -> None:
        """Raise the model's 503 now when it cannot serve (a worker that crashed is restarted here)."""

    async def submit(self, kind: str, req: Any, size: int = 0) -> tuple[list[Any], asyncio.Queue | None]:
        """Queue the sequences of a "chat", "completion" or "messages" request: its tickets (``TicketView``) and,
        streamed, the queue of its ``octo.scheduler.events`` (each sequence ends with ``Done`` or ``Failed``)."""

    async def wait_admitted(self, tickets: list[Any]) -> None: ...

    def abandon(self, tickets: list[Any]) -> None:
        """The client went away (or the route is done): sequences still queued or running leave the batch."""

    async def call(self, op: str, payload: Any) -> Any:
        """"embed" or "transcribe", through the model's admission queue."""

    async def prompt_texts(self, req: Any) -> list[str]: ...

    async def count_tokens(self, kind: str, req: Any) -> int: ...

    async def tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> dict[str, Any]:
        ...

    async def detokenize(self, tokens: list[int]) -> str: ...

    async def stats(self) -> dict[str, Any]:
        """{"queue": ..., "cache": ...} (/v1/queue/stats)."""


class WireTicket:
    """The gateway's view of one sequence running in a worker or replica (what the routes read of a Ticket)."""

    __slots__ = ("rid", "index", "result", "admitted", "state", "error", "n_prompt", "started")

    def __init__(self, loop: asyncio.AbstractEventLoop, rid: int, index: int) -> None:
        self.rid = rid
        self.index = index
        self.result: asyncio.Future = loop.create_future()
        self.admitted: asyncio.Future | None = None
        self.state = "pending"  # pending -> active -> done | failed | cancelled
        self.error: OctoError | None = None
        self.n_prompt = 0
        self.started = False  # admitted to the batch (a failure after it is the stream's, not the admission's)


class Pending:
    """A request whose sequences run elsewhere: its tickets, its event queue (streamed) and results still due."""

    __slots__ = ("tickets", "events", "remaining", "stream", "since")

    def __init__(self, tickets: list[WireTicket], events: asyncio.Queue | None, stream: bool) -> None:
        self.tickets, self.events, self.remaining, self.stream = tickets, events, len(tickets), stream
        self.since = time.monotonic()  # the gateway's own queue deadline counts from here (octo.runtime.remote)


class Forwarder(HandleInfo):
    """The gateway side shared by the worker and the cluster handle (see the module's doc)."""

    _requests: dict[int, Pending]

    def open_request(self, rid: int, tickets: list[WireTicket], stream: bool) -> asyncio.Queue | None:
        """Track request ``rid`` until each of its sequences has its result; its event queue when streamed."""
        events = asyncio.Queue() if stream else None
        self._requests[rid] = Pending(tickets, events, stream)
        return events

    def on_wire(self, items: list[tuple[int, int, int, Any]]) -> None:
        """Wire events (``octo.scheduler.events.encode``) of this handle's requests, in order."""
        requests, decode, stream_codes = self._requests, DECODE, STREAM_CODES  # (locals: this runs per token)
        for rid, code, index, value in items:
            req = requests.get(rid)
            if req is None:
                continue  # abandoned by its client
            if code < stream_codes:
                req.events.put_nowait(decode[code](index, value))
            elif code == ADMITTED:
                t = req.tickets[index]
                t.n_prompt, t.started = value, True
                if t.state == "pending":
                    t.state = "active"
                if t.admitted is not None and not t.admitted.done():
                    t.admitted.set_result(None)
            elif index < 0:
                self.fail_request(rid, value)
            else:
                self._finish(req, req.tickets[index], DECODE[code](index, value))
                if req.remaining == 0:
                    del requests[rid]

    def _finish(self, req: Pending, t: WireTicket, ev: Done | Failed) -> None:
        if t.state in ("done", "failed"):
            return
        req.remaining -= 1
        if isinstance(ev, Done):
            t.state = "done"
            t.n_prompt = ev.result.prompt_tokens
            _settle(t.result, ev.result, None)
            if t.admitted is not None:
                _settle(t.admitted, None, None)
        else:
            t.state, t.error = "failed", ev.error
            _settle(t.result, None, ev.error)
            if t.admitted is not None:
                _settle(t.admitted, None, ev.error)
        if req.stream:
            req.events.put_nowait(ev)

    def fail_request(self, rid: int, err: OctoError) -> None:
        """End every sequence of request ``rid`` with ``err`` (its worker or replica is gone, or refused it)."""
        req = self._requests.pop(rid, None)
        if req is not None:
            for t in req.tickets:
                self._finish(req, t, Failed(t.index, err))

    def fail_all(self, err: OctoError) -> None:
        for rid in list(self._requests):
            self.fail_request(rid, err)

    async def wait_admitted(self, tickets: list[WireTicket]) -> None:
        loop = asyncio.get_running_loop()
        for t in tickets:
            if t.state == "pending":
                t.admitted = t.admitted or loop.create_future()
                await t.admitted
            if t.error is not None and t.state == "failed" and not t.started:
                raise t.error  # refused or failed in the queue (one admitted streams its error as an event)

    def abandon(self, tickets: list[WireTicket]) -> None:
        if tickets and any(t.state in ("pending", "active") for t in tickets):
            rid = tickets[0].rid
            self._cancel(rid, self._requests.pop(rid, None) is not None)
            for t in tickets:
                if t.state in ("pending", "active"):
                    t.state = "cancelled"

    def _cancel(self, rid: int, tracked: bool) -> None:
        """Stop request ``rid`` where it runs (``tracked``: its results were still due)."""
        raise NotImplementedError

    async def _op(self, name: str, *args: Any) -> Any:
        """Run the model operation ``name`` where the model runs; its value, or its OctoError raised."""
        raise NotImplementedError

    async def call(self, op: str, payload: Any) -> Any:
        return await self._op("call", op, payload)

    async def prompt_texts(self, req: Any) -> list[str]:
        return await self._op("prompt_texts", req)

    async def count_tokens(self, kind: str, req: Any) -> int:
        return await self._op("count_tokens", kind, req)

    async def tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> dict[str, Any]:
        return await self._op("tokenize", text, add_special, parse_special, with_pieces)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self._op("detokenize", tokens)


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(value)
    else:
        fut.set_exception(exc)
        fut.add_done_callback(consume_exception)  # nobody may await it (a stream reads the error from its events)


def consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()

