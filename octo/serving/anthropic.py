"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) on top of the chat machinery: no aiohttp here.

A request becomes OpenAI chat messages and tools (:func:`chat_input`): the system text a system message,
``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result`` blocks ``tool`` messages (an ``is_error``
result reads "Error: ..."), custom tools OpenAI function tools, ``tool_choice`` OpenAI's (``any``: required, ``tool``:
a named function, ``disable_parallel_tool_use``: at most one call). The worker then renders, constrains and parses it
through octo.serving.chatprep exactly as a chat request; a final assistant message is a prefill, continued
(``chatprep.render_continue``), and the answer holds only the continuation, as Anthropic's does. Results become
content blocks (:func:`response`): ``thinking`` (the ``<think>`` text of a model whose template reasons, when the
request enables thinking), ``text`` (only when not empty), then ``tool_use``; an empty answer is one empty text block.
A stream's events become Anthropic's block events (:class:`StreamBlocks`), numbered in order of appearance.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those that were (their sum is what ``count_tokens`` reports).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic_core import from_json

from octo.engine import SamplingParams, Task
from octo.errors import InvalidRequest, UnsupportedParameter
from octo.protocol.anthropic import (
    AnthropicCountTokensRequest,
    AnthropicRequest,
    RedactedThinkingBlock,
    ServerTool,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from octo.scheduler.jobs import GenerationRequest, Result
from octo.serving import chatprep
from octo.serving.openai import require, unsupported_if
from octo.text.reasoning import ThinkSplitter, split_thinking, supports_thinking, template_source

_ALNUM = string.ascii_letters + string.digits
_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
MIN_THINKING_BUDGET = 1024  # Anthropic's lower bound on thinking.budget_tokens


def new_id(prefix: str) -> str:
    """``prefix`` + "_" + 24 random alphanumerics (``msg_...``), as Anthropic's ids."""
    return prefix + "_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` id of a parsed call's id (``call_`` + 24 alphanumerics keeps its 24; any other id maps to 24
    derived from it), so a stream and its final message name a call alike."""
    body = call_id[5:] if call_id.startswith("call_") else ""
    if len(body) != 24 or not (body.isascii() and body.isalnum()):
        body = "".join(_ALNUM[b % len(_ALNUM)] for b in hashlib.sha256(call_id.encode()).digest()[:24])
    return "toolu_" + body


# -- request -> chat ------------------------------------------------------------------------------------------------
@dataclass
class ChatInput:
    """An Anthropic request in OpenAI's terms, for octo.serving.chatprep."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    names: list[str]
    choice: Any  # OpenAI tool_choice: None, "auto", "required", "none" or a named function
    parallel: bool | None


def _text(content: Any, where: str) -> str:
    """The text of a string or of text blocks (any other block type: a 400 naming it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise UnsupportedParameter(f"{where}[{j}]", f"content blocks of type '{block.type}' are not supported")
        parts.append(block.text)
    return "".join(parts)


def _append(out: list[dict[str, Any]], msg: dict[str, Any]) -> None:
    """Add a turn; consecutive user or assistant turns are combined into one, as Anthropic's API does."""
    prev = out[-1] if out else None
    if prev is not None and prev["role"] == msg["role"] and msg["role"] in ("user", "assistant") \
            and not prev.get("tool_calls"):
        prev["content"] = "\n\n".join(t for t in (prev["content"], msg["content"]) if t)
        if msg.get("tool_calls"):
            prev["tool_calls"] = msg["tool_calls"]
        return
    out.append(msg)


def _unanswered(open_calls: dict[str, int]) -> InvalidRequest:
    i = next(iter(open_calls.values()))
    return InvalidRequest(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                          f"{', '.join(open_calls)}. Each `tool_use` block must have a corresponding `tool_result` "
                          "block in the next message.", param=f"messages[{i}]")


def _messages(req: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    open_calls: dict[str, int] = {}  # tool_use id -> the message that made the call, until its result comes
    for i, m in enumerate(req.messages):
        if not m.content and not (m.role == "assistant" and i == len(req.messages) - 1):  # "" or []
            raise InvalidRequest(f"messages.{i}: all messages must have non-empty content except for the optional "
                                 "final assistant message", param=f"messages[{i}].content")
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":  # a mid-conversation system turn, where it was sent
            if i == 0:
                raise InvalidRequest("messages.0.role: a conversation cannot start with a system turn; the system "
                                     "prompt goes in the top-level `system` parameter.", param="messages[0].role")
            if open_calls:
                raise _unanswered(open_calls)
            text = _text(m.content, f"messages[{i}].content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if m.role == "assistant":
            _assistant_turn(i, blocks, open_calls, out)
        else:
            _user_turn(i, blocks, open_calls, out)
    if open_calls:
        raise _unanswered(open_calls)
    if out and out[-1]["role"] == "assistant" and not out[-1]["content"] and not out[-1].get("tool_calls"):
        out.pop()  # an empty final assistant message prefills nothing
    return out


def _assistant_turn(i: int, blocks: list[Any], open_calls: dict[str, int], out: list[dict[str, Any]]) -> None:
    """An assistant turn (``messages[i]``): its text and tool calls as one chat message; its calls are open until a
    user turn answers them."""
    if open_calls:
        raise _unanswered(open_calls)
    texts, calls = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            if b.id in open_calls:
                raise InvalidRequest(f"messages.{i}.content.{j}: `tool_use` ids must be unique: {b.id}.",
                                     param=f"messages[{i}].content[{j}].id")
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            open_calls[b.id] = i
        elif isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            continue  # earlier reasoning is not shown to the model again (as chat templates drop it)
        elif isinstance(b, ToolResultBlock):
            raise InvalidRequest(f"messages.{i}.content.{j}: `tool_result` blocks can only be in `user` "
                                 "messages.", param=f"messages[{i}].content[{j}]")
        else:
            raise UnsupportedParameter(f"messages[{i}].content[{j}]",
                                       f"content blocks of type '{b.type}' are not supported")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    _append(out, msg)


def _user_turn(i: int, blocks: list[Any], open_calls: dict[str, int], out: list[dict[str, Any]]) -> None:
    """A user turn (``messages[i]``): its text, and its tool results as tool messages in place; each must answer
    one of the previous turn's calls, and all of them must be answered."""
    texts, answered = [], 0
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in open_calls:
                raise InvalidRequest(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                                     f"blocks: {b.tool_use_id}. Each `tool_result` block must have a corresponding "
                                     "`tool_use` block in the previous message.", param=f"{where}.tool_use_id")
            del open_calls[b.tool_use_id]
            if texts:  # text before the result keeps its place
                _append(out, {"role": "user", "content": "".join(texts)})
                texts = []
            result = _text(b.content, f"{where}.content")
            if b.is_error:
                result = f"Error: {result}" if result else "Error"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            answered += 1
        elif isinstance(b, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock):
            raise InvalidRequest(f"messages.{i}.content.{j}: `{b.type}` blocks can only be in `assistant` "
                                 "messages.", param=where)
        else:
            raise UnsupportedParameter(where, f"content blocks of type '{b.type}' are not supported")
    if open_calls:
        raise _unanswered(open_calls)
    if texts or not answered:
        _append(out, {"role": "user", "content": "".join(texts)})


def anthropic_paths(err: InvalidRequest) -> InvalidRequest:
    """An error about the chat form of the tools named in Anthropic's terms: ``tools[3].input_schema``, not
    ``tools[3].function.parameters`` (the message names the path too)."""
    for chat, ours in ((".function.parameters", ".input_schema"), (".function.", ".")):
        err.message = err.message.replace(chat, ours)
        if err.param:
            err.param = err.param.replace(chat, ours)
    return err


def chat_input(req: AnthropicCountTokensRequest) -> ChatInput:
    messages = _messages(req)
    tools: list[dict[str, Any]] | None = None
    names: list[str] = []
    if req.tools:
        tools = []
        for k, t in enumerate(req.tools):
            if isinstance(t, ServerTool):
                raise UnsupportedParameter(f"tools[{k}]", f"tools of type '{t.type}' are not supported; define a "
                                           "custom tool (name, description, input_schema)")
            fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
            if t.description:
                fn["description"] = t.description
            tools.append({"type": "function", "function": fn})
        try:
            names = chatprep.check_tools(tools)
        except InvalidRequest as err:
            raise anthropic_paths(err) from None
    choice, parallel = None, None
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise InvalidRequest("tool_choice.name: Field required when tool_choice.type is 'tool'.",
                                 param="tool_choice.name", code="missing_required_parameter")
        if tc.type != "tool" and tc.name is not None:
            raise InvalidRequest(f"tool_choice.name is only allowed when tool_choice.type is 'tool', not "
                                 f"'{tc.type}'.", param="tool_choice.name")
        if tc.disable_parallel_tool_use:
            parallel = False
        if tools or tc.type in ("any", "tool"):  # auto or none without tools: nothing to choose
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
                {"type": "function", "function": {"name": tc.name}}
    chatprep.check_tool_choice(choice, names, bool(tools))
    return ChatInput(messages, tools, names, choice, parallel)


# -- thinking -------------------------------------------------------------------------------------------------------
# context_management edits octo honours: earlier turns' thinking is never shown to the model again (see _messages, as
# chat templates drop it), so clearing it, whatever ``keep`` says, changes nothing and is accepted
_CONTEXT_EDITS = ("clear_thinking_20251015",)


def _check_context_management(req: AnthropicCountTokensRequest) -> None:
    cm = req.context_management
    for k, edit in enumerate(cm.edits or [] if cm is not None else []):
        if edit.type not in _CONTEXT_EDITS:
            raise UnsupportedParameter(f"context_management.edits[{k}]",
                                       f"edits of type '{edit.type}' are not supported (supported: "
                                       f"{', '.join(_CONTEXT_EDITS)})")
        for key in edit.model_extra or ():
            if key != "keep":  # clear_thinking's only setting
                raise InvalidRequest(f"context_management.edits.{k}.{key}: Extra inputs are not permitted.",
                                     param=f"context_management.edits[{k}].{key}", code="unknown_parameter")


def thinking_enabled(req: AnthropicCountTokensRequest) -> bool:
    return req.thinking is not None and req.thinking.type != "disabled"


def _check_thinking(handle: Any, req: AnthropicCountTokensRequest) -> dict[str, Any] | None:
    """The template arguments of the request's ``thinking`` setting; a 400 naming it for a model that cannot."""
    th, engine = req.thinking, handle.engine
    reasons = supports_thinking(engine)
    if not thinking_enabled(req) or (th.type == "adaptive" and not reasons):
        # adaptive: the model decides whether to think; a model with no reasoning mode answers directly
        return {"enable_thinking": False} if reasons else None
    if not reasons:
        raise UnsupportedParameter("thinking", f"model '{handle.name}' has no reasoning mode (its chat template knows "
                                   "neither enable_thinking nor <think>); send thinking {\"type\": \"disabled\"} or "
                                   "leave it out")
    if th.type == "enabled":
        if th.budget_tokens is None:
            raise InvalidRequest("thinking.budget_tokens: Field required.", param="thinking.budget_tokens",
                                 code="missing_required_parameter")
        if th.budget_tokens < MIN_THINKING_BUDGET:
            raise InvalidRequest(f"thinking.budget_tokens: Input should be greater than or equal to "
                                 f"{MIN_THINKING_BUDGET}.", param="thinking.budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and th.budget_tokens >= max_tokens:
            raise InvalidRequest("`max_tokens` must be greater than `thinking.budget_tokens`.", param="max_tokens")
    return {"enable_thinking": True}


# -- prompt and generation ------------------------------------------------------------------------------------------
def _prompt(handle: Any, req: AnthropicCountTokensRequest) -> tuple[list[int], ChatInput, Any]:
    """The prompt tokens of a request (as a real request renders them), its chat input and tool format."""
    require(handle, Task.CHAT)
    unsupported_if(req, ("mcp_servers", "container"))
    _check_context_management(req)
    engine = handle.engine
    inp = chat_input(req)
    template_kwargs = _check_thinking(handle, req)
    effort = req.output_config.effort if req.output_config is not None else None
    if effort not in (None, "high"):  # "high" is Anthropic's default: the model as it always answers
        if "reasoning_effort" not in template_source(engine):
            raise UnsupportedParameter("output_config.effort", f"model '{handle.name}' has no effort setting (its chat "
                                       "template takes no reasoning_effort); only the default \"high\" is accepted")
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": effort}
    fmt = chatprep.tool_format(engine, getattr(handle, "tool_format", None))
    prompt = chatprep.render_continue(engine, inp.messages, inp.tools, fmt, inp.choice, template_kwargs)
    return engine.tokenize(prompt, special=True), inp, fmt


def count_tokens(handle: Any, req: AnthropicCountTokensRequest) -> int:
    return len(_prompt(handle, req)[0])


def generation(handle: Any, req: AnthropicRequest) -> GenerationRequest:
    if req.service_tier not in (None, "auto", "standard_only"):
        raise UnsupportedParameter("service_tier")
    tokens, inp, fmt = _prompt(handle, req)
    engine = handle.engine
    sp = SamplingParams()
    if req.temperature is not None:
        sp.temperature = req.temperature
    if req.top_p is not None:
        sp.top_p = req.top_p
    if req.top_k is not None:
        sp.top_k = req.top_k
    for name in sorted(sp.changed()):
        if name not in engine.sampling_params:
            raise UnsupportedParameter(name, f"the {engine.name} engine cannot honour it")
    out_format = req.output_config.format if req.output_config is not None else None
    rf = {"type": "json_schema", "schema": out_format.schema_} if out_format is not None else None
    try:
        grammar = chatprep.compile_for(engine, chatprep.constraint_for(rf, inp.tools, inp.choice, inp.parallel, fmt,
                                                                       rf_param="output_config.format"))
    except InvalidRequest as err:
        raise anthropic_paths(err) from None
    max_tokens = req.max_tokens
    n_ctx = getattr(getattr(handle, "info", None), "n_ctx", 0) or 0
    if n_ctx and len(tokens) < n_ctx:
        # as Anthropic's API does for a max_tokens beyond the context window: generate to the window's end and stop
        # with "model_context_window_exceeded" (a prompt that does not fit is still a 400)
        max_tokens = min(max_tokens, n_ctx - len(tokens))
    return GenerationRequest(tokens, sp, max_tokens, list(req.stop_sequences or []), req.stream,
                             grammar=grammar, tools=chatprep.tool_spec(fmt, inp.names, inp.choice, inp.parallel))


# -- results -> message ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What shapes the answer's blocks, from the request."""

    thinking: bool = False  # split <think> text into thinking blocks
    omit_thinking: bool = False  # thinking.display "omitted": the blocks are there, their text is not
    max_tokens: int = 0  # as requested: a "length" end before it is the context window's end

    @classmethod
    def of(cls, req: AnthropicRequest) -> Options:
        th = req.thinking
        return cls(thinking_enabled(req), bool(th is not None and th.display == "omitted"), req.max_tokens)


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


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """The call's ``tool_use`` block; its ``input`` is the arguments' text as the model wrote it (an orjson
    Fragment: numbers keep their digits, nothing is parsed and re-serialised), ``{}`` where it is not an object."""
    text = call["function"]["arguments"] or "{}"
    try:
        value: Any = orjson.Fragment(text) if isinstance(orjson.loads(text), dict) else {}
    except orjson.JSONDecodeError:  # a call cut off by max_tokens: what its arguments hold so far
        value = _partial_object(text)
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": value}


def _partial_object(text: str) -> dict[str, Any]:
    try:
        value = from_json(text, allow_partial="trailing-strings", allow_inf_nan=False)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(result: Result, opts: Options) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = result.text
    if opts.thinking:
        thinking, text = split_thinking(text)
        if thinking is not None:
            blocks.append({"type": "thinking", "thinking": "" if opts.omit_thinking else thinking, "signature": ""})
    calls = result.tool_calls or []  # disable_parallel_tool_use: the scheduler kept the first call only
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    return blocks + [tool_use_block(c) for c in calls]


def response(mid: str, model: str, result: Result, opts: Options = Options()) -> dict[str, Any]:
    reason, seq = stop_reason(result, opts)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(result, opts), "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(result)}


# -- streaming ------------------------------------------------------------------------------------------------------
Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


def message_start(mid: str, model: str, n_prompt: int, cached: int) -> Event:
    return "message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": n_prompt - cached, "output_tokens": 0,
                                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}}}


class StreamBlocks:
    """The events of one streamed message's content blocks: numbered in order of appearance, a text block only when
    there is text (an empty answer still gets one), each tool call a ``tool_use`` block whose input arrives as
    ``input_json_delta`` fragments."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.splitter = ThinkSplitter() if opts.thinking else None
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.answered = False  # a text or tool_use block was opened
        self.calls = 0

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

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[Event]:
        out: list[Event] = []
        for kind, piece in pieces:
            if not piece:
                continue
            if kind == "thinking":
                if self.open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                if not self.opts.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": piece}))
            else:
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": piece}))
        return out

    def text(self, text: str) -> list[Event]:
        return self._pieces(self.splitter.feed(text) if self.splitter is not None else [("text", text)])

    def tool(self, delta: dict[str, Any]) -> list[Event]:
        """A Chat Completions tool-call delta (octo.scheduler.emission): a new call opens a tool_use block."""
        out: list[Event] = []
        for tc in delta.get("tool_calls", []):
            fn = tc.get("function") or {}
            if tc.get("id"):
                self.calls += 1
                if self.splitter is not None:
                    out += self._pieces(self.splitter.flush())
                out += self._start({"type": "tool_use", "id": tool_use_id(tc["id"]), "name": fn.get("name", ""),
                                    "input": {}})
            if fn.get("arguments") and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def finish(self, result: Result) -> list[Event]:
        out = self._pieces(self.splitter.finish()) if self.splitter is not None else []
        if not self.answered:
            out += self._start({"type": "text", "text": ""})
        out += self._stop()
        reason, seq = stop_reason(result, self.opts)
        out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": usage(result)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out
