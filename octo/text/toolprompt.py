"""Tools in the prompt: adapting OpenAI messages with tool calls and tool results, and the offered tools, to a
template family (:func:`prepare_chat`), and the system prompt that describes tools to a template without tool
support (:func:`tool_system_prompt`). The formats themselves, and the parsers of what a model writes, are in
``octo.text.toolcalls``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from octo.text.toolcalls import ToolFormat, args_obj, get_format


# -- prompts for templates ----------------------------------------------------------------------------------------
def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] if t.get("type", "function") == "function" and "function" in t else t for t in tools]


def tool_system_prompt(tools: list[dict[str, Any]], fmt: ToolFormat | str, tool_choice: Any = "auto") -> str:
    """A system prompt describing ``tools`` and how to call them in ``fmt``, for templates without tool support."""
    fmt = get_format(fmt)
    funcs = _functions(tools)
    example = fmt.render_calls([{"function": {"name": funcs[0]["name"] if funcs else "function_name",
                                              "arguments": {"argument": "value"}}}])
    lines = [
        "You can call the following functions. Their definitions (JSON Schema parameters):",
        json.dumps(funcs, ensure_ascii=False, indent=2),
        "",
        f"To call a function, answer with exactly this format (one call per block; {fmt.args_key} must follow the "
        "function's parameters schema):",
        example,
        "Call a function only when it helps; otherwise answer normally. Function results come back in "
        "<tool_response></tool_response> tags.",
    ]
    if tool_choice == "required":
        lines.append("You must call at least one function now.")
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        lines.append(f"You must call the function {name} now.")
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


@dataclass
class ChatInput:
    """What to hand the chat template: messages (and ``tools`` for templates that render them)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def prepare_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat | str,
                 tool_choice: Any = "auto") -> ChatInput:
    """Adapt OpenAI messages (assistant ``tool_calls``, ``tool`` results) and tools to the family's template.

    - "template": tools go to the template's ``tools`` variable; call arguments become objects (templates apply
      ``tojson`` to them).
    - "system_field" (Phi-4-mini): the tool list is a JSON string in the system message's ``tools`` field.
    - "prompt": :func:`tool_system_prompt` is prepended to the system message, earlier calls become the family's
      text, tool results become user turns, and consecutive turns of one role are merged (Gemma's template
      requires alternating roles).
    """
    fmt = get_format(fmt)
    if fmt.tools_in == "template":
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": args_obj(c)}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return ChatInput(out, tools or None)
    names = {c.get("id"): c["function"]["name"] for m in messages for c in (m.get("tool_calls") or [])}
    rendered: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), _text(m.get("content"))
        if role == "tool":
            body = json.dumps({"name": names.get(m.get("tool_call_id"), m.get("name")), "content": content},
                              ensure_ascii=False)
            role, content = "user", f"<tool_response>\n{body}\n</tool_response>"
        elif role == "assistant" and m.get("tool_calls"):
            content = (content + "\n" if content else "") + fmt.render_calls(m["tool_calls"])
        if role == "developer":
            role = "system"
        if rendered and rendered[-1]["role"] == role and role != "system":
            rendered[-1]["content"] += "\n\n" + content
        else:
            rendered.append({"role": role, "content": content})
    if tools:
        if not rendered or rendered[0]["role"] != "system":
            rendered.insert(0, {"role": "system", "content": ""})
        if fmt.tools_in == "system_field":
            rendered[0]["tools"] = json.dumps(_functions(tools), ensure_ascii=False)
        else:
            prompt = tool_system_prompt(tools, fmt, tool_choice)
            rendered[0]["content"] = (rendered[0]["content"] + "\n\n" if rendered[0]["content"] else "") + prompt
    return ChatInput(rendered, None)
