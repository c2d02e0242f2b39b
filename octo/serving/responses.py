"""The Responses API (``/v1/responses``) on top of the chat machinery: no aiohttp here.

A Responses request becomes a Chat Completions request (:func:`to_chat`): ``instructions`` a system message, input
items messages (``function_call`` items an assistant message's ``tool_calls``, ``function_call_output`` items
``tool`` messages), flat function tools OpenAI chat tools, ``text.format`` a ``response_format``. The worker then
renders, constrains and parses it exactly as a chat request (octo.serving.chatprep, octo.text.toolcalls,
octo.text.constrain): one
set of tool-call parsers, templates and constraints for every API. The results become output items
(:func:`output_items`), and a stream's events become Responses streaming events (:class:`EventStream`), each with
its ``sequence_number``. ``previous_response_id`` continues a stored conversation (octo.serving.response_store).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from octo.errors import InvalidRequest, OctoError, UnsupportedParameter
from octo.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputImage,
    InputText,
    MessageItem,
    NamespaceTool,
    ResponsesRequest,
)
from octo.scheduler.jobs import Result
from octo.serving.media import ImageRef

log = logging.getLogger("octo.serving.responses")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# encrypted reasoning for stateless (store: false) clients such as Codex: octo's models produce no reasoning items,
# so there is never anything to include (honoured as empty, like OpenAI's non-reasoning models)
INCLUDE_REASONING = "reasoning.encrypted_content"
# OpenAI's built-in web search: the model may search or not, at its own choice, and octo cannot run it, so the tool is
# accepted and not offered to the model (a warning says so: log line and x-octo-warning header), as a model that
# chose not to search. Other built-in tools (file_search, code_interpreter...) stay a 400: they name data to use.
NOT_OFFERED = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")
REASONING_SUMMARIES = ("auto", "concise", "detailed", "none")
_FROM = "_from"  # a chat message's input item while the request is converted: (its path, its content's key)


def flat_name(namespace: str, name: str) -> str:
    """The name a namespace's function has for the model: Codex's canonical flat name (``ns__name``)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


class ToolNames:
    """The request's tools as the model sees them: Chat Completions function tools (a namespace's functions under
    their flat names), where each came from (``tools[4].tools[1]``, for errors), the built-in tools not offered, and
    the way back from a flat name to the call's ``name`` and ``namespace``."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.chat_tools: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.split: dict[str, tuple[str, str]] = {}  # flat name -> (namespace, name)
        self.not_offered: list[str] = []
        for i, tool in enumerate(req.tools or []):
            if isinstance(tool, FunctionTool):
                self._add(tool, tool.name, f"tools[{i}]")
            elif isinstance(tool, NamespaceTool):
                for j, fn in enumerate(tool.tools):
                    flat = flat_name(tool.name, fn.name)
                    self.split[flat] = (tool.name, fn.name)
                    self._add(fn, flat, f"tools[{i}].tools[{j}]")
            elif tool.type in NOT_OFFERED:
                self.not_offered.append(f"tools[{i}] ({tool.type})")
            else:
                raise UnsupportedParameter(f"tools[{i}]", f"built-in tools of type '{tool.type}' are not supported; "
                                           "use function tools")

    def _add(self, tool: FunctionTool, name: str, path: str) -> None:
        fn = tool.model_dump(exclude_none=True, exclude={"type"})
        self.chat_tools.append({"type": "function", "function": {**fn, "name": name}})
        self.paths.append(path)

    def call_fields(self, flat: str) -> dict[str, str]:
        """``name`` (and ``namespace``) of a function_call item calling ``flat``."""
        if flat in self.split:
            namespace, name = self.split[flat]
            return {"name": name, "namespace": namespace}
        return {"name": flat}

    def warning(self) -> str | None:
        if not self.not_offered:
            return None
        return (f"{', '.join(self.not_offered)}: built-in tool not offered to the model (octo cannot run it)")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# -- request -> chat ------------------------------------------------------------------------------------------------
def check_unsupported(req: ResponsesRequest) -> None:
    given = req.model_fields_set
    for name in ("conversation", "prompt", "max_tool_calls"):
        if name in given and getattr(req, name) is not None:
            raise UnsupportedParameter(name)
    if req.background:
        raise UnsupportedParameter("background", "responses run in the foreground only")
    if req.reasoning is not None:  # a reasoning summary of a model that does not reason is empty: accepted
        for name in ("summary", "generate_summary"):  # (the effort is the chat's reasoning_effort: to_chat)
            if getattr(req.reasoning, name) not in (None, *REASONING_SUMMARIES):
                raise InvalidRequest(f"Invalid value for 'reasoning.{name}': expected one of "
                                     f"{', '.join(REASONING_SUMMARIES)}.", param=f"reasoning.{name}",
                                     code="invalid_value")
    if req.service_tier not in (None, "auto", "default"):
        raise UnsupportedParameter("service_tier")
    if req.text is not None and req.text.verbosity is not None:
        raise UnsupportedParameter("text.verbosity")
    for i, item in enumerate(req.include or []):
        if item not in (INCLUDE_LOGPROBS, INCLUDE_REASONING):
            raise UnsupportedParameter(f"include[{i}]", f"'{item}' is not supported (only '{INCLUDE_LOGPROBS}' "
                                       f"and '{INCLUDE_REASONING}')")
    ToolNames(req)  # refuses the built-in tools octo neither runs nor may leave out
    if req.input is None and req.previous_response_id is None:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")


def _content(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's (or a function call output's) content for the chat request: its text, or, when it holds images,
    its parts as chat content parts, one for one (``input[0].content[1]`` is ``messages[k].content[1]``)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, InputImage):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, f"{where}[{j}]")}})
        else:
            raise UnsupportedParameter(f"{where}[{j}]", f"content of type '{part.type}' is not supported")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_url(part: InputImage, where: str) -> str:
    if part.file_id is not None:
        raise UnsupportedParameter(f"{where}.file_id", "octo has no Files API; send the image as image_url, a base64 "
                                   "data URL (data:image/png;base64,...)")
    if part.image_url is None:
        raise InvalidRequest("Missing required parameter: 'image_url' (or 'file_id') of an input_image.",
                             param=f"{where}.image_url", code="missing_required_parameter")
    return part.image_url


def chat_name(item: dict[str, Any] | FunctionCallItem) -> str:
    """The function name a function_call item has in the chat conversation (flat for a namespace's function)."""
    get = item.get if isinstance(item, dict) else lambda k: getattr(item, k)
    return flat_name(get("namespace"), get("name")) if get("namespace") else get("name")


def input_messages(req: ResponsesRequest, names: ToolNames | None = None) -> list[dict[str, Any]]:
    """The request's input items as chat messages. Function calls in a row are one assistant message, followed by
    the tool messages of the outputs that answer them, in the calls' order, wherever those outputs are in the
    input (clients send parallel calls first and their outputs after: ``[call A, call B, output A, output B]``)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    items = req.input
    outputs = {item.call_id: (i, item) for i, item in enumerate(items) if isinstance(item, FunctionCallOutputItem)}
    called = {item.call_id for item in items if isinstance(item, FunctionCallItem)}
    out: list[dict[str, Any]] = []
    group: list[str] = []  # call ids of the assistant message being built
    for i, item in enumerate(items):
        if group and not isinstance(item, FunctionCallItem):
            out += [_tool_message(outputs[c][1], outputs[c][0]) for c in group if c in outputs]
            group = []
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _content(item.content, f"input[{i}].content"),
                        _FROM: (f"input[{i}]", "content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": chat_name(item), "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], _FROM: (f"input[{i}]", "")})
            group.append(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:  # answers a call of the previous response
                out.append(_tool_message(item, i))
        else:
            raise UnsupportedParameter(f"input[{i}]", f"input items of type '{item.type}' are not supported")
    out += [_tool_message(outputs[c][1], outputs[c][0]) for c in group if c in outputs]
    return out


def _tool_message(item: FunctionCallOutputItem, i: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, f"input[{i}].output"),
            _FROM: (f"input[{i}]", "output")}


def check_calls(req: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """Every ``function_call_output`` answers a call before it (of this input, or of the previous response), and
    every call is answered, in any order (matched by ``call_id``), as OpenAI's API checks."""
    last = history[-1] if history else {}
    earlier = {c["id"] for c in last.get("tool_calls") or ()}  # the previous response's calls
    calls: dict[str, int] = {}  # call_id -> its function_call item
    answered: set[str] = set()
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        if isinstance(item, FunctionCallItem):
            calls.setdefault(item.call_id, i)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls and item.call_id not in earlier:
                raise InvalidRequest(f"No function call found for the function_call_output with call_id "
                                     f"{item.call_id!r}.", param=f"input[{i}].call_id")
            answered.add(item.call_id)
    for call_id, i in calls.items():
        if call_id not in answered:
            raise InvalidRequest(f"No tool output found for function call {call_id!r}.", param=f"input[{i}]")
    for call_id in earlier - answered:
        raise InvalidRequest(f"No tool output found for function call {call_id!r} of the previous response.",
                             param="input")


@dataclass
class ChatForm:
    """A Responses request as a chat request: ``body`` (Chat Completions), ``conversation`` (to store: the history and
    the new input), ``params`` (where each chat message came from: ``messages[k]`` -> (``input[i]``, its content's
    key), for :func:`translate_error`) and ``images`` (the new input's images, named ``input[i].content[j]``; their
    ``replace`` sets the URL in ``body`` and ``conversation``, for the gateway's fetch of remote ones)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    params: dict[str, tuple[str, str]]
    images: list[ImageRef]


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatForm:
    """``req`` after ``history`` as a chat request."""
    check_calls(req, history)
    names = ToolNames(req)
    conversation = [*history, *input_messages(req, names)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise InvalidRequest("input must not be empty.", param="input")
    first = len(messages) - len(conversation)
    params = {f"messages[{first + k}]": ("previous_response_id", "") for k in range(len(history))}
    images: list[ImageRef] = []
    for k, m in enumerate(messages):
        if _FROM in m:
            params[f"messages[{k}]"] = path, key = m.pop(_FROM)
            for j, part in enumerate(m["content"] if isinstance(m.get("content"), list) else ()):
                if part["type"] == "image_url":
                    images.append(ImageRef(f"{path}.{key}[{j}]", part["image_url"]["url"],
                                           lambda url, p=part: p["image_url"].__setitem__("url", url)))
    if req.client_metadata:  # the client's own identifiers (Codex: session, thread, turn): for the server's log
        log.debug("client_metadata %s", req.client_metadata)
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if names.chat_tools:
        body["tools"] = names.chat_tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            if fmt.schema_ is None:
                raise InvalidRequest("text.format.schema is required for a json_schema format.",
                                     param="text.format.schema")
            spec = {"name": fmt.name or "response", "schema": fmt.schema_}
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            if fmt.description is not None:
                spec["description"] = fmt.description
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed"),
                         ("model", "model"), ("keep_alive", "keep_alive")):
        value = getattr(req, ours)
        if value is not None:
            body[theirs] = value
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort  # honoured on a model that reasons (chatprep.reasoning_kwargs)
    if req.include and INCLUDE_LOGPROBS in req.include:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise InvalidRequest(f"top_logprobs requires include ['{INCLUDE_LOGPROBS}'].", param="top_logprobs")
    return ChatForm(body, conversation, params, images)


_PARAMS = (("tools[", "tools["), ("reasoning_effort", "reasoning.effort"),
           ("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"),
           ("tool_choice.function.name", "tool_choice.name"), ("messages", "input"))


def translate_error(err: OctoError, req: ResponsesRequest,
                    params: dict[str, tuple[str, str]] | None = None) -> OctoError:
    """An error about the chat request named in the Responses request's terms (``text.format``, ``tools[0].name``;
    with ``params`` from :func:`to_chat`, a message's part: ``input[2].content[1]``)."""
    param = getattr(err, "param", None)
    if not param:
        return err
    message, dot, rest = param.partition("]")
    if params and dot and message + "]" in params:
        path, key = params[message + "]"]
        if key and rest.startswith(".content"):
            rest = f".{key}" + rest[len(".content"):]
        err.param = path + rest if key or not rest else path
        return err
    new = param
    if param.startswith("tools["):  # the flat list's index: the tool (or namespace member) it came from
        index, _, rest = param[len("tools["):].partition("]")
        paths = ToolNames(req).paths
        if index.isdigit() and int(index) < len(paths):
            new = paths[int(index)] + rest.replace(".function.", ".", 1).replace(".function", "", 1)
    for chat, ours in _PARAMS[1:]:
        if new.startswith(chat):
            new = ours + new[len(chat):]
            break
    if param.startswith("messages") and new.startswith("input[") and req.instructions:  # messages[0]: instructions
        new = "input"
    err.param = new
    return err


# -- results -> output items --------------------------------------------------------------------------------------
def logprob_entries(entries: list | None) -> list[dict[str, Any]]:
    def tok(b: bytes) -> str:
        return b.decode("utf-8", "replace")
    return [{"token": tok(b), "logprob": lp, "bytes": list(b),
             "top_logprobs": [{"token": tok(tb), "logprob": tlp, "bytes": list(tb)} for tb, tlp in top]}
            for b, lp, top in entries or []]


def message_item(text: str, status: str = "completed", logprobs: list | None = None,
                 item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(call: dict[str, Any], names: ToolNames, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            **names.call_fields(call["function"]["name"]), "arguments": call["function"]["arguments"],
            "status": status}


def status_of(result: Result) -> tuple[str, dict[str, Any] | None]:
    if result.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(result: Result, req: ResponsesRequest) -> list[dict[str, Any]]:
    status, _ = status_of(result)
    items = []
    if result.text or not result.tool_calls:
        items.append(message_item(result.text, status, logprob_entries(result.logprobs)))
    names = ToolNames(req)
    items += [call_item(c, names, status) for c in result.tool_calls or []]
    return items


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message of a response's output (stored, so that a later turn continues it)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": chat_name(it), "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def usage(result: Result | None) -> dict[str, Any] | None:
    if result is None:
        return None
    details = {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0}
    if result.image_tokens:  # (a request with images: how many of its input tokens they are, as on chat)
        details["image_tokens"] = result.image_tokens
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": details,
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def response_object(rid: str, req: ResponsesRequest, model: str, created: int, status: str,
                    output: list[dict[str, Any]], result: Result | None = None,
                    incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    for t in tools:
        for fn in [t] if t["type"] == "function" else t.get("tools", []) if t["type"] == "namespace" else []:
            fn.setdefault("strict", False)
            fn.setdefault("parameters", None)
            fn.setdefault("description", None)
    choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) else \
        req.tool_choice.model_dump()
    obj = {
        "id": rid, "object": "response", "created_at": created, "status": status, "background": False,
        "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": (req.reasoning.summary or req.reasoning.generate_summary) if req.reasoning else None},
        "service_tier": "default", "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": choice or "auto", "tools": tools,
        "top_logprobs": req.top_logprobs or 0, "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled", "usage": usage(result), "user": req.user,
        "metadata": req.metadata or {},
    }
    for key in ("usage", "user"):  # not nullable in OpenAI's schema: absent until known
        if obj[key] is None:
            del obj[key]
    return obj


# -- streaming ----------------------------------------------------------------------------------------------------
class EventStream:
    """Responses streaming events of one response, numbered; ``output`` collects the finished items."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str) -> None:
        self.rid, self.req, self.model = rid, req, model
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._msg: dict[str, Any] | None = None  # the message item being streamed
        self._call: dict[str, Any] | None = None  # the function_call item being streamed
        self.logprobs = bool(req.include and INCLUDE_LOGPROBS in req.include)
        self.names = ToolNames(req)

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.rid, self.req, self.model, self.created, status, self.output, **kw)

    def start(self) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=self._response("in_progress")),
                self._ev("response.in_progress", response=self._response("in_progress"))]

    def in_progress(self) -> dict[str, Any]:
        """``response.in_progress`` again: the stream's keep-alive before its first output (octo.server.keepalive)."""
        return self._ev("response.in_progress", response=self._response("in_progress"))

    def text(self, delta: str, lps: list | None = None) -> list[dict[str, Any]]:
        out = self._close_call()
        if self._msg is None:
            self._msg = message_item("", "in_progress")
            self._msg["content"] = []
            idx = len(self.output)
            out.append(self._ev("response.output_item.added", output_index=idx, item=dict(self._msg, content=[])))
            out.append(self._ev("response.content_part.added", item_id=self._msg["id"], output_index=idx,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []}))
            self._msg["_index"], self._msg["_text"], self._msg["_lps"] = idx, [], []
            self.output.append(self._msg)
        entries = logprob_entries(lps) if self.logprobs else []
        self._msg["_text"].append(delta)
        self._msg["_lps"] += entries
        out.append(self._ev("response.output_text.delta", item_id=self._msg["id"], output_index=self._msg["_index"],
                            content_index=0, delta=delta, logprobs=entries))
        return out

    def tool(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for tc in delta.get("tool_calls", []):
            fn = tc.get("function", {})
            if tc.get("id"):  # a new call
                out += self._close_message() + self._close_call()
                item = call_item({"id": tc["id"], "function": {"name": fn.get("name", ""), "arguments": ""}},
                                 self.names, "in_progress")
                idx = len(self.output)
                out.append(self._ev("response.output_item.added", output_index=idx, item=dict(item)))
                item["_index"] = idx
                self._call = item
                self.output.append(item)
            if fn.get("arguments") and self._call is not None:
                self._call["arguments"] += fn["arguments"]
                out.append(self._ev("response.function_call_arguments.delta", item_id=self._call["id"],
                                    output_index=self._call["_index"], delta=fn["arguments"]))
        return out

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        m, self._msg = self._msg, None
        if m is None:
            return []
        idx, text, lps = m.pop("_index"), "".join(m.pop("_text")), m.pop("_lps")
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
        m["content"], m["status"] = [part], status
        return [self._ev("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0, text=text,
                         logprobs=lps),
                self._ev("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=idx, item=dict(m))]

    def _close_call(self, status: str = "completed") -> list[dict[str, Any]]:
        c, self._call = self._call, None
        if c is None:
            return []
        idx = c.pop("_index")
        c["status"] = status
        return [self._ev("response.function_call_arguments.done", item_id=c["id"], output_index=idx,
                         name=c["name"], arguments=c["arguments"]),
                self._ev("response.output_item.done", output_index=idx, item=dict(c))]

    def finish(self, result: Result) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object."""
        status, incomplete = status_of(result)
        out = self._close_call(status)
        if not self.output and self._msg is None:  # an empty answer is still a message
            out += self.text("")
        out += self._close_message("incomplete" if status == "incomplete" else "completed")
        final = self._response(status, result=result, incomplete=incomplete)
        out.append(self._ev("response.completed" if status == "completed" else "response.incomplete",
                            response=final))
        return out, final

    def failed(self, err: OctoError) -> dict[str, Any]:
        self._msg = self._call = None
        self.output = [{k: v for k, v in it.items() if not k.startswith("_")} for it in self.output]
        return self._ev("response.failed", response=self._response(
            "failed", error={"code": err.code or "server_error", "message": err.message}))
