"""What the engine loop does with each sampled token beyond the text itself: :class:`Emission`, a part of
:class:`octo.scheduler.engine_loop.EngineLoop` (engine thread), given the engine; it appends what it emits to the
loop's list of posts (``(function, target, value)`` triples the event loop runs).

- **Constraints** (``GenerationRequest.grammar``): before a step, a constrained sequence's feed carries its matcher's
  allowed-token bitmask (``Feed.mask``, applied by the engine before sampling); after it, the matcher accepts the
  token, and the sequence finishes as soon as nothing but the end of output can follow. The same layer serves JSON
  schemas, ``json_object`` and tool calls on every engine that declares ``supports_masks``.
- **Logprobs**: the feed asks for them (``Feed.logprobs`` / ``Feed.prompt_logprobs``); the engine's answer is kept per
  token as ``(token bytes, logprob, [(bytes, logprob), ...])`` and streamed as ``octo.scheduler.events.Logprob`` events.
- **Tool calls**: a streamed sequence whose request offers tools runs its text through an incremental
  :class:`octo.text.toolcalls.ToolCallParser`: content goes out as ``Text`` events, calls as ``ToolDelta`` events
  in Chat Completions' delta shape (a non-streamed one is parsed once at the end, ``Ticket._result``).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from octo.engine import Feed
from octo.errors import EngineError
from octo.scheduler.events import Logprob, Reasoning, Text, ToolDelta
from octo.scheduler.jobs import Ticket
from octo.text.toolcalls import ContentDelta, ToolCallArguments, ToolCallStart, to_openai_delta

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)


def _clamp(lp: float) -> float:
    return lp if lp > LOWEST_LOGPROB else LOWEST_LOGPROB


class Emission:
    """Masks, logprobs, reasoning, text and tool-call events of the running sequences."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._no_eos_row: np.ndarray | None = None  # the mask that forbids only the end of sequence (built once)

    def dress(self, f: Feed, t: Ticket) -> None:
        """Tell the engine what ``t`` needs from this step beyond its tokens."""
        if f.sample:
            if t.matcher is not None:
                f.mask = t.matcher.bitmask()
            if t.lps is not None:
                f.logprobs = t.req.logprobs
            if t.req.ignore_eos or (t.req.min_tokens and len(t.seq.tokens) - t.n_prompt < t.req.min_tokens):
                self._forbid_end(f)
        if t.prompt_lps is not None and t.seq.n_cached < t.n_prompt:
            f.prompt_logprobs = t.req.prompt_logprobs

    def _forbid_end(self, f: Feed) -> None:
        """``min_tokens`` not reached, or ``ignore_eos``: the sequence may not end at this step. Engines with masks get
        the end-of-sequence bits cleared (a constraint whose grammar allows nothing but the end keeps its mask: it has
        the last word), the others ``Feed.no_eos``."""
        import numpy as np
        eng = self.engine
        if not eng.supports_masks:
            f.no_eos = True
            return
        row = self._no_eos_row
        if row is None:
            info = eng.info
            row = np.full((info.n_vocab + 31) // 32, -1, dtype=np.int32)
            bits = row.view(np.uint32)
            for e in info.eos_token_ids:
                if 0 <= e < info.n_vocab:
                    bits[e >> 5] &= np.uint32(~(1 << (e & 31)) & 0xFFFFFFFF)
            self._no_eos_row = row
        if f.mask is None:
            f.mask = row
            return
        both = np.bitwise_and(f.mask, row)
        if both.any():
            f.mask = both

    def prompt_logprobs(self, f: Feed, t: Ticket) -> None:
        """Keep the prompt-token logprobs the engine reported for this feed's positions (once each: a recomputed
        prompt reports them again)."""
        out = f.prompt_out
        if not out or t.prompt_lps is None:
            return
        tb, tokens, lps = self.engine.token_bytes, t.seq.tokens, t.prompt_lps
        if not lps:
            lps.append((tb(tokens[0]), None, []))  # the first token has no logprob (nothing before it)
        first = t.seq.n_cached - len(f.tokens)  # position of the feed's first token
        for j, (lp, top) in enumerate(out):
            pos = first + j + 1  # the token this entry predicts
            if pos == len(lps) and pos < t.n_prompt:
                lps.append((tb(tokens[pos]), _clamp(lp), [(tb(a), _clamp(b)) for a, b in top]))

    def accept(self, f: Feed, t: Ticket, tok: int, eos: frozenset, posts: list) -> EngineError | None:
        """Constraint and logprobs of a sampled token; the error the sequence fails with when its constraint forbids
        the token."""
        m = t.matcher
        if m is not None and not m.accept(tok):
            return EngineError(f"The {self.engine.name} engine sampled token {tok}, which the output constraint "
                               f"forbids ({m.error or 'not in the allowed set'}).")
        if t.lps is not None and tok not in eos and f.logprob is not None:
            lp, top = f.logprob
            tb = self.engine.token_bytes
            entry = (tb(tok), _clamp(lp), [(tb(a), _clamp(b)) for a, b in top])
            t.lps.append(entry)
            if t.req.stream:
                posts.append((put_event, t.events, Logprob(t.index, entry)))
        return None

    def emit(self, t: Ticket, piece: str, posts: list) -> None:
        """Output text of ``t``: its reasoning apart (``Ticket.thinker``), the rest to its text and stream, through its
        tool-call parser when it has one."""
        if t.thinker is not None:
            self._split(t, t.thinker.feed(piece), posts)
            return
        self._answer(t, piece, posts)

    def _split(self, t: Ticket, pieces: list[tuple[str, str]], posts: list) -> None:
        for kind, text in pieces:
            if kind == "thinking":
                t.reasoning.append(text)
                if t.req.stream:
                    posts.append((put_event, t.events, Reasoning(t.index, text)))
            elif text:
                self._answer(t, text, posts)

    def _answer(self, t: Ticket, piece: str, posts: list) -> None:
        # (EngineLoop._take does the same inline for a ticket without thinker and parser, the common case: keep alike)
        if t.parser is None:
            t.text.append(piece)
            if t.req.stream:
                posts.append((put_event, t.events, Text(t.index, piece)))
            return
        self._events(t, t.parser.feed(piece), posts)

    def end_output(self, t: Ticket, posts: list) -> None:
        """A sequence ends: what its splitter and parser still held, and the first prompt token's entry (no logprob)."""
        if t.thinker is not None:
            self._split(t, t.thinker.finish(), posts)
        if t.parser is not None:
            self._events(t, t.parser.finish(truncated=t.finish == "length"), posts)
        if t.prompt_lps is not None and not t.prompt_lps and t.seq.tokens:
            t.prompt_lps.append((self.engine.token_bytes(t.seq.tokens[0]), None, []))

    def _events(self, t: Ticket, events: list, posts: list) -> None:
        for ev in events:
            if isinstance(ev, ContentDelta):
                t.text.append(ev.text)
                posts.append((put_event, t.events, Text(t.index, ev.text)))
                continue
            if ev.index > 0 and t.req.tools.single:  # parallel_tool_calls false: the first call only
                continue
            calls = t.calls if t.calls is not None else []
            t.calls = calls
            if isinstance(ev, ToolCallStart):
                calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            elif isinstance(ev, ToolCallArguments):
                calls[ev.index]["function"]["arguments"] += ev.delta
            posts.append((put_event, t.events, ToolDelta(t.index, to_openai_delta(ev))))


def put_event(queue: Any, item: Any) -> None:
    queue.put_nowait(item)


def token_id(tok: Any, n_vocab: int) -> int | EngineError:
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
