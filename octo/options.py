"""Typed engine options (``-o KEY=VALUE``) for engine plugins: value converters and one parser.

An engine declares its options as ``{name: Option(converter, help)}`` and calls :func:`parse_engine_options` in its
``__init__``; an unknown key or a value its converter refuses is a :class:`~octo.errors.ConfigError` naming the
key, in the same words for every engine. Converters take the option's text and return the value or raise
``ValueError`` with what was expected. Part of the plugin surface (see docs/engines.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from octo.errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Option:
    convert: Callable[[str], Any]
    help: str = ""


def boolean(value: str) -> bool:
    s = value.strip().lower()
    if s in TRUE:
        return True
    if s in FALSE:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def auto_bool(value: str) -> str:
    """``auto``, ``true`` or ``false`` (as text: "auto" stays a third state)."""
    s = value.strip().lower()
    return s if s == "auto" else ("true" if boolean(s) else "false")


def positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return n


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return n


def probability(value: str) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"expected a probability between 0 and 1, got {value!r}")
    return p


def optional_float(value: str) -> float | None:
    """A float, or ``none``/``off``/empty for no value."""
    return None if value.strip().lower() in ("none", "off", "") else float(value)


def choice(*values: str) -> Callable[[str], str]:
    """One of ``values`` (case-insensitive)."""
    def convert(value: str) -> str:
        s = value.strip().lower()
        if s not in values:
            raise ValueError(f"expected one of {', '.join(values)}, got {value!r}")
        return s
    return convert


# The decoding options every speech engine takes (OpenAI's transcription rules; the whisper, faster-whisper and
# whisper.cpp engines add their own beside them).
SPEECH_DECODING: dict[str, Callable[[str], Any]] = {
    "threads": positive_int,
    "beam_size": positive_int,
    "best_of": positive_int,
    "max_new_tokens": positive_int,
    "condition_on_previous_text": boolean,
    "temperature_increment": float,
    "compression_ratio_threshold": optional_float,
    "logprob_threshold": optional_float,
    "no_speech_threshold": optional_float,
}


def parse_engine_options(engine: str, spec: Mapping[str, Option | tuple | Callable[[str], Any]],
                         options: Mapping[str, str]) -> dict[str, Any]:
    """``options`` converted by ``spec``: per name an :class:`Option`, a ``(converter, help)`` pair or a converter."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in spec:
            known = ", ".join(sorted(spec))
            raise ConfigError(f"Unknown option '{key}' for engine {engine}; known options: {known}.", param=key)
        entry = spec[key]
        convert = entry.convert if isinstance(entry, Option) else entry[0] if isinstance(entry, tuple) else entry
        try:
            out[key] = convert(value)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"Invalid value for {engine} option '{key}': {e}", param=key) from None
    return out


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """Seconds of ``text``: a number of seconds or a duration such as "30d", "12h", "1d12h" (ValueError otherwise)."""
    text = str(text).strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(a + u for a, u in parts) != text.replace(" ", ""):
            raise ValueError(f"expected seconds or a duration such as '30d' or '12h', got {text!r}") from None
        seconds = sum(float(a) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[u] for a, u in parts)
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"expected a finite duration >= 0, got {text!r}")
    return seconds
