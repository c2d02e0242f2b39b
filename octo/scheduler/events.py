"""The events of a generation request, one vocabulary from the engine loop through the worker's wire to SSE.

The engine loop (``octo.scheduler.engine_loop``, ``octo.scheduler.emission``) posts them to a request's event queue as
it goes; in a worker
process (``octo.runtime.worker``) or a cluster replica (``octo.cluster.replica``) that queue is a wire queue that
sends them
to the gateway as compact tuples (:func:`encode`), where ``octo.handles`` decodes them (:data:`DECODE`) into the same
objects; the route handlers (``octo.server.routes.openai``, ``octo.server.routes.responses``,
``octo.server.routes.anthropic``) turn them into SSE. So a
placement (in process, worker, cluster) can never change what a stream carries: every kind goes everywhere.

A streamed sequence's queue receives, in order: :class:`Cached` (first, when its prompt was restored from the prefix
cache), any number of :class:`Text`, :class:`Reasoning`, :class:`ToolDelta` and :class:`Logprob` (a token's logprobs
come before the text they belong to), and one end: :class:`Done` or :class:`Failed`. :class:`Admitted` only crosses
the wire (in process, admission resolves the ticket's future): the prompt is admitted to the batch.

Every event is ``index`` (the sequence's choice index) and one value; on the wire ``(rid, code, index, value)``,
``rid`` being the request's number on that wire and ``code`` the event's position in :data:`DECODE`. Index -1 on a
:class:`Failed` means every sequence of the request (refused before it was queued).

The classes are slotted dataclasses but not frozen: a frozen dataclass's ``__init__`` costs about 2.5 times as much
(``object.__setattr__`` per field), and the gateway constructs one per token of every stream. Treat them as values.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from octo.errors import OctoError
    from octo.scheduler.jobs import Result


@dataclass(slots=True)
class Text:
    """A piece of the answer's text (content)."""

    index: int
    text: str
    code: ClassVar[int] = 0


@dataclass(slots=True)
class Reasoning:
    """A piece of the model's reasoning (``<think>`` text; ``reasoning_content``, Anthropic ``thinking``)."""

    index: int
    text: str
    code: ClassVar[int] = 1


@dataclass(slots=True)
class ToolDelta:
    """A tool-call delta in Chat Completions' shape: ``{"tool_calls": [{"index", "id"?, "function": {...}}]}``."""

    index: int
    delta: dict[str, Any]
    code: ClassVar[int] = 2


@dataclass(slots=True)
class Logprob:
    """One sampled token's logprobs: ``(token bytes, logprob, [(bytes, logprob), ...])`` (top alternatives)."""

    index: int
    entry: tuple
    code: ClassVar[int] = 3


@dataclass(slots=True)
class Cached:
    """Prompt tokens restored from the prefix cache (before any text; Anthropic's ``cache_read_input_tokens``)."""

    index: int
    tokens: int
    code: ClassVar[int] = 4


@dataclass(slots=True)
class Admitted:
    """(wire only) The sequence entered the batch with this many prompt tokens."""

    index: int
    prompt_tokens: int
    code: ClassVar[int] = 5


@dataclass(slots=True)
class Done:
    """The sequence finished: its whole result (text, usage, finish reason, ...)."""

    index: int
    result: Result
    code: ClassVar[int] = 6


@dataclass(slots=True)
class Failed:
    """The sequence failed: the error its stream reports (index -1 on the wire: every sequence of the request)."""

    index: int
    error: OctoError
    code: ClassVar[int] = 7


Event = Text | Reasoning | ToolDelta | Logprob | Cached | Admitted | Done | Failed
END = (Done, Failed)  # the last event of a sequence
DECODE: tuple[type, ...] = (Text, Reasoning, ToolDelta, Logprob, Cached, Admitted, Done, Failed)
STREAM_CODES = 5  # codes below this are stream events (they go to the request's queue as they are)
ADMITTED, DONE, FAILED = Admitted.code, Done.code, Failed.code
assert all(cls.code == i for i, cls in enumerate(DECODE))


def encode(rid: int, ev: Event) -> tuple[int, int, int, Any]:
    """The wire form of ``ev`` for request ``rid``: a plain tuple (pickled at C speed, a few bytes per event)."""
    return rid, ev.code, ev.index, _VALUE[ev.code](ev)


def decode(item: tuple[int, int, int, Any]) -> tuple[int, Event]:
    """``(rid, event)`` of a wire tuple made by :func:`encode`."""
    rid, code, index, value = item
    return rid, DECODE[code](index, value)


def is_end(ev: Event) -> bool:
    return ev.code >= DONE


# the one value field of each event, by code (what ``encode`` puts on the wire next to the index)
_VALUE = tuple(attrgetter(fields(cls)[1].name) for cls in DECODE)
