"""The typed seams without a server: the event vocabulary's wire codec, the worker's wire queue and result futures
feeding the gateway's forwarding handle (the events the routes read are the ones the engine loop posted, kind by
kind), and the three model handles against the ``Handle`` protocol."""

from __future__ import annotations

import asyncio
import inspect
import pickle

import pytest

from octo.errors import EngineError, InvalidRequest
from octo.runtime import ipc
from octo.runtime.handle import Forwarder, Handle, WireTicket
from octo.scheduler import events as ev
from octo.scheduler.jobs import Result

RESULT = Result("then I answer", "stop", 7, 3, 2, [5, 6, 7])
ENTRY = (b"tok", -0.5, [(b"tok", -0.5), (b"tik", -1.25)])
DELTA = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]}
STREAM = [ev.Cached(0, 4), ev.Reasoning(0, "first I plan "), ev.Text(0, "then"), ev.Logprob(0, ENTRY),
          ev.Text(0, " I answer"), ev.ToolDelta(0, DELTA)]


def test_every_event_round_trips_through_the_wire_codec():
    samples = [*STREAM, ev.Admitted(1, 7), ev.Done(0, RESULT), ev.Failed(-1, InvalidRequest("no", param="x"))]
    assert {type(e) for e in samples} == set(ev.DECODE)
    for e in samples:
        item = pickle.loads(ipc.frame(ev.encode(9, e))[4:])
        assert type(item) is tuple and len(item) == 4
        rid, back = ev.decode(item)
        assert rid == 9 and type(back) is type(e) and back.index == e.index
        if isinstance(e, ev.Failed):
            assert type(back.error) is InvalidRequest and back.error.param == "x"
        else:
            assert back == e
    assert [ev.is_end(e) for e in samples] == [False] * 7 + [True, True]


class _Sender:
    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.messages: list = []

    def send_locked(self, msg: tuple) -> None:
        self.messages.append(pickle.loads(ipc.frame(msg)[4:]))

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.send_locked(msg)


class _Gateway(Forwarder):
    isolation = "test"

    def __init__(self) -> None:
        self._requests = {}


def _through_the_wire(posted: list, end: ev.Done | ev.Failed, admitted: bool = True):
    """Post ``posted`` (and the end) as a worker's engine loop does; what the gateway's handle gives its route."""
    from octo.runtime import worker

    async def go():
        loop = asyncio.get_running_loop()
        sender = _Sender()
        outbox = worker.Outbox(sender, loop)
        queue = worker.WireQueue(outbox, 5)

        class T:  # what WireFuture reads of a ticket
            n_prompt = 7

        result = worker.WireFuture(outbox, 5, 0, False, T())
        admission = worker.WireFuture(outbox, 5, 0, True, T())
        if admitted:
            admission.set_result(None)
        for e in posted:
            queue.put_nowait(e)
        queue.put_nowait(end)  # the end goes up once, from the result future
        if isinstance(end, ev.Done):
            result.set_result(end.result)
        else:
            result.set_exception(end.error)
        outbox.flush()
        gateway = _Gateway()
        tickets = [WireTicket(loop, 5, 0)]
        events = gateway.open_request(5, tickets, True)
        for msg in sender.messages:
            assert msg[0] == "ev"
            gateway.on_wire(msg[1])
        got = [events.get_nowait() for _ in range(events.qsize())]
        return got, tickets[0], gateway

    return asyncio.run(go())


def test_the_gateway_reads_what_the_engine_loop_posted():
    got, ticket, gateway = _through_the_wire(STREAM, ev.Done(0, RESULT))
    assert got == [*STREAM, ev.Done(0, RESULT)]  # reasoning included: it was dropped on the wire before
    assert ticket.state == "done" and ticket.n_prompt == RESULT.prompt_tokens and ticket.result.result() == RESULT
    assert gateway._requests == {}


def test_a_failure_after_admission_streams_its_error():
    err = EngineError("the step failed")
    got, ticket, _ = _through_the_wire([ev.Text(0, "one")], ev.Failed(0, err))
    assert [type(e) for e in got] == [ev.Text, ev.Failed] and got[1].error.message == err.message
    assert ticket.state == "failed" and ticket.started
    asyncio.run(_Gateway().wait_admitted([ticket]))  # admitted: the route streams the error event


def test_a_refused_request_fails_its_admission():
    err = InvalidRequest("bad", param="messages")
    got, ticket, _ = _through_the_wire([], ev.Failed(0, err), admitted=False)
    assert [type(e) for e in got] == [ev.Failed] and not ticket.started
    with pytest.raises(InvalidRequest):
        asyncio.run(_Gateway().wait_admitted([ticket]))


def _surface() -> dict[str, bool]:
    """The Handle protocol's methods and properties: name -> whether it is a coroutine function."""
    out = {}
    for name, value in vars(Handle).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out[name] = False
        elif inspect.isfunction(value):
            out[name] = inspect.iscoroutinefunction(value)
    return out


def test_the_three_handles_implement_the_protocol():
    from octo.cluster.deploy import ClusterHandle
    from octo.runtime.model import ModelHandle
    from octo.runtime.remote import RemoteHandle

    surface = _surface()
    assert {"submit", "wait_admitted", "abandon", "call", "count_tokens", "tokenize", "stats", "ensure_ready"} <= set(
        surface)
    for cls in (ModelHandle, RemoteHandle, ClusterHandle):
        for name, is_async in surface.items():
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
            attr = inspect.getattr_static(cls, name)
            if not isinstance(attr, property):
                assert inspect.iscoroutinefunction(getattr(cls, name)) == is_async, f"{cls.__name__}.{name}"
    # the worker and cluster handles share one forwarding implementation instead of repeating it
    for name in ("on_wire", "wait_admitted", "abandon", "call", "prompt_texts", "count_tokens", "tokenize",
                 "detokenize"):
        assert getattr(RemoteHandle, name) is getattr(ClusterHandle, name) is getattr(Forwarder, name), name
