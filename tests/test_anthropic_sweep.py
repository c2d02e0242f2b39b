"""Every field of the installed ``anthropic`` SDK's request types against what octo does with it on `/v1/messages`.

The sweep walks the SDK's TypedDicts (``MessageCreateParams``, the beta one, and every type reachable from them: the
message roles, each content block type, what a tool result holds, each tool type, tool choice, thinking,
``output_config``, context edits) and keys each field as ``surface.type.field`` (``block.tool_use.toolset_name``).
:data:`DECISIONS` says what octo does with each, as docs/api.md does: ``honoured``; ``ignored`` (accepted, with no
effect: the reason is in docs/api.md); ``refused`` (a 400 naming it: ignoring it would silently change the answer);
``header`` (the SDK sends it as an HTTP header); ``engine`` (honoured where the engine constrains its output; the
echo engine cannot, so a 400 naming that); ``vision`` (honoured on a model that takes images; the echo engine takes
none, so a 400 naming the model: tests/test_vision_apis_functional.py sends them to demo-vision). A type octo
refuses whole is one key (``block.document``).

A field a newer SDK adds fails :func:`test_every_sdk_field_has_a_decision` until it is decided here and in the docs;
each decision is then checked against a real `octo serve` (the echo engine with ``think=1``, so that thinking can be
enabled) by sending a request that sets the field, built from the SDK's own type (required fields, plus the one under
test), and, for the response side, the SDK's response models rebuilt with ``model_dump()``."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
from serverproc import run_octo

anthropic = pytest.importorskip("anthropic")
from anthropic.types import message_create_params as create_params  # noqa: E402
from anthropic.types.beta import message_create_params as beta_create_params  # noqa: E402

MODEL = "test-model"
H, IGN, R, X, E, V = "honoured", "ignored", "refused", "header", "engine", "vision"

# whole types octo refuses: content it cannot show the model, tools it cannot run, edits it does not make
REFUSED_TYPES = {
    "block": ("advisor_tool_result", "bash_code_execution_tool_result", "code_execution_tool_result", "compaction",
              "container_upload", "document", "mcp_tool_listing", "mcp_tool_result", "mcp_tool_use",
              "search_result", "text_editor_code_execution_tool_result", "web_fetch_tool_result",
              "web_search_tool_result"),
    "result_part": ("browser_state", "document", "search_result"),
    "tool": ("advisor_20260301", "bash_20241022", "bash_20250124", "browser_toolset_20260801",
             "code_execution_20250522", "code_execution_20250825", "code_execution_20260120",
             "code_execution_20260521", "computer_20241022", "computer_20250124", "computer_20251124",
             "computer_toolset_20260801", "mcp_toolset", "memory_20250818", "text_editor_20241022",
             "text_editor_20250124", "text_editor_20250429", "text_editor_20250728", "web_fetch_20250910",
             "web_fetch_20260209", "web_fetch_20260309", "web_fetch_20260318", "web_search_20250305",
             "web_search_20260209", "web_search_20260318"),
    "edit": ("clear_tool_uses_20250919", "compact_20260112"),
}

DECISIONS: dict[str, str] = {
    **{f"{surface}.{t}": R for surface, names in REFUSED_TYPES.items() for t in names},
    # the request
    "request.betas": X, "request.user_profile_id": X, "request.workspace_id": X,
    "request.billing_policy": IGN, "request.cache_control": IGN, "request.compaction": IGN, "request.diagnostics": IGN,
    "request.fallback_credit_token": IGN, "request.fallbacks": IGN, "request.inference_geo": IGN,
    "request.metadata": IGN, "request.service_tier": IGN, "request.speed": IGN,
    "request.container": R, "request.mcp_servers": R, "request.thread": R,
    "request.context_management": H, "request.max_tokens": H, "request.messages": H, "request.model": H,
    "request.output_config": H, "request.stop_sequences": H, "request.stream": H, "request.system": H,
    "request.thinking": H, "request.tool_choice": H, "request.tools": H,
    # messages
    "message.user.role": H, "message.user.content": H, "message.assistant.role": H, "message.assistant.content": H,
    "message.system.role": H, "message.system.content": H, "message.system.clear_at": H,
    "message.system.output_config": H,
    # content blocks
    "block.text.type": H, "block.text.text": H, "block.text.cache_control": IGN, "block.text.citations": IGN,
    "block.thinking.type": IGN, "block.thinking.thinking": IGN, "block.thinking.signature": IGN,
    "block.redacted_thinking.type": IGN, "block.redacted_thinking.data": IGN,
    "block.tool_use.type": H, "block.tool_use.id": H, "block.tool_use.name": H, "block.tool_use.input": H,
    "block.tool_use.cache_control": IGN, "block.tool_use.caller": IGN, "block.tool_use.toolset_name": IGN,
    "block.tool_result.type": H, "block.tool_result.tool_use_id": H, "block.tool_result.content": H,
    "block.tool_result.is_error": H, "block.tool_result.cache_control": IGN, "block.tool_result.toolset_name": IGN,
    "block.server_tool_use.type": H, "block.server_tool_use.id": H, "block.server_tool_use.name": H,
    "block.server_tool_use.input": H, "block.server_tool_use.cache_control": IGN, "block.server_tool_use.caller": IGN,
    "block.tool_search_tool_result.type": H, "block.tool_search_tool_result.tool_use_id": H,
    "block.tool_search_tool_result.content": H, "block.tool_search_tool_result.cache_control": IGN,
    "block.tool_addition.type": H, "block.tool_addition.tool": H, "block.tool_addition.cache_control": IGN,
    "block.tool_removal.type": H, "block.tool_removal.tool": H, "block.tool_removal.cache_control": IGN,
    "block.fallback.type": IGN, "block.fallback.from": IGN, "block.fallback.to": IGN, "block.fallback.trigger": IGN,
    **{f"{surface}.image.{f}": V for surface in ("block", "result_part")
       for f in ("type", "source", "cache_control", "transformations")},
    # what a tool result holds
    "result_part.text.type": H, "result_part.text.text": H, "result_part.text.cache_control": IGN,
    "result_part.text.citations": IGN,
    "result_part.tool_reference.type": H, "result_part.tool_reference.tool_name": H,
    "result_part.tool_reference.cache_control": IGN,
    # tools
    "tool.custom.type": H, "tool.custom.name": H, "tool.custom.description": H, "tool.custom.input_schema": H,
    "tool.custom.defer_loading": H, "tool.custom.input_examples": H, "tool.custom.cache_control": IGN,
    "tool.custom.allowed_callers": IGN, "tool.custom.eager_input_streaming": IGN, "tool.custom.strict": IGN,
    **{f"tool.tool_search_tool_{v}_20251119.{f}": d for v in ("bm25", "regex") for f, d in (
        ("type", H), ("name", H), ("defer_loading", R), ("cache_control", IGN), ("allowed_callers", IGN),
        ("strict", IGN))},
    "tool_choice.auto.type": H, "tool_choice.auto.disable_parallel_tool_use": H, "tool_choice.none.type": H,
    "tool_choice.any.type": E, "tool_choice.any.disable_parallel_tool_use": E, "tool_choice.tool.type": E,
    "tool_choice.tool.name": E, "tool_choice.tool.disable_parallel_tool_use": E,
    # thinking, output_config, context edits
    "thinking.enabled.type": H, "thinking.enabled.display": H, "thinking.enabled.budget_tokens": IGN,
    "thinking.enabled.block_binding": IGN, "thinking.adaptive.type": H, "thinking.adaptive.display": H,
    "thinking.adaptive.block_binding": IGN, "thinking.disabled.type": H, "thinking.between_tools.type": H,
    "output_config.effort": H, "output_config.format": E, "output_config.task_budget": R,
    "edit.clear_thinking_20251015.type": H, "edit.clear_thinking_20251015.keep": H,
}


# -- walking the SDK's types ----------------------------------------------------------------------------------------
def _bare(tp: Any) -> Any:
    while get_origin(tp) in (typing.Required, typing.NotRequired, typing.Annotated):
        tp = get_args(tp)[0]
    return tp


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__total__")


def typeddicts(tp: Any) -> list[type]:
    """The TypedDicts a field's type holds (through Optional, unions, lists and iterables)."""
    tp = _bare(tp)
    if _is_typeddict(tp):
        return [tp]
    if get_origin(tp) in (None, Literal):
        return []
    return [td for arg in get_args(tp) if arg is not type(None) for td in typeddicts(arg)]


def hints(td: type) -> dict[str, Any]:
    return get_type_hints(td, include_extras=True)


def tag(td: type) -> str:
    """The wire name of a type: its ``type`` (or ``role``) literal; a tool without one is "custom"."""
    field = hints(td).get("type") or hints(td).get("role")

    def literals(tp):
        tp = _bare(tp)
        return list(get_args(tp)) if get_origin(tp) is Literal else [v for a in get_args(tp) for v in literals(a)]

    values = literals(field) if field is not None else []
    return str(values[0]) if values else "custom"


def sdk_types() -> dict[str, list[type]]:
    """``surface.tag`` -> the SDK's TypedDicts of that name (the plain API's and the beta one's)."""
    found: dict[str, list[type]] = {}

    def add(surface: str, tp: Any) -> list[type]:
        tds = typeddicts(tp)
        for td in tds:
            found.setdefault(f"{surface}.{tag(td)}", []).append(td)
        return tds

    for params in (create_params.MessageCreateParamsNonStreaming, beta_create_params.MessageCreateParamsNonStreaming):
        h = hints(params)
        found.setdefault("request", []).append(params)
        for message in add("message", h["messages"]):
            for block in add("block", hints(message)["content"]):
                if tag(block) == "tool_result":
                    add("result_part", hints(block)["content"])
        add("tool", h["tools"])
        add("tool_choice", h["tool_choice"])
        add("thinking", h["thinking"])
        for config in typeddicts(h["output_config"]):
            found.setdefault("output_config", []).append(config)
        for cm in typeddicts(h.get("context_management")):
            add("edit", hints(cm)["edits"])
    return found


def sdk_fields() -> dict[str, tuple[type, str]]:
    """Every key the sweep decides: ``surface.tag.field`` (``surface.field`` for the request and output_config), or
    ``surface.tag`` for a type octo refuses whole."""
    keys: dict[str, tuple[type, str]] = {}
    for key, tds in sdk_types().items():
        if DECISIONS.get(key) == R and key.count(".") == 1:
            keys[key] = (tds[-1], "")
            continue
        for td in tds:
            for name in hints(td):
                keys.setdefault(f"{key}.{name}", (td, name))
    return keys


def test_every_sdk_field_has_a_decision():
    keys = set(sdk_fields())
    new, stale = sorted(keys - DECISIONS.keys()), sorted(DECISIONS.keys() - keys)
    assert not new and not stale, (f"the anthropic SDK ({anthropic.__version__}) has fields with no decision here "
                                   f"and in docs/api.md: {new}; decisions for fields it no longer has: {stale}")


# -- a request that sets one field ----------------------------------------------------------------------------------
def required(td: type, hint: Any) -> bool:
    """Whether a field must be given (``__required_keys__`` misses ``Required`` in string annotations)."""
    while get_origin(hint) is typing.Annotated:
        hint = get_args(hint)[0]
    if get_origin(hint) is typing.Required:
        return True
    return bool(td.__total__) and get_origin(hint) is not typing.NotRequired


def sample(tp: Any) -> Any:
    """A value of the SDK type ``tp``: the first literal, the first union member, the required fields of a dict."""
    tp = _bare(tp)
    if _is_typeddict(tp):
        return {k: sample(v) for k, v in hints(tp).items() if required(tp, v)}
    origin = get_origin(tp)
    if origin is Literal:
        return get_args(tp)[0]
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in get_args(tp) if a is not type(None)))
    if origin is list or (origin is not None and getattr(origin, "__name__", "") in
                                         ("Iterable", "Sequence", "SequenceNotStr")):
        return [sample(get_args(tp)[0])]
    if origin is dict or tp is dict:
        return {}
    return {str: "x", bool: True, int: 1, float: 1.0, object: "x"}.get(tp, "x")


WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SEARCH = {"type": "tool_search_tool_bm25_20251119", "name": "tool_search_tool_bm25"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
SERVER_USE = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "tool_search_tool_bm25",
              "input": {"query": "weather"}}
FOUND = {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_1", "content": {
    "type": "tool_search_tool_search_result",
    "tool_references": [{"type": "tool_reference", "tool_name": "get_weather"}]}}
# values the generic sample would get wrong (a model's name, a call's id...): key -> value of the field
VALUES: dict[str, Any] = {
    "request.model": MODEL, "request.max_tokens": 50, "request.stream": False, "request.system": "be brief",
    "request.messages": [{"role": "user", "content": "hi"}], "request.tools": [WEATHER],
    "request.thinking": {"type": "adaptive"}, "request.service_tier": "standard_only",
    "request.container": "container_011CZ", "request.fallback_credit_token": "token",
    "request.output_config": {"effort": "high"},
    "request.context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "message.system.output_config": {"effort": "high"}, "output_config.effort": "high",
    "block.tool_use.id": "toolu_1", "block.tool_use.name": "get_weather", "block.tool_use.input": {"city": "Oslo"},
    "block.tool_result.tool_use_id": "toolu_1", "block.server_tool_use.id": "srvtoolu_1",
    "block.server_tool_use.name": "tool_search_tool_bm25", "block.server_tool_use.input": {"query": "weather"},
    "block.tool_search_tool_result.tool_use_id": "srvtoolu_1",
    "block.tool_search_tool_result.content": FOUND["content"],
    "block.tool_addition.tool": {"type": "tool_reference", "name": "get_weather"},
    "block.tool_removal.tool": {"type": "tool_reference", "name": "get_weather"},
    "result_part.tool_reference.tool_name": "get_weather", "tool.custom.name": "get_weather",
    "tool.custom.input_schema": WEATHER["input_schema"], "tool.custom.input_examples": [{"city": "Oslo"}],
    "tool_choice.tool.name": "get_weather", "thinking.enabled.budget_tokens": 1024,
    "edit.clear_thinking_20251015.keep": "all",
}


def _one(key: str, td: type, field: str) -> dict[str, Any]:
    """The SDK type ``td`` with its required fields and ``field``."""
    value = sample(td)
    surface = key.split(".")[0]
    for name in hints(td):
        full = f"{surface}.{tag(td)}.{name}" if surface not in ("request", "output_config") else f"{surface}.{name}"
        if full in VALUES and (name in value or name == field):
            value[name] = VALUES[full]
    if field and field not in value:
        value[field] = sample(hints(td)[field])
    return value


def request_for(key: str, td: type, field: str) -> dict[str, Any]:
    """A Messages request that sets ``key`` (and only what it needs around it)."""
    req: dict[str, Any] = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    surface = key.split(".")[0]
    if surface == "request":
        req[field] = VALUES.get(key, sample(hints(td)[field]))
    elif surface == "message":
        role = key.split(".")[1]
        msg = {"role": role, "content": "ok"} | ({field: VALUES.get(key, sample(hints(td)[field]))}
                                                 if field not in ("role", "content") else {})
        req["messages"] = [{"role": "user", "content": "hi"}, msg] + ([{"role": "user", "content": "go"}]
                                                                      if role == "assistant" else [])
    elif surface == "block":
        req.update(_block_context(key.split(".")[1], _one(key, td, field)))
    elif surface == "result_part":
        req["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [USE]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                         "content": [_one(key, td, field)]}]}]
        req["tools"] = [{**WEATHER, "defer_loading": True}, {**WEATHER, "name": "ask"}]
    elif surface == "tool":
        tool = _one(key, td, field)
        req["tools"] = [tool] if tool.get("type", "custom") == "custom" else [tool, {**WEATHER, "defer_loading": True},
                                                                               {**WEATHER, "name": "ask"}]
    elif surface == "tool_choice":
        req.update(tools=[WEATHER], tool_choice=_one(key, td, field))
    elif surface == "thinking":
        req.update(thinking=_one(key, td, field), max_tokens=2000)
    elif surface == "output_config":
        req["output_config"] = {field: VALUES.get(key, sample(hints(td)[field]))}
        if field == "format":
            req["output_config"][field] = {"type": "json_schema", "schema": {"type": "object"}}
    elif surface == "edit":
        req["context_management"] = {"edits": [_one(key, td, field)]}
    return req


def _block_context(kind: str, block: dict[str, Any]) -> dict[str, Any]:
    tools = [WEATHER, SEARCH]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
    if kind == "tool_use":
        return {"tools": tools, "messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": [block]}, result]}
    if kind == "tool_result":
        return {"tools": tools, "messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": [USE]},
                                             {"role": "user", "content": [block]}]}
    if kind in ("server_tool_use", "tool_search_tool_result"):
        pair = [block, FOUND] if kind == "server_tool_use" else [SERVER_USE, block]
        return {"tools": tools, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": pair},
                                             {"role": "user", "content": "go"}]}
    if kind in ("tool_addition", "tool_removal"):
        return {"tools": tools, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                             {"role": "system", "content": [block]},
                                             {"role": "user", "content": "go"}]}
    if kind in ("thinking", "redacted_thinking", "fallback"):
        return {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": [block, {"type": "text", "text": "ok"}]},
                             {"role": "user", "content": "go"}]}
    return {"messages": [{"role": "user", "content": [block]}]}


# -- the checks against a real server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with run_octo(MODEL, "--engine", "echo", "-o", "think=1") as s:
        yield s


def _post(server, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import httpx

    r = httpx.post(server.base_url + "/v1/messages?beta=true", json=body, timeout=60,
                   headers={"anthropic-version": "2023-06-01", "x-api-key": "none"})
    return r.status_code, r.json()


@pytest.mark.parametrize("key", sorted(k for k, d in DECISIONS.items() if d != X))
def test_decision(server, key):
    fields = sdk_fields()
    if key not in fields:
        pytest.skip(f"the installed SDK has no {key} (test_every_sdk_field_has_a_decision says so)")
    td, field = fields[key]
    body = request_for(key, td, field)
    status, answer = _post(server, body)
    decision = DECISIONS[key]
    shown = json.dumps(body)[:600]
    if decision in (H, IGN):
        assert status == 200, (key, shown, answer)
        assert answer["type"] == "message"
        return
    assert status == 400 and answer["type"] == "error", (key, shown, answer)
    message = answer["error"]["message"]
    if decision == E:  # the echo engine cannot constrain its output: said so, not silently unconstrained
        assert "constrain" in message, (key, message)
    elif decision == V:  # the echo engine takes no images: the model is named, and the block
        where = "messages.0.content.0" if key.startswith("block") else "messages.2.content.0.content.0"
        assert message.startswith(f"{where}: Model '{MODEL}' does not take images"), (key, message)
    else:
        named = field or key.split(".")[1]
        assert named in message, (key, named, message)


def test_headers_the_sdk_sends(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    m = client.beta.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi there"}],
                                    betas=["advanced-tool-use-2025-11-20"], user_profile_id="u",
                                    workspace_id="wrkspc_1")
    assert m.content[-1].text == "hi there"


def test_the_sdk_response_models_come_back(server):
    """Each block octo answers with, as the SDK's response model dumps it (nulls included), is taken back."""
    from anthropic.types import (
        RedactedThinkingBlock,
        ServerToolUseBlock,
        TextBlock,
        ThinkingBlock,
        ToolSearchToolResultBlock,
        ToolUseBlock,
    )

    blocks = [ThinkingBlock(type="thinking", thinking="plan", signature=""),
              RedactedThinkingBlock(type="redacted_thinking", data="x"),
              TextBlock(type="text", text="let me look", citations=None),
              ServerToolUseBlock(**SERVER_USE), ToolSearchToolResultBlock.model_validate(FOUND),
              ToolUseBlock(**USE)]
    for dump in ({}, {"mode": "json"}, {"exclude_none": True}):
        content = [b.model_dump(**dump) for b in blocks]
        status, answer = _post(server, {"model": MODEL, "max_tokens": 50, "tools": [WEATHER, SEARCH], "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]})
        assert status == 200, (dump, content, answer)
