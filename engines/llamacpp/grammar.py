"""GBNF grammars for constrained decoding: JSON mode and JSON schemas (llama.cpp's JSON-schema-to-grammar)."""

from __future__ import annotations

import json

from octo.errors import InvalidRequest


def grammar_for(grammar: str | None, json_schema: dict | None) -> str | None:
    """The GBNF text a sequence is constrained by: an explicit grammar, JSON mode ({}) or a JSON schema."""
    if grammar is not None and json_schema is not None:
        raise InvalidRequest("Set either a grammar or response_format, not both.", param="response_format")
    if grammar is not None:
        return grammar
    if json_schema is None:
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if not json_schema:  # {"type": "json_object"}: any JSON object
        return JSON_GBNF
    try:
        gbnf = json_schema_to_gbnf(json.dumps(json_schema))
    except Exception as e:  # the converter raises ValueError/KeyError/NotImplementedError on what it cannot express
        raise InvalidRequest(f"Unsupported JSON schema in response_format: {e!r}", param="response_format") from None
    # llama-cpp-python's port lets raw control characters into strings, which json.loads rejects; llama.cpp's
    # own converter (common/json-schema-to-grammar.cpp) excludes them. Use llama.cpp's rule.
    return gbnf.replace(_PY_CHAR, _CPP_CHAR)


_PY_CHAR = r'char ::= [^"\\] |'
_CPP_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'
