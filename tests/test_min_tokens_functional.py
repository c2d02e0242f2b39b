"""``min_tokens`` (vLLM's and MAX's): no end of sequence and no stop string before that many generated tokens, on chat
and completions, streamed and not, through the official openai SDK against a real `octo serve` on the echo engine (a
scripted model: told it may not end yet, it says its message again). The real engines (llama.cpp, ONNX, MLX) are
checked in tests/test_structured_functional.py with the end-of-sequence token made near certain by logit_bias."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

MODEL = "test-model"


@pytest.fixture(scope="module")
def client(echo_server):
    return echo_server.openai(max_retries=0)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_chat_runs_on_to_min_tokens(client):
    r = chat(client, "one two three")
    assert r.choices[0].message.content == "one two three" and r.usage.completion_tokens == 3
    r = chat(client, "one two three", extra_body={"min_tokens": 7})
    assert r.choices[0].message.content == "one two three one two three one"
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "stop"
    r = chat(client, "one two three", extra_body={"min_tokens": 2})  # already past it: no change
    assert r.choices[0].message.content == "one two three"
    r = chat(client, "one two three", max_tokens=5, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_streamed_and_several_choices(client):
    stream = chat(client, "alpha beta", stream=True, n=2, extra_body={"min_tokens": 5})
    texts = ["", ""]
    finish = [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == ["alpha beta alpha beta alpha"] * 2 and finish == ["stop", "stop"]


def test_stop_strings_wait_for_min_tokens(client):
    r = chat(client, "a b c d e f", stop=["c"])
    assert r.choices[0].message.content == "a b "
    r = chat(client, "a b c d e f", stop=["c"], extra_body={"min_tokens": 9})
    assert r.choices[0].message.content == "a b c d e f a b " and r.choices[0].finish_reason == "stop"


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="x y", max_tokens=20, extra_body={"min_tokens": 5})
    assert r.choices[0].text == "x y x y x" and r.usage.completion_tokens == 5


def test_bad_min_tokens_are_400s(client):
    for kw, param in (({"min_tokens": 9}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                      ({"min_tokens": "3"}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "x", max_tokens=8, extra_body=kw)
        assert e.value.body["param"] == param or param in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", max_completion_tokens=3, extra_body={"min_tokens": 4})
    assert "max_completion_tokens" in e.value.body["message"]


def test_ignore_eos_runs_to_max_tokens_and_stops_still_end(client):
    """``ignore_eos`` (vLLM's, llama-server's): the sequence never ends at its end token, so max_tokens (or the
    context) ends it; a stop string still does (unlike min_tokens)."""
    r = chat(client, "one two three", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "one two three one two three one two"
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    r = chat(client, "one two three", max_tokens=8, extra_body={"ignore_eos": False})
    assert r.choices[0].message.content == "one two three" and r.choices[0].finish_reason == "stop"
    r = chat(client, "a b c d", max_tokens=30, stop=["d"], extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "a b c " and r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="x y", max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    chunks = list(c)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "x y x y x"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", extra_body={"ignore_eos": "sometimes"})
    assert e.value.body["param"] == "ignore_eos" or "ignore_eos" in e.value.body["message"]
