"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) on top of the chat machinery: no aiohttp here.

A request becomes OpenAI chat messages and tools (:func:`chat_input`): the system text a system message,
``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result`` blocks ``tool`` messages (an ``is_error``
result reads "Error: ..."), custom tools OpenAI function tools, ``tool_choice`` OpenAI's (``any``: required, ``tool``:
a named function, ``disable_parallel_tool_use``: at most one call). Deferred tools (``defer_loading``) stay out of the
prompt until a ``tool_reference`` loads them, and the server-side tool search is offered as a function
(octo.serving.anthropic_tools). The worker then renders, constrains and parses it through octo.serving.chatprep
exactly as a chat request; a final assistant message is a prefill, continued (``chatprep.render_continue``), and the
answer holds only the continuation, as Anthropic's does. A model that reasons, asked to think, has its ``<think>``
text split out where it runs (``GenerationRequest.reasoning``); any other model's text streams as it comes. The
answer is shaped in the gateway by octo.serving.anthropic_answer.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from octo.engine import SamplingParams, Task
from octo.errors import InvalidRequest, UnsupportedParameter
from octo.protocol.anthropic import (
    AnthropicCountTokensRequest,
    AnthropicRequest,
    Base64Source,
    FileSource,
    ImageBlock,
    RedactedThinkingBlock,
    ServerToolUseBlock,
    TextBlock,
    ThinkingBlock,
    ToolChangeBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolSearchResultBlock,
    ToolUseBlock,
    UrlSource,
)
from octo.scheduler.jobs import GenerationRequest
from octo.serving import chatprep, media
from octo.serving.anthropic_tools import SEARCH_NAMES, ToolSet, result_text
from octo.serving.media import ImageRef
from octo.serving.openai import require, unsupported_if
from octo.text import toolsearch
from octo.text.reasoning import prompt_opens_thinking, supports_thinking, template_source

_ALNUM = string.ascii_letters + string.digits
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
    tools: list[dict[str, Any]] | None  # what the model may call (constraints compile these)
    names: list[str]
    choice: Any  # OpenAI tool_choice: None, "auto", "required", "none" or a named function
    parallel: bool | None
    prompt_tools: list[dict[str, Any]] | None = None  # what the prompt lists (deferred tools are not in it)
    effort: str | None = None  # output_config.effort, the last system turn's own where one sets it
    images: list[ImageRef] | None = None  # the images of user turns and tool results, in the order sent


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


def _messages(req: AnthropicCountTokensRequest, tools: ToolSet, images: list[ImageRef]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    open_calls: dict[str, int] = {}  # tool_use id -> the message that made the call, until its result comes
    last_user = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1)
    for i, m in enumerate(req.messages):
        if not m.content and not (m.role == "assistant" and i == len(req.messages) - 1) \
                and not (m.role == "system" and m.output_config is not None):  # "" or []
            raise InvalidRequest(f"messages.{i}: all messages must have non-empty content except for the optional "
                                 "final assistant message", param=f"messages[{i}].content")
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":  # a mid-conversation system turn, where it was sent
            _system_turn(req, i, open_calls, out, tools, shown=m.clear_at != "next_user_message" or i > last_user)
            continue
        for key in ("clear_at", "output_config"):
            if getattr(m, key) is not None:
                raise InvalidRequest(f"messages.{i}.{key}: only permitted on `role: \"system\"` messages.",
                                     param=f"messages[{i}].{key}")
        if m.role == "assistant":
            _assistant_turn(i, blocks, open_calls, out, tools)
        else:
            _user_turn(i, blocks, open_calls, out, tools, images)
    if open_calls:
        raise _unanswered(open_calls)
    if out and out[-1]["role"] == "assistant" and not out[-1]["content"] and not out[-1].get("tool_calls"):
        out.pop()  # an empty final assistant message prefills nothing
    return out


def _system_turn(req: Any, i: int, open_calls: dict[str, int], out: list[dict[str, Any]], tools: ToolSet,
                 shown: bool) -> None:
    """A system turn inside ``messages`` (``clear_at: "next_user_message"``: shown only until a user turn follows)."""
    if i == 0:
        raise InvalidRequest("messages.0.role: a conversation cannot start with a system turn; the system "
                             "prompt goes in the top-level `system` parameter.", param="messages[0].role")
    if open_calls:
        raise _unanswered(open_calls)
    content = req.messages[i].content
    if isinstance(content, list) and any(isinstance(b, ToolChangeBlock) for b in content):
        text = _tool_changes(content, f"messages[{i}].content", tools)
    else:
        text = _text(content, f"messages[{i}].content")
    if text and shown:
        out.append({"role": "system", "content": text})


def _tool_changes(blocks: list[Any], where: str, tools: ToolSet) -> str:
    """A system turn's text with its ``tool_addition`` blocks (the tool's definition, expanded there, as a
    ``tool_reference``) and ``tool_removal`` blocks (a line saying so; it can no longer be forced)."""
    parts = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append(b.text)
            continue
        if not isinstance(b, ToolChangeBlock):
            raise UnsupportedParameter(f"{where}[{j}]", f"content blocks of type '{b.type}' are not supported")
        if b.tool.type != "tool_reference" or not b.tool.name:
            raise UnsupportedParameter(f"{where}[{j}].tool", f"a {b.type} of a '{b.tool.type}' is not supported "
                                       "(octo takes a tool_reference to a tool in tools)")
        if b.type == "tool_addition":
            parts.append(toolsearch.expansion([tools.reference(b.tool.name, f"{where}[{j}].tool.name")]))
        else:
            tools.remove(b.tool.name, f"{where}[{j}].tool.name")
            parts.append(f"The tool {b.tool.name} is no longer available.")
    return "\n".join(p for p in parts if p)


def _call(b: Any) -> dict[str, Any]:
    return {"id": b.id, "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}


def _assistant_turn(i: int, blocks: list[Any], open_calls: dict[str, int], out: list[dict[str, Any]],
                    tools: ToolSet) -> None:
    """An assistant turn (``messages[i]``): its text and tool calls as chat messages; its calls are open until a user
    turn answers them. A tool search (``server_tool_use``) is answered in the turn itself by its
    ``tool_search_tool_result``, which becomes a tool message: what follows it is a new assistant message."""
    if open_calls:
        raise _unanswered(open_calls)
    texts, calls, searches = [], [], {}  # searches: server_tool_use id -> its block's index, until its result
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock | ServerToolUseBlock):
            if b.id in open_calls or b.id in searches:
                raise InvalidRequest(f"messages.{i}.content.{j}: `{b.type}` ids must be unique: {b.id}.",
                                     param=f"{where}.id")
            if isinstance(b, ServerToolUseBlock):
                if b.name not in SEARCH_NAMES:
                    raise UnsupportedParameter(where, f"server tool '{b.name}' is not supported (octo runs only "
                                               f"{' and '.join(SEARCH_NAMES)})")
                searches[b.id] = j
            else:
                open_calls[b.id] = i
            calls.append(_call(b))
        elif isinstance(b, ToolSearchResultBlock):
            if searches.pop(b.tool_use_id, None) is None:
                raise InvalidRequest(f"messages.{i}.content.{j}: `tool_search_tool_result` block must follow its "
                                     f"`server_tool_use` block in the same message: {b.tool_use_id}.",
                                     param=f"{where}.tool_use_id")
            _append(out, _assistant_message(texts, calls))
            texts, calls = [], []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result_text(b.content, tools,
                                                                                              where)})
        elif isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            continue  # earlier reasoning is not shown to the model again (as chat templates drop it)
        elif isinstance(b, ToolResultBlock):
            raise InvalidRequest(f"messages.{i}.content.{j}: `tool_result` blocks can only be in `user` "
                                 "messages.", param=where)
        elif b.type != "fallback":  # a fallback block only says which model answered: nothing for the model
            raise UnsupportedParameter(where, f"content blocks of type '{b.type}' are not supported")
    if searches:
        raise InvalidRequest(f"messages.{i}: `server_tool_use` ids were found without `tool_search_tool_result` "
                             f"blocks after them: {', '.join(searches)}.", param=f"messages[{i}]")
    if texts or calls or not out or out[-1]["role"] != "tool":
        _append(out, _assistant_message(texts, calls))


def _assistant_message(texts: list[str], calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_turn(i: int, blocks: list[Any], open_calls: dict[str, int], out: list[dict[str, Any]],
               tools: ToolSet, images: list[ImageRef]) -> None:
    """A user turn (``messages[i]``): its text and images, and its tool results as tool messages in place; each must
    answer one of the previous turn's calls, and all of them must be answered."""
    texts: list[str | int] = []  # an int: an image, its number in the request (octo.serving.media.join_parts)
    answered = 0
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ImageBlock):
            texts.append(_image(b, where, images))
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in open_calls:
                raise InvalidRequest(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                                     f"blocks: {b.tool_use_id}. Each `tool_result` block must have a corresponding "
                                     "`tool_use` block in the previous message.", param=f"{where}.tool_use_id")
            del open_calls[b.tool_use_id]
            if texts:  # text before the result keeps its place
                _append(out, {"role": "user", "content": _joined(texts)})
                texts = []
            result = _result(b.content, f"{where}.content", tools, images)
            if b.is_error:
                result = f"Error: {result}" if result else "Error"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            answered += 1
        elif isinstance(b, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock | ServerToolUseBlock
                        | ToolSearchResultBlock):
            raise InvalidRequest(f"messages.{i}.content.{j}: `{b.type}` blocks can only be in `assistant` "
                                 "messages.", param=where)
        else:
            raise UnsupportedParameter(where, f"content blocks of type '{b.type}' are not supported")
    if open_calls:
        raise _unanswered(open_calls)
    if texts or not answered:
        _append(out, {"role": "user", "content": _joined(texts)})


def _joined(texts: list[str | int]) -> str:
    """Text blocks as one text; with images, joined as llama-server joins a message's parts (octo.serving.media)."""
    return media.join_parts(texts) if any(isinstance(t, int) for t in texts) else "".join(texts)  # type: ignore


def _image(b: ImageBlock, where: str, images: list[ImageRef]) -> int:
    """An image block of the request, as its number in the request's images."""
    if isinstance(b.source, FileSource):
        raise UnsupportedParameter(f"{where}.source", "octo has no Files API; send the image base64 encoded "
                                   "(source.type 'base64')")
    if b.transformations is not None and b.transformations.oversized_image == "error":
        raise UnsupportedParameter(f"{where}.transformations.oversized_image", "the model's projector scales every "
                                   "image to its own size; only 'downsize' is honoured")
    url = media.base64_url(b.source.data, b.source.media_type) if isinstance(b.source, Base64Source) else b.source.url
    images.append(ImageRef(where, url))
    return len(images) - 1


def with_path(err: InvalidRequest) -> InvalidRequest:
    """An image's 400 as Anthropic words its errors: the message starts with the block's path
    (``messages.0.content.1: ...``), since Anthropic's error shape has no ``param``."""
    if err.param:
        path = re.sub(r"\[(\d+)\]", r".\1", err.param)
        if not err.message.startswith(path):
            err.message = f"{path}: {err.message}"
    return err


def image_refs(req: AnthropicCountTokensRequest) -> list[ImageRef]:
    """The request's image blocks (user turns', tool results'), for the gateway to fetch the remote ones: a URL
    source's ``replace`` sets its URL to the data URL of what was fetched."""
    refs: list[ImageRef] = []
    for i, m in enumerate(req.messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
            inner = b.content if isinstance(b, ToolResultBlock) and isinstance(b.content, list) else ()
            for where, block in [(f"messages[{i}].content[{j}]", b),
                                 *((f"messages[{i}].content[{j}].content[{k}]", c) for k, c in enumerate(inner))]:
                if isinstance(block, ImageBlock):
                    src = block.source
                    url = src.url if isinstance(src, UrlSource) else "data:"
                    refs.append(ImageRef(where, url, lambda u, s=src: setattr(s, "url", u)))
    return refs


def _result(content: Any, where: str, tools: ToolSet, images: list[ImageRef]) -> str:
    """A tool result's text: its text blocks, its images (a screenshot) where they stand, and the definitions of the
    tools its ``tool_reference`` blocks load (a client-side tool search, as Claude Code's ToolSearch), expanded where
    the references stand."""
    if not isinstance(content, list):
        return _text(content, where)
    texts: list[str | int] = []
    fns = []
    for k, b in enumerate(content):
        if isinstance(b, ToolReferenceBlock):
            fns.append(tools.reference(b.tool_name, f"{where}[{k}].tool_name"))
        elif isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ImageBlock):
            texts.append(_image(b, f"{where}[{k}]", images))
        else:
            raise UnsupportedParameter(f"{where}[{k}]", f"content blocks of type '{b.type}' are not supported")
    return "\n".join(t for t in (_joined(texts), toolsearch.expansion(fns) if fns else "") if t)


def anthropic_paths(err: InvalidRequest) -> InvalidRequest:
    """An error about the chat form of the tools named in Anthropic's terms: ``tools[3].input_schema``, not
    ``tools[3].function.parameters`` (the message names the path too)."""
    for chat, ours in ((".function.parameters", ".input_schema"), (".function.", ".")):
        err.message = err.message.replace(chat, ours)
        if err.param:
            err.param = err.param.replace(chat, ours)
    return err


def chat_input(req: AnthropicCountTokensRequest) -> ChatInput:
    toolset = ToolSet.of(req.tools)
    images: list[ImageRef] = []
    messages = _messages(req, toolset, images)  # the tool references in the history load deferred tools
    tools: list[dict[str, Any]] | None = None
    names: list[str] = []
    callable_fns = toolset.callable()
    if callable_fns:
        tools = [{"type": "function", "function": fn} for fn in callable_fns]
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
        if tc.type == "tool" and tc.name in toolset.deferred and tc.name not in toolset.loaded:
            raise InvalidRequest(f"tool_choice names tool {tc.name!r}, which is deferred (defer_loading) and not "
                                 "loaded by a tool_reference in the conversation.", param="tool_choice.name")
        if tools or tc.type in ("any", "tool"):  # auto or none without tools: nothing to choose
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
                {"type": "function", "function": {"name": tc.name}}
    chatprep.check_tool_choice(choice, names, bool(tools))
    prompt_tools = [{"type": "function", "function": fn} for fn in toolset.in_prompt()] or None
    turns = [m.output_config.effort for m in req.messages if m.role == "system" and m.output_config is not None
             and m.output_config.effort is not None]
    effort = turns[-1] if turns else (req.output_config.effort if req.output_config is not None else None)
    return ChatInput(messages, tools, names, choice, parallel, prompt_tools, effort, images)


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
    """The template arguments of the request's ``thinking`` setting (None: the template takes none). A model with
    no reasoning mode answers directly whatever the setting (adaptive, between_tools and enabled alike): its text
    streams as it comes, with no thinking block (Claude Code sends adaptive thinking to every model)."""
    th, engine = req.thinking, handle.engine
    reasons = supports_thinking(engine)
    if thinking_enabled(req) and th.type == "enabled":
        if th.budget_tokens is None:
            raise InvalidRequest("thinking.budget_tokens: Field required.", param="thinking.budget_tokens",
                                 code="missing_required_parameter")
        if th.budget_tokens < MIN_THINKING_BUDGET:
            raise InvalidRequest(f"thinking.budget_tokens: Input should be greater than or equal to "
                                 f"{MIN_THINKING_BUDGET}.", param="thinking.budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and th.budget_tokens >= max_tokens:
            raise InvalidRequest("`max_tokens` must be greater than `thinking.budget_tokens`.", param="max_tokens")
    return {"enable_thinking": thinking_enabled(req)} if reasons else None


# -- prompt and generation ------------------------------------------------------------------------------------------
def _prompt(handle: Any, req: AnthropicCountTokensRequest) -> tuple[list[int], tuple, ChatInput, Any, str]:
    """The prompt tokens of a request (as a real request renders them), its images' media chunks, its chat input,
    tool format and text."""
    require(handle, Task.CHAT)
    unsupported_if(req, ("mcp_servers", "container"))
    if req.output_config is not None and req.output_config.task_budget is not None:
        raise UnsupportedParameter("output_config.task_budget", "the model is not told a task budget here")
    _check_context_management(req)
    engine = handle.engine
    inp = chat_input(req)
    try:
        images = media.load_images(handle, inp.images) if inp.images else None  # 400s naming the block or the model
    except InvalidRequest as err:
        raise with_path(err) from None
    template_kwargs = _check_thinking(handle, req)
    if inp.effort not in (None, "high"):  # "high" is Anthropic's default: the model as it always answers
        if "reasoning_effort" not in template_source(engine):
            raise UnsupportedParameter(_effort_param(req), f"model '{handle.name}' has no effort setting (its chat "
                                       "template takes no reasoning_effort); only the default \"high\" is accepted")
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": inp.effort}
    fmt = chatprep.tool_format(engine, getattr(handle, "tool_format", None))
    prompt = chatprep.render_continue(engine, inp.messages, inp.prompt_tools, fmt, inp.choice, template_kwargs)
    tokens, chunks = media.tokenize(engine, prompt, images) if images else (engine.tokenize(prompt, special=True), ())
    return tokens, chunks, inp, fmt, prompt


def _effort_param(req: AnthropicCountTokensRequest) -> str:
    """Where the effort in force was set: the last system turn that sets one, else the top-level output_config."""
    for i in range(len(req.messages) - 1, -1, -1):
        m = req.messages[i]
        if m.role == "system" and m.output_config is not None and m.output_config.effort is not None:
            return f"messages[{i}].output_config.effort"
    return "output_config.effort"


def refuse_threads(req: AnthropicRequest) -> None:
    """``thread`` (server-side conversation threads, beta): octo keeps none. The refusal is the one Anthropic's API
    gives a request it cannot thread (``error.details.error_code`` ``thread_unsupported_request``), on which the SDK's
    tool runner goes on without a thread, sending the whole conversation."""
    if req.thread is not None:
        err = InvalidRequest("thread: octo keeps no server-side threads; send the whole conversation in `messages` "
                             "without `thread`.", param="thread", code="thread_unsupported_request")
        err.details = {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
        raise err


def count_tokens(handle: Any, req: AnthropicCountTokensRequest) -> int:
    return len(_prompt(handle, req)[0])  # (an image's positions count, as in usage)


def generation(handle: Any, req: AnthropicRequest) -> GenerationRequest:
    if req.service_tier not in (None, "auto", "standard_only"):
        raise UnsupportedParameter("service_tier")
    tokens, chunks, inp, fmt, prompt = _prompt(handle, req)
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
    # thinking blocks: a model that reasons, asked to, has its <think> text split out where it runs (Reasoning
    # events); any other model's text streams as it comes
    reasons = thinking_enabled(req) and supports_thinking(engine)
    return GenerationRequest(tokens, sp, max_tokens, list(req.stop_sequences or []), req.stream,
                             grammar=grammar, tools=chatprep.tool_spec(fmt, inp.names, inp.choice, inp.parallel),
                             reasoning=reasons, reasoning_opened=reasons and prompt_opens_thinking(prompt),
                             media=chunks)
