"""Scanning a model's tool-call text (octo.text.toolcalls): where a JSON value ends (resumable, for streaming), the
arguments' own text inside a call object (never parsed and re-serialised: numbers keep their digits), strict JSON
validation (orjson: no NaN, Infinity or numbers past a double's range) and calls written as Python."""

from __future__ import annotations

import ast
import json
import re
from json.decoder import scanstring
from typing import Any

import orjson

MORE = "more"  # the text so far cannot decide: wait for more (or, at the end, it is not a call)
BAD = "bad"    # decided: not a call here
WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


_SIGNIFICANT = re.compile(r'["\\{}\[\]]')


class Scanner:
    """Finds where a JSON object/array ends, resuming where the previous call stopped: the parser's buffer only
    grows at its end while a call is pending, so a long call is scanned once, not once per delta."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[int, list[str], bool]] = {}

    def __call__(self, s: str, i: int) -> int | str:
        """End of the JSON object/array starting at ``s[i]``, MORE when unfinished, BAD when broken."""
        j, stack, in_str = self.saved.pop(i, (i, [], False))
        for m in _SIGNIFICANT.finditer(s, j):
            k = m.start()
            if k < j:  # the character after a backslash
                continue
            c, j = s[k], k + 1
            if in_str:
                if c == "\\":
                    j = k + 2
                in_str = c != '"'
            elif c == '"':
                in_str = True
            elif c in "{[":
                stack.append("}" if c == "{" else "]")
            elif not stack or stack.pop() != c:
                return BAD
            elif not stack:
                return j
        self.saved[i] = (max(j, len(s)), stack, in_str)  # past len(s) when the text ends in a backslash
        return MORE


def load_json(s: str) -> Any:
    """The JSON value of ``s``, BAD unless it is JSON that a strict parser reads back: orjson refuses what Python's
    json accepts beyond the standard (``NaN``, ``Infinity``) and numbers past a double's range (``1e999``, which
    would otherwise come back as ``Infinity``, and which serde_json, Codex's parser, refuses too)."""
    try:
        return orjson.loads(s)
    except (orjson.JSONDecodeError, RecursionError):
        return BAD


DECODER = json.JSONDecoder()


def _value_spans(s: str, i: int) -> dict[str, tuple[int, int]]:
    """(start, end) of each member's value text in the JSON object at ``s[i]`` (``s`` is known to be valid JSON):
    arguments are kept exactly as the model wrote them, never parsed and re-serialised."""
    spans: dict[str, tuple[int, int]] = {}
    j = skip_ws(s, i + 1)
    while s[j] != "}":
        key, j = scanstring(s, j + 1)
        j = skip_ws(s, skip_ws(s, j) + 1)  # past the colon
        _, end = DECODER.raw_decode(s, j)
        spans[key] = (j, end)
        j = skip_ws(s, end)
        if s[j] == ",":
            j = skip_ws(s, j + 1)
    return spans


def call_at(s: str, i: int, obj: Any) -> tuple[str, str] | str:
    """(name, arguments text) of the ``{"name", "arguments"|"parameters"}`` object ``obj`` written at ``s[i]``:
    the arguments' own text when they are an object, else BAD."""
    if not isinstance(obj, dict):
        return BAD
    spans = _value_spans(s, i)
    if "name" not in obj and isinstance(obj.get("function"), dict):
        return call_at(s, spans["function"][0], obj["function"])  # {"type": "function", "function": {...}}
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        return BAD
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    args = obj[key] if key else {}
    if isinstance(args, str):  # arguments as a JSON string: its content is the text
        text = args.strip() or "{}"
        return (obj["name"], text) if isinstance(load_json(text), dict) else BAD
    if not isinstance(args, dict):
        return BAD
    return obj["name"], s[spans[key][0]:spans[key][1]] if key else "{}"


def dumps_args(args: dict[str, Any]) -> str | None:
    """JSON text of arguments the model wrote in another language (Python calls); None where a value has no JSON
    form (``inf``)."""
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError):
        return None


_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _py_value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.List | ast.Tuple):
        return [_py_value(v) for v in node.elts]
    return ast.literal_eval(node)


def python_calls(src: str) -> list[tuple[str, str]] | str:
    """Calls written as Python: ``f(a=1)`` per line, ``[f(a=1), g()]``, or ``tool.call(query="x")``."""
    try:
        tree = ast.parse(src.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return BAD
    nodes: list[ast.AST] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return BAD
        nodes.extend(stmt.value.elts if isinstance(stmt.value, ast.List) else [stmt.value])
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return BAD
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "call" and isinstance(func.value, ast.Name):
            name = func.value.id  # Llama's builtin tools: brave_search.call(query="...")
        elif isinstance(func, ast.Name):
            name = func.id
        else:
            return BAD
        try:
            args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return BAD
        text = dumps_args(args)
        if text is None:
            return BAD
        calls.append((name, text))
    return calls or BAD




class UnsafeArguments(ValueError):
    """A streamed call's arguments hold text no strict JSON parser reads back (a number past a double's range, a
    lone surrogate escape): the call cannot be completed."""


_STR_STOP = re.compile(r'["\\]')
_NUMBER_CHARS = frozenset("0123456789+-.eE")


def check_number(text: str, complete: bool = True) -> None:
    """UnsafeArguments unless the number ``text`` is finite as a double (orjson's rule: ``1e999`` is refused).
    ``complete`` False: a number cut off by max_tokens, refused only where what was written is already infinite."""
    if complete:
        if load_json(text) == BAD:
            raise UnsafeArguments(f"the number {text} is not a finite double")
        return
    try:
        value = float(text)
    except ValueError:
        return  # "-", "1e": not a number yet, nothing out of range
    if value in (float("inf"), float("-inf")):
        raise UnsafeArguments(f"the number {text} is not a finite double")


class ArgsPrefix:
    """How much of a call's arguments (a JSON object whose text starts at ``start`` in a growing buffer, its syntax
    guaranteed by a constraint grammar) may be streamed now: everything but a number not yet finished (it is checked
    to be a finite double once it is), an escape not yet complete (a high surrogate waits for its low one)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = self.safe = start
        self.end = -1  # past the closing brace, once written
        self.depth = 0
        self.in_str = False
        self.num = -1  # start of the number being written

    def advance(self, s: str) -> None:
        """Read ``s`` (the buffer, grown at its end) past ``pos``; UnsafeArguments on a value that must not go out."""
        n = len(s)
        while self.pos < n and self.end < 0:
            if self.in_str:
                m = _STR_STOP.search(s, self.pos)
                if m is None:
                    self.pos = n
                elif m.group() == '"':
                    self.pos, self.in_str = m.end(), False
                else:
                    k = self._escape(s, m.start())
                    if k < 0:  # incomplete: wait for the rest
                        self.pos = self.safe = m.start()
                        return
                    self.pos = k
                continue
            c = s[self.pos]
            if self.num >= 0:
                if c in _NUMBER_CHARS:
                    self.pos += 1
                    continue
                check_number(s[self.num:self.pos])
                self.num = -1
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos + 1
            elif c == "-" or c.isdigit():
                self.num = self.pos
            self.pos += 1
        self.safe = self.num if self.num >= 0 else self.pos

    @staticmethod
    def _escape(s: str, k: int) -> int:
        """End of the escape at ``s[k]`` (a backslash), -1 when not complete yet."""
        if k + 1 >= len(s):
            return -1
        if s[k + 1] != "u":
            return k + 2
        if k + 6 > len(s):
            return -1
        code = _code(s[k + 2:k + 6])
        if 0xDC00 <= code <= 0xDFFF:
            raise UnsafeArguments(f"the escape {s[k:k + 6]} is a lone low surrogate")
        if not 0xD800 <= code <= 0xDBFF:
            return k + 6
        rest = s[k + 6:k + 12]
        if len(rest) < 6 and "\\u".startswith(rest[:2]):
            return -1
        if not (rest.startswith("\\u") and 0xDC00 <= _code(rest[2:]) <= 0xDFFF):
            raise UnsafeArguments(f"the escape {s[k:k + 6]} is a high surrogate without its low one")
        return k + 12


def _code(hex4: str) -> int:
    """The code unit of a ``\\uXXXX`` escape's digits, -1 when they are not four hex digits."""
    return int(hex4, 16) if re.fullmatch(r"[0-9a-fA-F]{4}", hex4) else -1
