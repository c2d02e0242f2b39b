"""Searching a catalog of tools, as Anthropic's server-side tool search does over the tools a request defers
(``defer_loading``): :func:`regex_search` (the ``tool_search_tool_regex`` variant: a Python regular expression over
each tool's name, description, argument names and argument descriptions) and :func:`bm25_search` (the
``tool_search_tool_bm25`` variant: Okapi BM25 over the same text). Both return tool names, at most ``limit``.

The regular expression runs on the ``regex`` package, whose matcher takes a timeout, so a pattern that backtracks
without end (``(a+)+$``) costs at most :data:`REGEX_BUDGET_S` and fails with ``execution_time_exceeded``; patterns
are at most :data:`MAX_PATTERN` characters, as Anthropic's. Without the package the variant cannot run
(:func:`regex_available`). Server-free and engine-free: a tool is an OpenAI function dict (``name``,
``description``, ``parameters``)."""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from typing import Any

MAX_PATTERN = 200  # characters of a regex pattern (Anthropic's limit)
MAX_QUERY = 1000  # characters of a BM25 query
REGEX_BUDGET_S = 0.25  # the whole regex search, over every tool
LIMIT = 5  # tools one search returns ("the 3-5 tools Claude needs")
K1, B = 1.2, 0.75  # Okapi BM25's usual parameters

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_TERM = re.compile(r"[a-z0-9]+")


class SearchFailed(Exception):
    """A search that cannot give an answer; ``code`` is Anthropic's ``error_code`` for it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def regex_available() -> bool:
    try:
        import regex  # noqa: F401
    except ImportError:
        return False
    return True


def fields(fn: dict[str, Any]) -> list[str]:
    """What a search reads of a tool: its name, description, and each top-level argument's name and description."""
    out = [fn.get("name") or "", fn.get("description") or ""]
    props = (fn.get("parameters") or {}).get("properties")
    if isinstance(props, dict):
        for name, schema in props.items():
            out.append(str(name))
            if isinstance(schema, dict) and isinstance(schema.get("description"), str):
                out.append(schema["description"])
    return [f for f in out if f]


def terms(text: str) -> list[str]:
    """Lower-case words and numbers; camelCase and snake_case names split into their words."""
    return _TERM.findall(_CAMEL.sub(" ", text).lower())


def bm25_scores(docs: list[list[str]], query: list[str]) -> list[float]:
    """Okapi BM25 of each document (a list of terms) for the query's distinct terms: idf = ln(1 + (N - n + 0.5) /
    (n + 0.5)), score = sum of idf * f * (K1 + 1) / (f + K1 * (1 - B + B * |D| / avgdl))."""
    n_docs = len(docs)
    if not n_docs:
        return []
    avgdl = sum(map(len, docs)) / n_docs or 1.0
    counts = [Counter(d) for d in docs]
    scores = [0.0] * n_docs
    for term in dict.fromkeys(query):
        n = sum(1 for c in counts if term in c)
        if not n:
            continue
        idf = math.log(1.0 + (n_docs - n + 0.5) / (n + 0.5))
        for i, c in enumerate(counts):
            f = c.get(term, 0)
            if f:
                scores[i] += idf * f * (K1 + 1) / (f + K1 * (1 - B + B * len(docs[i]) / avgdl))
    return scores


def bm25_search(tools: list[dict[str, Any]], query: Any, limit: int = LIMIT) -> list[str]:
    """The names of the best-scoring tools for a natural-language ``query`` (ties keep the tools' order)."""
    if not isinstance(query, str) or not query.strip():
        raise SearchFailed("invalid_tool_input", "query must be a non-empty string")
    if len(query) > MAX_QUERY:
        raise SearchFailed("invalid_tool_input", f"query is longer than {MAX_QUERY} characters")
    scores = bm25_scores([terms(" ".join(fields(t))) for t in tools], terms(query))
    ranked = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: -scores[i])
    return [tools[i]["name"] for i in ranked[:limit]]


def regex_search(tools: list[dict[str, Any]], pattern: Any, limit: int = LIMIT,
                 budget_s: float = REGEX_BUDGET_S) -> list[str]:
    """The names of the tools (in their order) with a field ``pattern`` matches (``re.search`` semantics)."""
    import regex

    if not isinstance(pattern, str) or not pattern:
        raise SearchFailed("invalid_tool_input", "pattern must be a non-empty string")
    if len(pattern) > MAX_PATTERN:
        raise SearchFailed("invalid_tool_input", f"pattern is longer than {MAX_PATTERN} characters")
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        raise SearchFailed("invalid_tool_input", f"invalid regular expression: {exc}") from None
    deadline = time.monotonic() + budget_s
    found: list[str] = []
    for tool in tools:
        for text in fields(tool):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                hit = compiled.search(text, timeout=left, concurrent=True)  # (the GIL is free meanwhile)
            except TimeoutError:
                raise SearchFailed("execution_time_exceeded",
                                   f"the pattern did not finish within {budget_s:g} s") from None
            if hit is not None:
                found.append(tool["name"])
                break
        if len(found) >= limit:
            break
    return found


def expansion(functions: list[dict[str, Any]]) -> str:
    """Loaded tools as the model reads them where a tool reference stands: one ``<function>`` line each, in a
    ``<functions>`` block (the encoding Anthropic's API expands a ``tool_reference`` to)."""
    lines = ["<functions>"]
    for fn in functions:
        body = {"description": fn.get("description") or "", "name": fn["name"],
                "parameters": fn.get("parameters") or {}}
        lines.append(f"<function>{json.dumps(body, ensure_ascii=False)}</function>")
    lines.append("</functions>")
    return "\n".join(lines)
