"""octo.logsafe.quoted: a value from a request or a file name in a log line, written as Go's %q writes it (Ollama's
slog lines), so that it cannot forge a line or colour the operator's terminal."""

from __future__ import annotations

from pathlib import Path

from octo.logsafe import quoted


def test_control_and_invisible_characters_are_escaped():
    forged = 'x\n2099-01-01 ERROR forged\r\t\x1b[31mred\x1b[0m\x00\u009b\u2028\u2029\u202e"q"\\'
    out = quoted(forged)
    assert out == ('"x\\n2099-01-01 ERROR forged\\r\\t\\x1b[31mred\\x1b[0m\\x00\\u009b\\u2028\\u2029\\u202e'
                   '\\"q\\"\\\\"')
    assert out.isprintable() and "\n" not in out


def test_printable_text_stays_readable():
    assert quoted("modèle-ü 模型") == '"modèle-ü 模型"'
    assert quoted(Path("/tmp/a b")) == '"/tmp/a b"' and quoted(b"\xff\xfe") == '"\\\\xff\\\\xfe"'


def test_bare_leaves_a_plain_value_as_it_is():
    assert quoted("/v1/chat/completions", bare=True) == "/v1/chat/completions"
    assert quoted("demo:latest", bare=True) == "demo:latest"
    for needs in ("a b", "", 'a"b', "a=b", "a\nb", "a\\b"):
        assert quoted(needs, bare=True) == quoted(needs), needs


def test_long_values_are_cut_and_say_so():
    out = quoted("m" * 1000, limit=10)
    assert out == '"mmmmmmmmmm"...(990 more)'
    assert quoted("m" * 1000, limit=10, bare=True) == out
