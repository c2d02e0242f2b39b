"""What the scheduler queues: a generation request, its result, and the jobs (one sequence, or a call) that carry
them through the admission queue. The event-loop side (futures, event queues) lives on the job; the engine thread
fills in the sequence's text and finish."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octo.engine import MediaChunk, SamplingParams, Sequence
from octo.errors import OctoError
from octo.scheduler.events import END, Text
from octo.text.reasoning import ThinkSplitter
from octo.text.textstream import TextStream
from octo.text.toolcalls import ToolCallParser, parse_tool_calls

_ids = itertools.count(1)


@dataclass
class ToolSpec:
    """How to read tool calls out of a sequence's text: the template family's format and the offered functions."""

    format: Any  # octo.text.toolcalls.ToolFormat
    names: tuple[str, ...]
    single: bool = False  # parallel_tool_calls false: only the first call counts
    forced: bool = False  # tool_choice required / a named function: the output is a call (constrained)


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    grammar: Any = None  # octo.text.constrain.Grammar: every sequence's output must match it (a matcher per sequence)
    logprobs: int = -1  # >= 0: report each generated token's logprob and this many alternatives
    prompt_logprobs: int = -1  # >= 0: the same for every prompt token after the first (completions echo)
    tools: ToolSpec | None = None  # parse tool calls out of the output
    min_tokens: int = 0  # no end of sequence and no stop string before this many generated tokens
    ignore_eos: bool = False  # never end at an end-of-sequence token (max_tokens, a stop string or the context do)
    reasoning: bool = False  # split <think> text out of the answer (octo.text.reasoning)
    reasoning_opened: bool = False  # the prompt ends inside an opened <think> block
    # the prompt's media items (images) in position order; their positions in prompt_tokens hold placeholders
    # (octo.engine.media_token_ids): octo.scheduler.media encodes them and feeds them whole
    media: tuple[MediaChunk, ...] = ()


@dataclass
class Result:
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_ids: list[int]
    stop_sequence: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool_calls entries (``text`` is then the other content)
    logprobs: list[tuple[bytes, float, list[tuple[bytes, float]]]] | None = None  # per generated token
    prompt_logprobs: list[tuple[bytes, float | None, list[tuple[bytes, float]]]] | None = None  # per prompt token
    reasoning: str | None = None  # the <think> text, kept apart from ``text`` (GenerationRequest.reasoning)
    # measured on the engine thread: admission to the first generated token (the prompt's evaluation), and from
    # there to the end (Ollama's prompt_eval_duration and eval_duration)
    prompt_eval_s: float = 0.0
    eval_s: float = 0.0
    image_tokens: int = 0  # of prompt_tokens, the positions images take


class Job:
    """Common part of a queued sequence or call: admission future and deadline handling."""

    __slots__ = ("admitted", "state", "deadline", "error")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.admitted: asyncio.Future | None = None  # created by wait_admitted, for those who wait for it
        self.state = "pending"  # pending -> active -> done | expired | cancelled
        self.deadline = 0.0  # loop time after which a still-pending job gets a 504
        self.error: OctoError | None = None  # why a job that never ran was dropped (504, shutdown)


class Ticket(Job):
    """The event-loop side of one generated sequence."""

    __slots__ = ("id", "index", "req", "seq", "events", "result", "stream", "text", "n_prompt", "cached",
                 "finish", "hit_eos", "cancel_requested", "swap", "preemptions", "lead", "lead_n", "matcher", "parser",
                 "calls", "lps", "prompt_lps", "extra", "thinker", "reasoning", "t_admit", "t_first", "plain",
                 "stop_len", "min_len")

    def __init__(self, loop: asyncio.AbstractEventLoop, req: GenerationRequest, sampling: SamplingParams,
                 events: asyncio.Queue, index: int = 0) -> None:
        super().__init__(loop)
        self.id = next(_ids)
        self.index = index  # choice index within its request
        self.req = req
        self.seq = Sequence(self.id, list(req.prompt_tokens), sampling, media=req.media)
        self.n_prompt = len(req.prompt_tokens)
        # the stream's octo.scheduler.events (Text, ..., then Done or Failed); shared by the tickets of one request
        self.events = events
        self.result: asyncio.Future = loop.create_future()
        self.stream = TextStream(req.stop)
        self.text: list[str] = []  # engine-thread side: emitted pieces
        self.cached = 0
        self.finish: str | None = None
        self.hit_eos = False
        self.cancel_requested = False
        self.swap: Any = None  # the KVHandle of a sequence preempted in "swap" mode, until it resumes
        self.preemptions = 0
        self.lead: Ticket | None = None  # the running sequence computing a prefix this one waits to share
        self.lead_n = 0  # how many of its tokens it shares with the lead
        self.matcher = req.grammar.matcher() if req.grammar is not None else None  # octo.text.constrain.Matcher
        # streamed tool calls: an incremental parser (octo.text.toolcalls); whole results are parsed at the end
        live = bool(req.tools and req.tools.forced and self.matcher is not None)  # a constrained call: as written
        self.parser = ToolCallParser(req.tools.format, req.tools.names, live=live) if req.tools and req.stream else None
        self.calls: list[dict[str, Any]] | None = None  # tool calls found (streaming: as they complete)
        # reasoning models: <think> text goes apart (octo.text.reasoning), before the tool-call parser sees the rest
        self.thinker = ThinkSplitter(req.reasoning_opened) if req.reasoning else None
        self.reasoning: list[str] = []
        self.t_admit = 0.0  # perf_counter at admission, and at the first generated token (engine thread)
        self.t_first = 0.0
        self.lps: list | None = [] if req.logprobs >= 0 else None
        self.prompt_lps: list | None = [] if req.prompt_logprobs >= 0 else None
        # anything the engine step must be told beyond tokens (a mask, logprobs)
        self.extra = (self.matcher is not None or req.logprobs >= 0 or req.prompt_logprobs >= 0 or req.min_tokens > 0
                      or req.ignore_eos)
        # the per-token path's answers, worked out once: text goes straight out (no reasoning split, no tool-call
        # parser); the length at which max_tokens ends it; the length from which a stop string may end it
        self.plain = self.thinker is None and self.parser is None
        self.stop_len = self.n_prompt + req.max_tokens if req.max_tokens is not None else 1 << 62
        self.min_len = self.n_prompt + req.min_tokens

    def cancel(self) -> None:
        """Called from the event loop (client gone): the sequence leaves the batch at the next step."""
        self.cancel_requested = True

    async def deltas(self):
        """Text pieces as they are generated (streaming, one ticket per queue); ends when it finishes."""
        while True:
            ev = await self.events.get()
            if isinstance(ev, END):
                return
            if isinstance(ev, Text):
                yield ev.text

    def build_result(self) -> Result:
        gen = self.seq.tokens[self.n_prompt:len(self.seq.tokens) - self.hit_eos]
        text, calls = "".join(self.text), self.calls
        tools = self.req.tools
        if tools is not None and self.parser is None:  # not streamed: parse the whole text once
            parsed = parse_tool_calls(text, tools.format, tools.names, truncated=self.finish == "length")
            text, calls = parsed.content, parsed.tool_calls or None
            if calls and tools.single:
                calls = calls[:1]
        finish = self.finish or "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        now = time.perf_counter()
        first = self.t_first or now
        return Result(text, finish, self.n_prompt, len(gen), self.cached, gen, self.stream.matched, calls,
                      self.lps, self.prompt_lps, "".join(self.reasoning) if self.thinker is not None and self.reasoning
                      else None, first - (self.t_admit or first), now - first,
                      sum(c.n_tokens for c in self.req.media) if self.req.media else 0)


class Call(Job):
    __slots__ = ("fn", "future", "batch_key", "item", "gone")

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], batch_key: Any = None,
                 item: Any = None) -> None:
        super().__init__(loop)
        self.fn = fn
        self.future: asyncio.Future = loop.create_future()
        self.batch_key = batch_key  # calls with the same key queued together run as one fn(engine, items)
        self.item = item
        self.gone = False  # the client went away while it ran (an item with a ``cancelled`` field can poll it)
        if item is not None and hasattr(item, "cancelled") and item.cancelled is None:
            item.cancelled = self._gone  # TranscriptionRequest.cancelled: the engine stops between windows

    def _gone(self) -> bool:
        return self.gone
