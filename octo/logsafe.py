"""Values from requests (model names, paths, ids, header values) and from files (names on disk) in log lines, quoted
so that they cannot forge a line: :func:`quoted` writes a value as Go's ``%q`` does (Ollama's log lines, Go's slog):
inside double quotes, with ``"`` and ``\\`` escaped and every character that is not printable (control characters,
line and paragraph separators, bidirectional overrides, ANSI escape sequences' ESC) as an escape, so one log record is
one line whatever a client sends. Long values are cut (the count of characters left out is said)."""

from __future__ import annotations

import os

MAX_CHARS = 300
_SIMPLE = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\a": "\\a", "\b": "\\b", "\f": "\\f", "\v": "\\v",
           '"': '\\"', "\\": "\\\\"}


def _escape(ch: str) -> str:
    if ch in _SIMPLE:
        return _SIMPLE[ch]
    if ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def quoted(value: object, limit: int = MAX_CHARS, bare: bool = False) -> str:
    """``value`` (a string, bytes, a path; anything else by ``str``) as one double-quoted, escaped token. ``bare``:
    left unquoted when it needs no quoting (as slog's text handler writes values: not empty, no space, ``"``, ``=``,
    ``\\`` or character that is not printable), so an ordinary route or name reads as it is."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    text = value if isinstance(value, str) else str(value)
    if bare and text and len(text) <= limit and all(c.isprintable() and c not in ' "=\\' for c in text):
        return text
    cut = len(text) - limit if limit and len(text) > limit else 0
    body = "".join(_escape(c) for c in (text[:limit] if cut else text))
    return f'"{body}"' + (f"...({cut} more)" if cut else "")
