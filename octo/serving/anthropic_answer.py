"""The answer of an Anthropic Messages request, shaped from generation results (gateway side, no aiohttp).

Results become content blocks (:func:`response`): ``thinking`` (the ``Result.reasoning`` of a model that reasons,
when the request enables thinking; split where the model runs), ``text`` (only when not empty), then ``tool_use``; an
empty answer is one empty text block. A call of the server-side tool search is a ``server_tool_use`` block, followed
by its ``tool_search_tool_result`` (:class:`Turn`: the route runs the search and the generation goes on). A stream's
events become Anthropic's block events (:class:`StreamBlocks`), numbered in order of appearance.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those that were (their sum is what ``count_tokens`` reports); an answer made of several
model calls (a server-side search) counts each call's, as Anthropic's API counts server-tool iterations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic_core import from_json

from octo.protocol.anthropic import AnthropicMessage, AnthropicRequest, ToolSearchTool
from octo.scheduler.jobs import Result
from octo.serving.anthropic import thinking_enabled, tool_use_id
from octo.serving.anthropic_tools import MAX_SEARCHES, deferred_catalog, run_search
from octo.text import toolsearch

_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
_CALLS = ("tool_use", "server_tool_use")


@dataclass(frozen=True)
class Options:
    """What shapes the answer's blocks, from the request."""

    thinking: bool = False  # the request enables thinking (the blocks come from Result.reasoning / Reasoning events)
    omit_thinking: bool = False  # thinking.display "omitted": the blocks are there, their text is not
    max_tokens: int = 0  # as requested: a "length" end before it is the context window's end
    search: str | None = None  # the name of the server-side tool search the model may call (it runs here)

    @classmethod
    def of(cls, req: AnthropicRequest) -> Options:
        th = req.thinking
        tool = search_tool(req)
        runs = tool is not None and (tool.variant != "regex" or toolsearch.regex_available())
        return cls(thinking_enabled(req), bool(th is not None and th.display == "omitted"), req.max_tokens,
                   tool.name if runs else None)


def search_tool(req: Any) -> ToolSearchTool | None:
    return next((t for t in req.tools or [] if isinstance(t, ToolSearchTool)), None)


def stop_reason(result: Result, opts: Options = Options()) -> tuple[str, str | None]:
    if result.tool_calls and result.finish_reason in ("tool_calls", "stop"):
        return "tool_use", None
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    if result.finish_reason == "length" and result.completion_tokens < opts.max_tokens:
        return "model_context_window_exceeded", None
    return _STOP.get(result.finish_reason, "end_turn"), None


def usage(result: Result) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": result.cached_tokens}


def tool_use_block(call: dict[str, Any], search: str | None = None) -> dict[str, Any]:
    """The call's ``tool_use`` block (``server_tool_use`` for the tool search); its ``input`` is the arguments' text
    as the model wrote it (an orjson Fragment: numbers keep their digits, nothing is parsed and re-serialised),
    ``{}`` where it is not an object."""
    text = call["function"]["arguments"] or "{}"
    try:
        value: Any = orjson.Fragment(text) if isinstance(orjson.loads(text), dict) else {}
    except orjson.JSONDecodeError:  # a call cut off by max_tokens: what its arguments hold so far
        value = _partial_object(text)
    name = call["function"]["name"]
    if search is not None and name == search:
        return {"type": "server_tool_use", "id": server_tool_use_id(call["id"]), "name": name, "input": value}
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": name, "input": value}


def server_tool_use_id(call_id: str) -> str:
    return "srvtoolu_" + tool_use_id(call_id).removeprefix("toolu_")


def _partial_object(text: str) -> dict[str, Any]:
    try:
        value = from_json(text, allow_partial="trailing-strings", allow_inf_nan=False)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(result: Result, opts: Options, answered: bool = False) -> list[dict[str, Any]]:
    """The blocks of one model call (``answered``: an earlier call of the same answer already had text or calls)."""
    blocks: list[dict[str, Any]] = []
    if opts.thinking and result.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": "" if opts.omit_thinking else result.reasoning,
                       "signature": ""})
    calls = result.tool_calls or []  # disable_parallel_tool_use: the scheduler kept the first call only
    if result.text or not (calls or answered):
        blocks.append({"type": "text", "text": result.text})
    return blocks + [tool_use_block(c, opts.search) for c in calls]


def response(mid: str, model: str, result: Result, opts: Options = Options(),
             turn: Turn | None = None) -> dict[str, Any]:
    """The message of a result (``turn``: of the several model calls of an answer with server-side searches)."""
    reason, seq = stop_reason(result, opts)
    if turn is None:
        return {"id": mid, "type": "message", "role": "assistant", "model": model,
                "content": content_blocks(result, opts), "stop_reason": reason, "stop_sequence": seq,
                "usage": usage(result)}
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": turn.content,
            "stop_reason": "pause_turn" if turn.paused else reason, "stop_sequence": seq, "usage": turn.usage}


# -- one answer across the model calls of a server-side search -------------------------------------------------
@dataclass
class Turn:
    """One answer made of several model calls: each call's blocks and the search results between them, with the usage
    summed. :meth:`add` records a call's result; when its only calls are searches, the route runs them
    (:meth:`searched`, off the event loop) and, unless :attr:`paused`, generates on from :meth:`follow_up`."""

    req: AnthropicRequest
    opts: Options
    content: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0,
                                                           "cache_creation_input_tokens": 0,
                                                           "cache_read_input_tokens": 0})
    searches: int = 0

    @property
    def paused(self) -> bool:
        """The answer ran its searches and ends here (stop_reason ``pause_turn``: sent back, it goes on)."""
        return self.searches >= MAX_SEARCHES

    def add(self, result: Result, blocks: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Record one model call; the search calls to run before the answer goes on (none: it is complete)."""
        if blocks is None:
            blocks = content_blocks(result, self.opts, answered=bool(self.content))
        for key, value in usage(result).items():
            self.usage[key] += value
        self.content += blocks
        calls = [b for b in blocks if b["type"] in _CALLS]
        if not calls or any(b["type"] != "server_tool_use" for b in calls) or result.finish_reason == "length":
            return []
        return calls

    def searched(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the searches ``calls`` ask for: their ``tool_search_tool_result`` blocks, added to the answer."""
        tool = search_tool(self.req)
        catalog = deferred_catalog(self.req.tools)
        out = []
        for call in calls:
            self.searches += 1
            content = run_search(tool, catalog, orjson.loads(orjson.dumps(call["input"])))
            out.append({"type": "tool_search_tool_result", "tool_use_id": call["id"], "content": content})
        self.content += out
        return out

    def follow_up(self) -> AnthropicRequest | None:
        """The request that generates on from the answer so far (None when paused)."""
        if self.paused:
            return None
        blocks = [{**b, "input": orjson.loads(orjson.dumps(b["input"]))} if b["type"] in _CALLS else b
                  for b in self.content if b["type"] != "text" or b["text"]]
        turn = AnthropicMessage.model_validate({"role": "assistant", "content": blocks})
        return self.req.model_copy(update={"messages": [*self.req.messages, turn]})


# -- streaming ------------------------------------------------------------------------------------------------------
Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


def message_start(mid: str, model: str, n_prompt: int, cached: int) -> Event:
    return "message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": n_prompt - cached, "output_tokens": 0,
                                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}}}


class StreamBlocks:
    """The events of one streamed message's content blocks: numbered in order of appearance, ``thinking`` from the
    sequence's Reasoning events, a text block only when there is text (an empty answer still gets one), each tool call
    a ``tool_use`` block (``server_tool_use`` for the tool search) whose input arrives as ``input_json_delta``
    fragments. With a server-side search, :attr:`turn` gathers the answer across its model calls and
    :attr:`pending` holds the searches to run before it goes on."""

    def __init__(self, opts: Options, req: AnthropicRequest | None = None) -> None:
        self.opts = opts
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.answered = False  # a text or tool_use block was opened
        self.turn = Turn(req, opts) if req is not None and opts.search is not None else None
        self.pending: list[dict[str, Any]] = []
        self.last: Result | None = None  # the last model call's result

    def _start(self, block: dict[str, Any]) -> list[Event]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        self.answered = self.answered or block["type"] != "thinking"
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def thinking(self, text: str) -> list[Event]:
        """A piece of the model's reasoning (a Reasoning event)."""
        if not text:
            return []
        out = self._start({"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        if not self.opts.omit_thinking:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        out = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def tool(self, delta: dict[str, Any]) -> list[Event]:
        """A Chat Completions tool-call delta (octo.scheduler.emission): a new call opens a tool_use block."""
        out: list[Event] = []
        for tc in delta.get("tool_calls", []):
            fn = tc.get("function") or {}
            if tc.get("id"):
                name = fn.get("name", "")
                block = tool_use_block({"id": tc["id"], "function": {"name": name, "arguments": "{}"}},
                                       self.opts.search)
                out += self._start({**block, "input": {}})
            if fn.get("arguments") and self.open in _CALLS:
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def finish(self, result: Result) -> list[Event]:
        """A model call ends: the message ends too, unless it called the tool search only (:attr:`pending`)."""
        self.last = result
        if self.turn is not None:
            self.pending = self.turn.add(result)
            if self.pending:
                return self._stop()
        if not self.answered:
            out = self._start({"type": "text", "text": ""})
        else:
            out = []
        return out + self._stop() + self.end(result)

    def searched(self, results: list[dict[str, Any]]) -> list[Event]:
        """The ``tool_search_tool_result`` blocks of the searches :attr:`pending` asked for (the route ran them)."""
        self.pending = []
        out: list[Event] = []
        for block in results:
            out += self._start(block) + self._stop()
        return out

    def end(self, result: Result | None = None) -> list[Event]:
        """The message's end (``result``: of its last model call, by default the one :meth:`finish` saw)."""
        result = result if result is not None else self.last
        reason, seq = stop_reason(result, self.opts)
        total = usage(result)
        if self.turn is not None:
            total = self.turn.usage
            reason = "pause_turn" if self.turn.paused else reason
        return [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": total}),
                ("message_stop", {"type": "message_stop"})]
