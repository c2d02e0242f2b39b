"""What a constrained sequence must match, as llguidance grammar text: :class:`Constraint` (JSON schemas with
OpenAI's strict rules, ``json_object``, regexes, Lark/GBNF grammars, tool calls of a template family), the checks that
turn a bad one into a 400 naming the request field, and :func:`grammar_text`. ``octo.text.constrain`` compiles the text
against an engine's vocabulary and runs the matchers."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octo.errors import InvalidRequest
from octo.logsafe import quoted
from octo.text.toolcalls import ToolFormat, get_format

if TYPE_CHECKING:
    from octo.text.constrain import Vocab

# JSON whitespace allowed at each place JSON allows it: nothing, one space, or one line break and up to 20 spaces or
# tabs of indentation: llama.cpp's rule for its JSON grammars (`ws ::= | " " | "\n" [ \t]{0,20}`), so pretty-printed
# JSON is fine and a model cannot spend its tokens on blank runs. A schema's own "x-guidance" options win.
log = logging.getLogger("octo.text.grammars")
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"


def available() -> tuple[bool, str]:
    """Whether llguidance can be imported, and why not (for /v1/engines or a capability check)."""
    try:
        ll_grammar()
    except InvalidRequest as e:
        return False, e.message
    return True, ""


def ll_grammar():
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest("Constrained decoding (response_format, tool_choice, grammars) needs the llguidance "
                             "package, which is not installed on this server.", param="response_format") from None
    return llguidance


# -- what to enforce --------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Constraint:
    """What a sequence's output must match. Build one with the class methods; ``param`` names the request field
    that errors point at."""

    kind: str  # "json_schema" | "json_object" | "regex" | "lark" | "gbnf" | "tool_calls"
    param: str
    schema: Any = None
    strict: bool = False
    text: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "required"
    parallel_tool_calls: bool = True
    tool_format: ToolFormat | str = "hermes"

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = False,
                    param: str = "response_format.json_schema.schema") -> Constraint:
        """JSON matching ``schema``. ``strict`` applies OpenAI's Structured Outputs rules: the root is an object,
        every object sets ``additionalProperties: false`` and lists all its properties in ``required`` (a schema
        breaking them is refused, as OpenAI does). Non-strict: the schema as given."""
        return cls("json_schema", param, schema=schema, strict=bool(strict))

    @classmethod
    def json_object(cls, param: str = "response_format") -> Constraint:
        """Any JSON object."""
        return cls("json_object", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> Constraint:
        return cls("regex", param, text=pattern)

    @classmethod
    def lark(cls, grammar: str, param: str = "grammar") -> Constraint:
        """A grammar in llguidance's Lark dialect (``%json {...}`` and ``<[token id]>`` included)."""
        return cls("lark", param, text=grammar)

    @classmethod
    def gbnf(cls, grammar: str, param: str = "grammar") -> Constraint:
        """A llama.cpp GBNF grammar (converted to Lark by llguidance)."""
        return cls("gbnf", param, text=grammar)

    @classmethod
    def tool_calls(cls, tools: Sequence[dict[str, Any]], tool_choice: Any = "required",
                   parallel_tool_calls: bool = True, tool_format: ToolFormat | str = "hermes",
                   param: str = "tools") -> Constraint | None:
        """Calls of OpenAI function ``tools`` in ``tool_format``'s text: ``"required"`` (one call or more, of any
        tool), ``{"type": "function", "function": {"name": ...}}`` (that function only) or ``"auto"`` (free text, but
        a call once begun must be valid); ``parallel_tool_calls=False`` allows one call. ``"none"`` gives None."""
        if tool_choice == "none":
            return None
        return cls("tool_calls", param, tools=tuple(tools), tool_choice=tool_choice,
                   parallel_tool_calls=bool(parallel_tool_calls), tool_format=tool_format)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None,
                             param: str = "response_format") -> Constraint | None:
        """From Chat Completions' ``response_format`` or the Responses API's ``text.format`` (flat json_schema)."""
        if not response_format:
            return None
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return cls.json_object(param)
        if kind == "json_schema":
            if "json_schema" not in response_format and "schema" not in response_format:
                raise InvalidRequest(f"{param}.json_schema is required for a json_schema response format.",
                                     param=f"{param}.json_schema", code="missing_required_parameter")
            spec = response_format.get("json_schema", response_format)
            sub = f"{param}.json_schema" if "json_schema" in response_format else param
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise InvalidRequest(f"{sub}.schema is required for a json_schema response format.",
                                     param=f"{sub}.schema")
            return cls.json_schema(spec["schema"], bool(spec.get("strict")), param=f"{sub}.schema")
        raise InvalidRequest(f"Unsupported {param}.type {kind!r} (expected 'text', 'json_object' or 'json_schema').",
                             param=f"{param}.type")



# -- checks -----------------------------------------------------------------------------------------------------
def check_strict_schema(schema: Any, param: str) -> None:
    """OpenAI's strict-mode rules (Structured Outputs): refuse a schema that breaks them, naming where."""
    if not isinstance(schema, dict) or schema.get("type") != "object" or "anyOf" in schema:
        raise InvalidRequest(f"Invalid schema for {param}: in strict mode the root must be a JSON Schema of "
                             "'type: \"object\"' (not anyOf).", param=param)

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        where = f"In context={path!r}"

        def keyword(key: str, kind: type, default: Any, what: str = "") -> Any:  # of the JSON type the rules read
            value = node.get(key, default)
            if not isinstance(value, kind):
                what = what or ("an object" if kind is dict else "an array")
                raise InvalidRequest(f"Invalid schema for {param}: {where}, '{key}' must be {what}.", param=param)
            return value

        types = node.get("type")
        types = [types] if isinstance(types, str) else keyword("type", list, [], "a string or an array")
        if "object" in types or "properties" in node:
            if node.get("additionalProperties") is not False:
                raise InvalidRequest(f"Invalid schema for {param}: {where}, 'additionalProperties' is required to be "
                                     "supplied and to be false (strict mode).", param=param)
            required = keyword("required", list, [])
            missing = [k for k in keyword("properties", dict, {}) if k not in required]
            if missing:
                raise InvalidRequest(f"Invalid schema for {param}: {where}, 'required' is required to be supplied and "
                                     f"to be an array including every key in properties. Missing '{missing[0]}' "
                                     "(strict mode).", param=param)
        for key in ("properties", "$defs", "definitions"):
            for name, sub in keyword(key, dict, {}).items():
                walk(sub, (*path, key, name))
        for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
            for i, sub in enumerate(keyword(key, list, [])):
                walk(sub, (*path, key, str(i)))
        if isinstance(node.get("items"), dict):
            walk(node["items"], (*path, "items"))

    walk(schema, ())


def _schema_errors(schema: Any, param: str) -> list[str]:
    """llguidance's complaints about a schema (unsupported keywords, unknown formats...), [] when it compiles."""
    ll = ll_grammar()
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON Schema object.", param=param)
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"Invalid JSON schema in {param}: {e}", param=param) from None
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages or ["invalid"]) if is_error else []


def _check_json_schema(schema: Any, param: str) -> None:
    """llguidance's verdict on a schema: unsupported keywords, bad refs, unknown formats... as a 400."""
    errors = _schema_errors(schema, param)
    if errors:
        raise InvalidRequest(f"Unsupported JSON schema in {param}: {errors[0]}", param=param)


def usable_schema(schema: Any, strict: bool, param: str) -> Any:
    """The schema to enforce. Strict (OpenAI's Structured Outputs): as given, or a 400 naming what breaks the rules
    or is not supported. Otherwise keywords llguidance does not implement (``propertyNames``, ``not``, ``if``/``then``,
    an unknown ``format``: what zod, pydantic and agents' tool sets emit) are relaxed, not enforced (llguidance's
    ``lenient`` mode: a looser constraint, still valid for every document the schema accepts), with a warning in
    the log; a schema that does not compile even so is a 400."""
    if strict:
        check_strict_schema(schema, param)
        _check_json_schema(schema, param)
        return schema
    errors = _schema_errors(schema, param)
    if not errors:
        return schema
    relaxed = {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), "lenient": True}}
    if _schema_errors(relaxed, param):
        raise InvalidRequest(f"Unsupported JSON schema in {param}: {errors[0]}", param=param)
    log.warning("%s: %s: relaxed, not enforced", quoted(param, bare=True), quoted("; ".join(errors)))
    return relaxed


def _with_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    guidance = {"whitespace_pattern": JSON_WHITESPACE, **(schema.get("x-guidance") or {})}
    return {**_closed(schema), "x-guidance": guidance}


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its properties and does not
    say: what llama.cpp's and xgrammar's JSON-schema grammars do, so generated objects have exactly the properties
    the schema names (an open object lets a model write keys forever). ``{"type": "object"}`` alone stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _pieces(text: str, fmt: ToolFormat, vocab: Vocab) -> str:
    """Lark for a piece of wrapper text: markers become their special token (or vanish if the vocabulary has no
    such token), the rest literal text."""
    out: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in fmt.markers if m in rest]
        if not hits:
            out.append(_lit(rest))
            break
        i, marker = min(hits)
        if i:
            out.append(_lit(rest[:i]))
        tok = vocab.token_for(marker)
        if tok is not None:
            out.append(f"<[{tok[0]}]>" if tok[1] else _lit(marker))
        rest = rest[i + len(marker):]
    return " ".join(out)


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _functions(c: Constraint) -> list[tuple[str, dict[str, Any], str, bool]]:
    """(name, parameters schema, its request path, strict) of each tool: names and shapes checked, schemas not
    yet compiled (only those the constraint needs are: :func:`_tool_lark`)."""
    funcs: list[tuple[str, dict[str, Any], str, bool]] = []
    if not c.tools:
        raise InvalidRequest("tools must be a non-empty array when tool_choice is set.", param=c.param)
    for i, tool in enumerate(c.tools):
        where = f"tools[{i}]"  # c.param is the tool_choice that asked for the calls
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{where} must be a function tool with a name.", param=where)
        name = fn["name"]
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequest(f"{where}.function.name {name!r} must be 1-64 letters, digits, '_', '-' or '.'.",
                                 param=f"{where}.function.name")
        if any(name == f[0] for f in funcs):
            raise InvalidRequest(f"Duplicate function name {name!r} in tools.", param=f"{where}.function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema of type 'object'.",
                                 param=f"{where}.function.parameters")
        params = {"type": "object", **params}  # arguments are an object even when the schema omits the type
        funcs.append((name, params, f"{where}.function.parameters", bool(fn.get("strict"))))
    return funcs


def _tool_lark(c: Constraint, vocab: Vocab) -> str:
    fmt = get_format(c.tool_format)
    funcs = _functions(c)
    choice, lazy = c.tool_choice, False
    if choice == "auto":
        lazy = True
    elif isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        funcs = [f for f in funcs if f[0] == name]
        if not funcs:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools.", param="tool_choice")
    elif choice != "required":
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a named function.",
                             param="tool_choice")
    rules = []
    for k, (name, params, where, strict) in enumerate(funcs):
        params = usable_schema(params, strict, where)
        head = _lit(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{fmt.args_key}": ')
        rules.append(f"fn{k}: {head} %json {json.dumps(_with_whitespace(params), ensure_ascii=False)} \"}}\"")
    fns = "(" + " | ".join(f"fn{k}" for k in range(len(funcs))) + ")"
    call_close = _pieces(fmt.call_close, fmt, vocab)
    rules.append("call: " + _seq(_pieces(fmt.call_open, fmt, vocab), fns, call_close))
    sep = _lit(fmt.separator)
    rules.append(f"calls: call ({sep} call)*" if c.parallel_tool_calls else "calls: call")
    end = _pieces(fmt.end, fmt, vocab)
    block = _seq(_pieces(fmt.begin, fmt, vocab), "calls", end)
    if not lazy:
        return "\n".join([f"start: {block}", *rules])
    # tool_choice "auto": free text, but a call, once its opening text appears, must be valid (lazy lexemes)
    opening = fmt.begin + fmt.call_open
    trigger = next((m for m in fmt.markers if opening.startswith(m)), opening.split("\n")[0])
    tok = vocab.token_for(trigger) if trigger else None
    if trigger in fmt.markers and tok is None:
        trigger = ""  # the marker is not in this vocabulary: a bare block at the start of the answer, as parsed
    if not trigger:
        bare = re.sub("|".join(map(re.escape, fmt.markers)), "", opening) if fmt.markers else opening
        first = (bare.strip() or "{")[0]
        return "\n".join([f"start: {block} | TEXT", f"TEXT: /([^{re.escape(first)}](.|\\n)*)?/", *rules])
    head = f"TEXT <[{tok[0]}]>" if tok and tok[1] else "tc_hd"
    lines = ["start: tc* TEXT" if c.parallel_tool_calls else "start: tc? TEXT", "TEXT: /(.|\\n)*/"]
    if not (tok and tok[1]):
        lines.append(f"tc_hd[lazy]: TEXT {_lit(trigger)}")
    if len(trigger) <= len(fmt.begin):  # the trigger opens the group of calls
        lines.append("tc: " + _seq(head, _pieces(fmt.begin[len(trigger):], fmt, vocab), "calls", end))
    else:  # the trigger opens each call (Hermes): one call per trigger
        lines.append("tc: " + _seq(head, _pieces(fmt.call_open[len(trigger) - len(fmt.begin):], fmt, vocab), fns,
                                   call_close))
    return "\n".join(lines + rules)


def grammar_text(c: Constraint, vocab: Vocab) -> str:
    """The llguidance grammar (a JSON string) of a constraint, after the checks that name the request field."""
    ll = ll_grammar()
    if c.kind == "json_schema":
        schema = usable_schema(c.schema, c.strict, c.param)
        return ll.LLMatcher.grammar_from_json_schema(json.dumps(_with_whitespace(schema)))
    if c.kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema(json.dumps(_with_whitespace({"type": "object"})))
    if not isinstance(c.text, str):
        raise InvalidRequest(f"{c.param} must be a string.", param=c.param)
    if c.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(c.text)
    if c.kind == "lark":
        return ll.LLMatcher.grammar_from_lark(c.text)
    if c.kind == "gbnf":
        try:
            return ll.grammar_from("gbnf", c.text)
        except ValueError as e:
            raise InvalidRequest(f"Invalid grammar in {c.param}: {e}", param=c.param) from None
    if c.kind == "tool_calls":
        return ll.LLMatcher.grammar_from_lark(_tool_lark(c, vocab))
    raise ValueError(f"unknown constraint kind {c.kind!r}")
