"""Tool-call formats of the chat-template families: detection, parsing (whole and streaming), wrapper text, fallback.

A model calls tools by writing text in the format its chat template taught it. Five families:

- hermes (Qwen2.5/3, Hermes 2/3, and unknown templates): ``<tool_call>\n{"name": "f", "arguments": {...}}\n
  </tool_call>``, one block per call, blocks separated by a newline.
- llama3 (Llama 3.1/3.2/3.3): ``{"name": "f", "parameters": {...}}`` at the start of the answer (several:
  ``; ``-separated), or ``<|python_tag|>`` followed by that JSON or by a builtin ``brave_search.call(query="x")``.
- mistral (7B v0.3, Nemo, Small): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, or
  ``[TOOL_CALLS]f[ARGS]{...}``.
- phi4 (Phi-4-mini): ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]<|/tool_call|>``, or ``functools[...]``.
- gemma (Gemma 2/3, no native tools): a ```` ```tool_code ```` block of ``{"name": "f", "parameters": {...}}`` lines
  or of Python calls ``f(k="v")``.

:func:`detect_format` picks the family from the template source as llama.cpp's ``common/chat.cpp`` does (an explicit
name wins). :class:`ToolFormat` holds the wrapper text (``octo.text.constrain`` builds the grammar of valid calls from
it), renders calls and says how the template takes tools (``octo.text.toolprompt`` adapts OpenAI messages and tools to
the
template, or describes them in a system prompt for templates without tool support).
:class:`ToolCallParser` turns text deltas into :class:`ContentDelta`, :class:`ToolCallStart` and
:class:`ToolCallArguments` events (:func:`to_openai_delta`: Chat Completions chunk deltas). A call is emitted once its
block is complete and parses, so streamed text is never taken back; text that might open a call is held until
decided. :func:`parse_tool_calls` runs the same machine over a whole text, so streamed and whole results are equal
by construction. Malformed calls stay in the content; whitespace around calls is dropped. Special-token markers
(``[TOOL_CALLS]``, ``<|python_tag|>``, ``<|tool_call|>``) are invisible when an engine decodes special tokens to b"",
so the JSON forms also count at the start of an answer without their marker, if they name offered tools.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from octo.errors import EngineError, InvalidRequest
from octo.text.toolscan import (
    BAD,
    DECODER,
    MORE,
    WS,
    ArgsPrefix,
    Scanner,
    UnsafeArguments,
    call_at,
    check_number,
    load_json,
    python_calls,
    skip_ws,
)

_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: str = "openai") -> str:
    """``call_`` + 24 random alphanumerics (OpenAI style), or 9 alphanumerics (Mistral's templates require them)."""
    n = 9 if style == "mistral" else 24
    body = "".join(secrets.choice(_ALNUM) for _ in range(n))
    return body if style == "mistral" else "call_" + body


# -- events -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    delta: str


Event = ContentDelta | ToolCallStart | ToolCallArguments


def to_openai_delta(event: Event) -> dict[str, Any]:
    """The Chat Completions ``choices[].delta`` of one event."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]}


@dataclass
class ParsedMessage:
    """The assistant message: text outside calls, and OpenAI ``tool_calls`` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def assemble(events: Iterable[Event]) -> ParsedMessage:
    """Reassemble streamed events into the message (what a client does with the chunks)."""
    out = ParsedMessage()
    for ev in events:
        if isinstance(ev, ContentDelta):
            out.content += ev.text
        elif isinstance(ev, ToolCallStart):
            out.tool_calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
        else:
            out.tool_calls[ev.index]["function"]["arguments"] += ev.delta
    return out


# -- formats ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call text. Calls render as ``begin + (call_open + BODY + call_close) joined by separator +
    end``, BODY being ``{"name": NAME, "<args_key>": ARGS}``. ``markers`` are the parts of that text that are one
    special token in the family's vocabulary (a grammar emits them as that token, or leaves them out when the
    vocabulary has no such token, which the parser tolerates). ``tools_in`` says how the template takes tools:
    "template" (its ``tools`` variable), "system_field" (Phi-4-mini: a JSON string in the system message's ``tools``
    field) or "prompt" (no tool support: :func:`tool_system_prompt`)."""

    name: str
    begin: str
    call_open: str
    call_close: str
    separator: str
    end: str
    args_key: str
    markers: tuple[str, ...] = ()
    tools_in: str = "template"
    id_style: str = "openai"

    def render_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        """The text the model would have written for these OpenAI ``tool_calls``."""
        bodies = [json.dumps({"name": c["function"]["name"], self.args_key: args_obj(c)}, ensure_ascii=False)
                  for c in tool_calls]
        return self.begin + self.separator.join(self.call_open + b + self.call_close for b in bodies) + self.end

    def new_id(self) -> str:
        return new_call_id(self.id_style)

    def parse(self, text: str, tool_names: Iterable[str] | None = None,
              new_id: Callable[[], str] | None = None) -> ParsedMessage:
        return parse_tool_calls(text, self, tool_names, new_id)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", "", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments"),
    ToolFormat("llama3", "", "", "", "; ", "", "parameters"),
    ToolFormat("mistral", "[TOOL_CALLS][", "", "", ", ", "]", "arguments", ("[TOOL_CALLS]",), id_style="mistral"),
    ToolFormat("phi4", "<|tool_call|>[", "", "", ", ", "]<|/tool_call|>", "arguments",
               ("<|tool_call|>", "<|/tool_call|>"), tools_in="system_field"),
    ToolFormat("gemma", "```tool_code\n", "", "", "\n", "\n```", "parameters", tools_in="prompt"),
)}


def get_format(name: str | ToolFormat) -> ToolFormat:
    if isinstance(name, ToolFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidRequest(f"Unknown tool-call format {name!r}; known formats: {', '.join(FORMATS)}.",
                             param="tool_format") from None


def detect_format(template: str | None, override: str | None = None) -> ToolFormat:
    """The family of a chat template (its Jinja source), or ``override`` when given. Unknown templates get the
    Hermes format, with tools in the system prompt when the template does not mention tools at all."""
    if override:
        return get_format(override)
    src = template or ""
    if "<tool_call>" in src:
        fmt = FORMATS["hermes"]
    elif "[TOOL_CALLS]" in src:
        fmt = FORMATS["mistral"]
    elif "<|start_header_id|>" in src and ("ipython" in src or "<|python_tag|>" in src or '"parameters"' in src):
        fmt = FORMATS["llama3"]
    elif "<|tool_call|>" in src or "<|tool|>" in src:
        return FORMATS["phi4"]
    elif "<start_of_turn>" in src:
        return FORMATS["gemma"]
    else:
        fmt = FORMATS["hermes"]
    if "tools" not in src:  # the template cannot show tools: describe them in the system prompt
        fmt = replace(fmt, tools_in="prompt")
    return fmt


# -- block parsers: (text from the opener, final) -> MORE | BAD | (calls, consumed) ----------------------------
Block = str | tuple[list[tuple[str, str]], int]
Scan = Callable[[str, int], int | str]


def _json_calls_at(s: str, i: int, final: bool, scan: Scan) -> tuple[list[tuple[str, str]], int] | str:
    """One JSON object or an array of objects at ``s[i]``, each a call."""
    j = i
    for want in ("[{" if s[i:i + 1] == "[" else "{") + '"':  # decide early: "[ {" / "{ \"" must open a call
        j = skip_ws(s, j) if j > i else j
        if j >= len(s):
            return BAD if final else MORE
        if s[j] != want:
            return BAD
        j += 1
    end = scan(s, i)
    if end == MORE:
        return BAD if final else MORE
    if end == BAD:
        return BAD
    value = load_json(s[i:end])
    if value == BAD:
        return BAD
    if isinstance(value, list):
        starts = [skip_ws(s, i + 1)]
        for _ in value[1:]:  # each element's start: past the previous one and its comma
            starts.append(skip_ws(s, skip_ws(s, DECODER.raw_decode(s, starts[-1])[1]) + 1))
        calls = [call_at(s, k, o) for k, o in zip(starts, value, strict=True)]
    else:
        calls = [call_at(s, i, value)]
    if not calls or BAD in calls:
        return BAD
    return calls, end


def _close_tag(s: str, i: int, tag: str, final: bool, optional: bool) -> int | str:
    """Consume whitespace + ``tag`` after a call. A missing tag is tolerated at the end of the text, and anywhere
    when ``optional`` (vLLM's ``functools[...]`` has no closing marker; Phi-4's is a special token)."""
    j = skip_ws(s, i)
    if s.startswith(tag, j):
        return j + len(tag)
    if tag.startswith(s[j:]):  # the text ends inside the tag (or before it)
        return len(s) if final else MORE  # at the end: the cut-off tag is markup, not content
    return i if optional else BAD


def _wrapped_block(openers: tuple[str, ...], close: str, optional: bool) -> Callable[[str, bool, Scan], Block]:
    """Parser of ``opener`` + JSON call(s) + ``close`` blocks (Hermes, Phi-4)."""

    def parse(s: str, final: bool, scan: Scan) -> Block:
        i = next((skip_ws(s, len(o)) for o in openers if s.startswith(o)), 0)
        found = _json_calls_at(s, i, final, scan)
        if isinstance(found, str):
            return found
        end = _close_tag(s, found[1], close, final, optional)
        return end if isinstance(end, str) else (found[0], end)

    return parse


def _llama_block(s: str, final: bool, scan: Scan) -> Block:
    i = skip_ws(s, len("<|python_tag|>")) if s.startswith("<|python_tag|>") else 0
    if s.startswith("<|python_tag|>") and i < len(s) and s[i] not in "{[":
        # builtin tool: name.call(k=v); complete at a line end or at the end of the text
        nl = s.find("\n", i)
        if nl < 0 and not final:
            return MORE
        stop = len(s) if nl < 0 else nl
        calls = python_calls(s[i:stop])
        return BAD if calls == BAD else (calls, stop)
    calls: list[tuple[str, str]] = []
    i_done = 0
    while True:  # calls separated by ";" or whitespace
        found = _json_calls_at(s, i, final, scan)
        if found == MORE:
            return MORE
        if isinstance(found, str):
            return (calls, i_done) if calls else BAD
        calls += found[0]
        i_done = found[1]
        j = skip_ws(s, i_done)
        if j < len(s) and s[j] == ";":
            j = skip_ws(s, j + 1)
        if j >= len(s):
            return (calls, i_done) if final else MORE
        if s[j] != "{":
            return calls, i_done
        i = j


_ARGS_CALL = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")
_ARGS_CALL_PART = re.compile(r"[A-Za-z0-9_.\-]*(\[(A(R(G(S)?)?)?)?)?")


def _mistral_block(s: str, final: bool, scan: Scan) -> Block:
    i = skip_ws(s, len("[TOOL_CALLS]")) if s.startswith("[TOOL_CALLS]") else 0
    if i >= len(s):
        return BAD if final else MORE
    if s[i] in "[{":
        return _json_calls_at(s, i, final, scan)
    m = _ARGS_CALL.match(s, i)  # [TOOL_CALLS]name[ARGS]{...}
    if m is None:
        return MORE if _ARGS_CALL_PART.fullmatch(s, i) and not final else BAD
    start = m.end()
    if start >= len(s):
        return BAD if final else MORE
    end = scan(s, start) if s[start] == "{" else BAD
    if end == MORE:
        return BAD if final else MORE
    obj = load_json(s[start:end]) if end != BAD else BAD
    if not isinstance(obj, dict):
        return BAD
    return [(m.group(1), s[start:end])], end


def _gemma_block(s: str, final: bool, scan: Scan) -> Block:
    head = "```tool_code" if s.startswith("```tool_code") else "```json" if s.startswith("```json") else ""
    if not head:
        return _json_calls_at(s, 0, final, scan)  # bare JSON at the start of the answer
    close = s.find("```", len(head))
    if close < 0 and not final:
        return MORE
    body = s[len(head):close if close >= 0 else len(s)]
    end = close + 3 if close >= 0 else len(s)
    stripped = body.strip()
    calls = _json_lines(stripped) if stripped.startswith(("{", "[")) else BAD
    if calls == BAD:
        calls = python_calls(stripped)
    return BAD if calls == BAD else (calls, end)


def _json_lines(s: str) -> list[tuple[str, str]] | str:
    """Calls written as JSON objects or arrays one after the other (a complete text)."""
    calls: list[tuple[str, str]] = []
    i = 0
    while (i := skip_ws(s, i)) < len(s):
        found = _json_calls_at(s, i, True, Scanner())
        if isinstance(found, str):
            return BAD
        calls += found[0]
        i = found[1]
    return calls or BAD


# Per family: (opener, only at the start of the answer, block parser)
_OPENERS: dict[str, list[tuple[str, bool, Callable[[str, bool, Scan], Block]]]] = {
    "hermes": [("<tool_call>", False, _wrapped_block(("<tool_call>",), "</tool_call>", False))],
    "llama3": [("<|python_tag|>", False, _llama_block), ("{", True, _llama_block)],
    "mistral": [("[TOOL_CALLS]", False, _mistral_block), ("[", True, _mistral_block)],
    "phi4": [(o, o == "[", _wrapped_block(("<|tool_call|>", "functools"), "<|/tool_call|>", True))
             for o in ("<|tool_call|>", "functools[", "[")],
    "gemma": [("```tool_code", False, _gemma_block), ("```json", True, _gemma_block), ("{", True, _gemma_block)],
}


# the head of a call cut off after its name: {"name": "f", "arguments": ...
_CALL_HEAD = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_.\-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallParser:
    """Incremental parser of one generated message: ``feed(delta)`` and ``finish()`` return events.

    ``tool_names`` (the offered functions) guards openers that are not markers (a bare ``{`` or ``[`` at the
    start): such a block is a call only if every name in it is offered. One parser per sequence; not thread-safe.

    ``live``: the output is constrained to valid calls (a forced tool choice), so a call goes out as soon as its name
    is written and its arguments as they are generated (:class:`octo.text.toolscan.ArgsPrefix` holds back an unfinished
    number or escape). A number past a double's range or a lone surrogate escape, which the grammar cannot exclude,
    then raises :class:`octo.errors.EngineError` (the sequence fails: the call cannot be taken back, and its
    arguments are never completed as if they were JSON).
    """

    def __init__(self, fmt: ToolFormat | str, tool_names: Iterable[str] | None = None,
                 new_id: Callable[[], str] | None = None, live: bool = False) -> None:
        self.fmt = get_format(fmt)
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self._new_id = new_id or self.fmt.new_id
        self._openers = _OPENERS.get(self.fmt.name, _OPENERS["hermes"])
        self._buf = ""          # undecided text
        self._held_ws = ""      # trailing whitespace of the content, held until we know what follows it
        self._started = False   # any non-whitespace content emitted yet
        self._last_was_call = False
        self._n_calls = 0
        self._done = False
        self._scan = Scanner()
        self.live = live
        self._pending: list[tuple[int, str, ArgsPrefix]] = []  # live calls of the undecided block: index, id, args

    def feed(self, delta: str) -> list[Event]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self, truncated: bool = False) -> list[Event]:
        """Decide what is left: unfinished calls become content, except when the output was cut off (``truncated``:
        max_tokens): then a call that had begun is a call, with the arguments generated so far, as OpenAI returns a
        truncated call (its template markup never reaches the content)."""
        events = self._run(final=False) + self._cut_call() if truncated else []
        events += self._run(final=True)
        if self._held_ws and not self._last_was_call:
            events.append(ContentDelta(self._held_ws))
        self._held_ws = ""
        self._done = True
        return events

    # -- internals ------------------------------------------------------------------------------------------
    def _cut_call(self) -> list[Event]:
        """The call the undecided text began, cut off in its arguments: its events, or [] when it is no call."""
        if self._pending:
            return self._cut_live()
        pos, complete = self._find(self._buf)
        if pos != 0 or not self._buf.strip():
            return []
        if not complete:  # cut off inside the opening markup: markup, not content
            self._buf = ""
            return []
        if self._block(self._buf, False) != MORE or self._block(self._buf, True) != BAD:
            return []  # no call, or a whole one that only lacks its closing text
        heads = list(_CALL_HEAD.finditer(self._buf))
        if len(heads) != 1 or (self.tool_names is not None and heads[0].group(1) not in self.tool_names):
            self._buf = ""  # cut off before its name was written: markup of no call
            return []
        name, arguments = heads[0].group(1), self._buf[heads[0].end():]
        self._buf, self._held_ws, self._last_was_call = "", "", True
        self._n_calls += 1
        return [ToolCallStart(self._n_calls - 1, self._new_id(), name), ToolCallArguments(self._n_calls - 1, arguments)]

    def _content(self, text: str, out: list[Event]) -> None:
        if self._last_was_call:
            text = text.lstrip(WS)
        if not text:
            return
        body = text.rstrip(WS)
        if body:
            out.append(ContentDelta(self._held_ws + body))
            self._held_ws = ""
            self._started = True
            self._last_was_call = False
        self._held_ws += text[len(body):]

    def _find(self, s: str) -> tuple[int, bool]:
        """Earliest position where an opener starts (complete=True) or may start (complete=False, s ends there)."""
        best = (len(s), False)
        for opener, at_start, _ in self._openers:
            if at_start:
                if self._started:
                    continue
                i = skip_ws(s, 0)
                if i < best[0] and i < len(s) and (s.startswith(opener, i) or opener.startswith(s[i:])):
                    best = (i, s.startswith(opener, i))
                continue
            i = s.find(opener)
            if 0 <= i < best[0]:
                best = (i, True)
            for k in range(max(0, len(s) - len(opener) + 1), len(s)):  # a partial opener at the end
                if k < best[0] and opener.startswith(s[k:]):
                    best = (k, False)
                    break
        return best

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            pos, complete = self._find(self._buf)
            if pos:
                self._content(self._buf[:pos], out)
                self._buf = self._buf[pos:]
                self._scan.saved.clear()
            if not self._buf:
                break
            result = self._block(self._buf, final) if complete else MORE if not final else BAD
            if result == MORE:
                if self.live and complete:
                    out += self._go_live()
                break
            if result == BAD and self._pending:
                self._go_live()  # raises on the number or escape that broke the block, if that is what did
                raise self._failed("its text ended before the call was complete")
            if result == BAD:  # no call starts here: its first character is text, look again after it
                self._content(self._buf[:1], out)
                self._buf = self._buf[1:]
                self._scan.saved.clear()
                continue
            calls, consumed = result
            self._held_ws = ""
            out += self._calls_out(calls)
            self._last_was_call = True
            self._buf = self._buf[consumed:]
            self._scan.saved.clear()
        return out

    def _calls_out(self, calls: list[tuple[str, str]]) -> list[Event]:
        """The events of a complete block's calls; those already live get the rest of their arguments only."""
        out: list[Event] = []
        live, self._pending = self._pending, []
        if len(live) > len(calls):
            raise self._failed("a call streamed is not in the finished block")
        for k, (name, arguments) in enumerate(calls):
            if k < len(live):
                index, _, args = live[k]
                sent = self._buf[args.start:args.safe]
                if not arguments.startswith(sent):
                    raise self._failed(f"the arguments of call {index} are not the text streamed")
                if arguments[len(sent):]:
                    out.append(ToolCallArguments(index, arguments[len(sent):]))
            else:
                out.append(ToolCallStart(self._n_calls, self._new_id(), name))
                out.append(ToolCallArguments(self._n_calls, arguments))
            self._n_calls += 1
        return out

    def _go_live(self) -> list[Event]:
        """The pending block's calls as far as they are written (``live``): a call once its name is complete and its
        arguments' object has begun, then the arguments' text that may go out."""
        out: list[Event] = []
        s = self._buf
        while True:
            frm = 0
            if self._pending:
                index, _, args = self._pending[-1]
                before = args.safe
                try:
                    args.advance(s)
                except UnsafeArguments as exc:
                    raise self._failed(str(exc)) from None
                if args.safe > before:
                    out.append(ToolCallArguments(index, s[before:args.safe]))
                if args.end < 0:
                    return out
                frm = args.end
            m = _CALL_HEAD.search(s, frm)
            if m is None or s[m.end():m.end() + 1] != "{" or (
                    self.tool_names is not None and m.group(1) not in self.tool_names):
                return out
            index, cid = self._n_calls + len(self._pending), self._new_id()
            self._pending.append((index, cid, ArgsPrefix(m.end())))
            self._held_ws = ""
            out.append(ToolCallStart(index, cid, m.group(1)))

    def _cut_live(self) -> list[Event]:
        """Truncated (max_tokens) with live calls pending: the last one ends with what was generated (an unfinished
        number only when it is not already out of range)."""
        if self._block(self._buf, True) != BAD:
            return []  # complete but for its closing text: the final run emits the rest
        index, _, args = self._pending[-1]
        rest = self._buf[args.safe:] if args.end < 0 else ""
        if args.num >= 0:
            try:
                check_number(self._buf[args.num:], complete=False)
            except UnsafeArguments as exc:
                raise self._failed(str(exc)) from None
        self._n_calls += len(self._pending)
        self._buf, self._held_ws, self._last_was_call, self._pending = "", "", True, []
        return [ToolCallArguments(index, rest)] if rest else []

    def _failed(self, why: str) -> EngineError:
        return EngineError(f"The model's tool call could not be completed as valid JSON: {why}. Its arguments were "
                           "streamed as they were generated (the tool choice forces a call); the call is not "
                           "complete and must not be run.")

    def _block(self, s: str, final: bool) -> Block:
        for opener, at_start, parse in self._openers:
            if s.startswith(opener) and not (at_start and self._started):
                result = parse(s, final, self._scan)
                if isinstance(result, tuple) and at_start and self.tool_names is not None:
                    if any(name not in self.tool_names for name, _ in result[0]):
                        return BAD
                if result != BAD:
                    return result
        return BAD


def parse_tool_calls(text: str, fmt: ToolFormat | str, tool_names: Iterable[str] | None = None,
                     new_id: Callable[[], str] | None = None, truncated: bool = False) -> ParsedMessage:
    """Content and tool calls of a complete generated text (the streaming parser run over all of it); ``truncated``:
    the text was cut off by max_tokens (:meth:`ToolCallParser.finish`)."""
    parser = ToolCallParser(fmt, tool_names, new_id)
    return assemble(parser.feed(text) + parser.finish(truncated))


def args_obj(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments")
    if isinstance(args, str):
        loaded = load_json(args) if args.strip() else {}
        return args if loaded == BAD else loaded
    return args if args is not None else {}
