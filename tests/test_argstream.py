"""Forced tool calls stream their arguments as they are generated (octo.text.toolcalls ``live``,
octo.text.toolscan.ArgsPrefix):
a call goes out once its name is written, its arguments piece by piece, an unfinished number or escape held back,
and the pieces add up to exactly the arguments a whole parse finds. Text no strict JSON parser reads back (1e999, a
lone surrogate) is never sent: the sequence fails instead."""

from __future__ import annotations

import random

import pytest

from octo.errors import EngineError
from octo.text.toolcalls import FORMATS, ToolCallArguments, ToolCallStart, assemble, parse_tool_calls
from octo.text.toolcalls import ToolCallParser as Parser

ARGS = '{"city": "Par\\u00e9s \\ud83d\\ude00 \\"q\\"", "n": -12.5e3, "ok": true, "list": [1, 22, {"z": null}]}'
NAMES = ("get_weather", "other")


def forced_text(fmt: str, calls: list[tuple[str, str]]) -> str:
    """What a forced-call grammar writes: the family's markup around ``{"name": NAME, "<args_key>": ARGS}``."""
    f = FORMATS[fmt]
    bodies = [f'{{"name": "{n}", "{f.args_key}": {a}}}' for n, a in calls]
    return f.begin + f.separator.join(f.call_open + b + f.call_close for b in bodies) + f.end


def feed_chars(parser: Parser, text: str) -> list[tuple[int, object]]:
    """(characters fed so far, event) for every event, the text fed one character at a time."""
    out = []
    for i, c in enumerate(text):
        out += [(i + 1, ev) for ev in parser.feed(c)]
    return out + [(len(text), ev) for ev in parser.finish()]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_call_arguments_stream_as_written(fmt):
    calls = [("get_weather", ARGS)] + ([("other", '{"x": 1}')] if fmt != "gemma" else [])
    text = forced_text(fmt, calls)
    timed = feed_chars(Parser(fmt, NAMES, live=True), text)
    events = [ev for _, ev in timed]
    whole = parse_tool_calls(text, fmt, NAMES)
    got = assemble(events)
    assert got.content == whole.content == ""
    assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls]
    assert [c["function"]["arguments"] for c in got.tool_calls] == [a for _, a in calls]
    first_args = [ev for ev in events if isinstance(ev, ToolCallArguments) and ev.index == 0]
    assert len(first_args) > 10  # piece by piece, not one delta
    start = next(n for n, ev in timed if isinstance(ev, ToolCallStart))
    assert start < text.index(ARGS) + 2  # the call goes out as its arguments begin
    sent = ""
    for ev in first_args:  # no piece ends inside a number or an escape
        sent += ev.delta
        rest = ARGS[len(sent):]
        assert not (sent[-1:].isdigit() and rest[:1] in "0123456789.eE"), sent
        tail = sent[sent.rfind("\\"):] if "\\" in sent else ""
        assert not tail or len(tail) >= 2 and (tail[1] != "u" or len(tail) >= 6), sent
        assert not sent.endswith("\\ud83d"), sent  # a high surrogate waits for its low one


def test_random_splits_add_up_to_the_arguments():
    text = forced_text("hermes", [("get_weather", ARGS), ("other", '{"y": [0.5, -0, 7e-3]}')])
    rng = random.Random(7)
    for _ in range(50):
        parser, events, i = Parser("hermes", NAMES, live=True), [], 0
        while i < len(text):
            j = i + rng.randint(1, 9)
            events += parser.feed(text[i:j])
            i = j
        events += parser.finish()
        got = assemble(events)
        assert [c["function"]["arguments"] for c in got.tool_calls] == [ARGS, '{"y": [0.5, -0, 7e-3]}']


@pytest.mark.parametrize("bad, why", [("1e999", "1e999"), ("-2E+400", r"-2E\+400"), ('"\\ud800x"', "surrogate"),
                                      ('"\\udc00"', "surrogate")])
def test_unsafe_arguments_fail_the_call_and_never_go_out(bad, why):
    text = forced_text("hermes", [("get_weather", '{"city": "Paris", "n": ' + bad + ', "m": 1}')])
    parser, sent = Parser("hermes", NAMES, live=True), ""
    with pytest.raises(EngineError, match=why) as err:
        for c in text:
            sent += "".join(ev.delta for ev in parser.feed(c) if isinstance(ev, ToolCallArguments))
    assert "must not be run" in str(err.value)
    quote = '"' if bad.startswith('"') else ""
    assert sent == '{"city": "Paris", "n": ' + quote, sent  # what went out is a JSON prefix without the bad value


def test_truncated_live_call_ends_with_what_was_generated():
    head = forced_text("hermes", [("get_weather", "{}")]).split("{}")[0]
    for cut, ok in (('{"city": "Pa', True), ('{"n": 12', True), ('{"n": 1e3', True), ('{"n": 1e999', False),
                    ('{"n": 1e', True), ('{"n": [1, 2]}', True)):
        parser = Parser("hermes", NAMES, live=True)
        events = [ev for c in head + cut for ev in parser.feed(c)]
        if not ok:
            with pytest.raises(EngineError, match="1e999"):
                parser.finish(truncated=True)
            assert "1e999" not in "".join(getattr(ev, "delta", "") for ev in events)
            continue
        events += parser.finish(truncated=True)
        got = assemble(events)
        assert [c["function"]["arguments"] for c in got.tool_calls] == [cut], (cut, events)
        assert got.content == ""


def test_a_live_call_that_stops_short_fails():
    parser = Parser("hermes", NAMES, live=True)
    parser.feed(forced_text("hermes", [("get_weather", "{}")]).split("{}")[0] + '{"city": "Pa')
    with pytest.raises(EngineError, match="ended before the call was complete"):
        parser.finish()  # a stop sequence inside the call: not truncated, not a call


def test_without_live_a_call_is_one_delta():
    text = forced_text("hermes", [("get_weather", ARGS)])
    events = [ev for _, ev in feed_chars(Parser("hermes", NAMES), text)]
    assert [type(ev) for ev in events] == [ToolCallStart, ToolCallArguments] and events[1].delta == ARGS
