"""Chat requests with tools, structured output and logprobs -> prompt tokens and GenerationRequest fields.

Shared by every API surface that ends in a chat generation (Chat Completions here; the Responses API and Anthropic
Messages convert their shapes to OpenAI's messages and tools and call the same functions), so tool rendering,
tool-call parsing and constraints exist once:

- :func:`tool_format` picks the model's tool-call family from its chat template (``--tool-format`` overrides).
- :func:`render` adapts the history (assistant ``tool_calls``, ``tool`` results) and ``tools`` to that family
  (``octo.text.toolcalls.prepare_chat``) and renders it through the model's own template.
- :func:`constraint_for` turns ``response_format`` / ``tool_choice`` into an ``octo.text.constrain.Constraint``;
  :func:`compile_for` checks the engine can apply it and compiles it against the engine's vocabulary (a 400 naming
  the field for a bad schema, before anything is queued).
"""

from __future__ import annotations

import re
from typing import Any

from octo.errors import InvalidRequest, UnsupportedParameter
from octo.scheduler.jobs import ToolSpec
from octo.text.toolcalls import FORMATS, ToolFormat, detect_format
from octo.text.toolprompt import prepare_chat

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit on functions per request


def tool_format(engine: Any, override: str | None = None) -> ToolFormat:
    """The tool-call format of ``engine``'s model (cached on the engine; ``override``: a family name)."""
    key = override or ""
    cached = getattr(engine, "_octo_tool_format", None)
    if cached is not None and cached[0] == key and cached[1] is engine.info:
        return cached[2]
    try:
        source = engine.chat_template()
    except Exception:  # noqa: BLE001 - an engine without the method's data: the documented fallback
        source = None
    fmt = detect_format(source, override or None)
    try:
        engine._octo_tool_format = (key, engine.info, fmt)
    except AttributeError:
        pass
    return fmt


def check_tools(tools: list[dict[str, Any]], param: str = "tools") -> list[str]:
    """The function names of OpenAI function ``tools`` (plain dicts); a 400 naming the tool for a bad or repeated
    name."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"At most {MAX_TOOLS} tools are allowed per request, got {len(tools)}.", param=param)
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not _NAME.match(name):
            raise InvalidRequest(f"Invalid function name {name!r}: use 1 to 64 letters, digits, underscores or dashes.",
                                 param=f"{param}[{i}].function.name")
        if name in names:
            raise InvalidRequest(f"Function {name!r} appears more than once in tools.",
                                 param=f"{param}[{i}].function.name")
        names.append(name)
    return names


def check_tool_choice(choice: Any, names: list[str], has_tools: bool) -> None:
    if choice is None:
        return
    if not has_tools and choice != "none":
        raise InvalidRequest("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                             "specified.", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools.",
                                 param="tool_choice.function.name")


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with every system message after the first turn moved into the leading system message (for
    templates that refuse a system turn anywhere else), or None when there is none to move."""
    late = [m for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]
    if not late:
        return None
    head = [m for i, m in enumerate(messages) if i == 0 or m.get("role") != "system"]
    text = "\n\n".join(m["content"] for m in late if isinstance(m.get("content"), str) and m["content"])
    if head and head[0].get("role") == "system":
        head[0] = {**head[0], "content": "\n\n".join(t for t in (head[0].get("content") or "", text) if t)}
    else:
        head.insert(0, {"role": "system", "content": text})
    return head


def _folding(render_fn):
    """A render function that, when the template rejects a system turn after the first, renders again with the late
    system messages folded into the first (OpenAI and Anthropic take system turns anywhere; many templates do not)."""
    import functools

    @functools.wraps(render_fn)
    def wrapper(engine: Any, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        try:
            return render_fn(engine, messages, *args, **kwargs)
        except InvalidRequest:
            folded = fold_late_system(messages)
            if folded is None:
                raise
            return render_fn(engine, folded, *args, **kwargs)
    return wrapper


@_folding
def render(engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat,
           tool_choice: Any = "auto", template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a chat history with tools, through the model's own template (``template_kwargs``, e.g.
    ``enable_thinking``, where its ``render_chat`` takes them)."""
    chat = prepare_chat(messages, tools, fmt, tool_choice if tool_choice is not None else "auto")
    return _render_chat(engine, chat.messages, True, chat.tools, template_kwargs)


# OpenAI's reasoning efforts (and the tiers clients add) as Ollama maps them onto its think levels
# (thinkFromReasoningEffort in Ollama's openai/openai.go): False turns thinking off
EFFORTS: dict[str, str | bool] = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                                  "xhigh": "max", "ultra": "max", "max": "max"}


def reasoning_kwargs(handle: Any, effort: str, param: str = "reasoning_effort") -> dict[str, Any] | None:
    """The template arguments of an OpenAI reasoning effort, as Ollama's ``think`` levels: on a model whose template
    reasons, "none" turns thinking off and any level on (the level reaches a template that takes
    ``reasoning_effort``, "max" as "high"); on a model that does not reason, "none" is accepted and a level is a 400
    naming ``param``, as OpenAI answers for its models without reasoning."""
    from octo.text.reasoning import supports_thinking, template_source

    if effort not in EFFORTS:
        raise InvalidRequest(f"Invalid value for '{param}': expected one of {', '.join(EFFORTS)}.", param=param,
                             code="invalid_value")
    level, engine = EFFORTS[effort], handle.engine
    if not supports_thinking(engine):
        if level is False:
            return None
        raise UnsupportedParameter(param, f"model '{handle.name}' does not reason (its chat template has no "
                                   "reasoning mode); leave it out or send \"none\"")
    if level is False:
        return {"enable_thinking": False}
    kwargs: dict[str, Any] = {"enable_thinking": True}
    if "reasoning_effort" in template_source(engine):
        kwargs["reasoning_effort"] = "high" if level == "max" else level
    return kwargs


def tool_spec(fmt: ToolFormat, names: list[str], tool_choice: Any, parallel: bool | None = None) -> ToolSpec | None:
    """How to parse calls out of the output: None when there are no tools or tool_choice is "none";
    ``parallel`` False keeps the first call only (a constrained choice allows only one anyway); ``forced`` (a
    constrained call) streams its arguments as they are generated (``octo.text.toolcalls.ToolCallParser`` ``live``)."""
    if not names or tool_choice == "none":
        return None
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    return ToolSpec(fmt, tuple(names), single=parallel is False, forced=forced)


def constraint_for(response_format: dict[str, Any] | None, tools: list[dict[str, Any]] | None, tool_choice: Any,
                   parallel_tool_calls: bool | None, fmt: ToolFormat, rf_param: str = "response_format") -> Any:
    """The output constraint of a request, or None: a JSON response format, or (``tool_choice`` "required" or a
    named function) a valid call. "auto" is not constrained: a model that answers in text gives a message."""
    forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, dict))
    if not forced and not response_format:
        return None
    from octo.text.constrain import Constraint

    rf = Constraint.from_response_format(response_format, param=rf_param) if response_format else None
    if forced and rf is not None:
        raise InvalidRequest(f"{rf_param} cannot be combined with tool_choice {_choice_text(tool_choice)}: the output "
                             "is then a tool call.", param=rf_param)
    if forced:
        return Constraint.tool_calls(tools, tool_choice, True if parallel_tool_calls is None else parallel_tool_calls,
                                     fmt, param="tool_choice")
    return rf


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice['function']['name']!r}"


def compile_for(engine: Any, constraint: Any) -> Any:
    """``constraint`` compiled for ``engine``'s vocabulary (an ``octo.text.constrain.Grammar``), or None."""
    if constraint is None:
        return None
    if not getattr(engine, "supports_masks", False):
        raise UnsupportedParameter(constraint.param.split(".")[0],
                                   f"the {engine.name} engine cannot constrain its output")
    from octo.text.constrain import compile_constraint, vocab_for

    return compile_constraint(constraint, vocab_for(engine))


def logprobs_count(engine: Any, n: int | None, param: str = "logprobs") -> int:
    """-1 when ``n`` is None (off), else ``n`` alternatives per token; a 400 when the engine cannot report them."""
    if n is None:
        return -1
    if not getattr(engine, "supports_logprobs", False):
        raise UnsupportedParameter(param, f"the {engine.name} engine does not report logprobs")
    return int(n)


KNOWN_FORMATS = tuple(FORMATS)


@_folding
def render_continue(engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat,
                    tool_choice: Any = "auto", template_kwargs: dict[str, Any] | None = None) -> str:
    """Like :func:`render`, but a final assistant message with text (a prefill) is continued, not closed: the history
    is rendered with that text replaced by a unique marker and no generation prompt, the rendering is cut just before
    the marker and the real text appended, so the model writes on from it inside the same turn. Without such a
    message it is :func:`render`. ``template_kwargs`` (e.g. ``enable_thinking``) reach the template when the engine's
    ``render_chat`` takes them."""
    last = messages[-1] if messages else {}
    prefix = last.get("content") if last.get("role") == "assistant" and not last.get("tool_calls") else None
    choice = tool_choice if tool_choice is not None else "auto"
    if not isinstance(prefix, str) or not prefix:
        chat = prepare_chat(messages, tools, fmt, choice)
        return _render_chat(engine, chat.messages, True, chat.tools, template_kwargs)
    import secrets

    marker = f"octoprefill{secrets.token_hex(8)}"
    chat = prepare_chat([*messages[:-1], {**last, "content": marker}], tools, fmt, choice)
    text = _render_chat(engine, chat.messages, False, chat.tools, template_kwargs)
    cut = text.rfind(marker)
    if cut < 0:  # the template dropped or rewrote the message: open a new assistant turn and start it with the text
        chat = prepare_chat(messages[:-1], tools, fmt, choice)
        return _render_chat(engine, chat.messages, True, chat.tools, template_kwargs) + prefix
    return text[:cut] + prefix


def _render_chat(engine: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None) -> str:
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if template_kwargs and _takes(engine.render_chat, template_kwargs):
        extra.update(template_kwargs)
    return engine.render_chat(messages, add_generation_prompt, **extra)


def _takes(fn: Any, names: dict[str, Any]) -> bool:
    """Whether ``fn`` accepts these keyword arguments (by name or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(name in params for name in names)
