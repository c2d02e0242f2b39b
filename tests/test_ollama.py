"""The Ollama translation without a server: options read as Ollama's Options.FromMap reads them (honoured, or
ignored by name in one warning line; a wrong type is Ollama's error), truncation as Ollama's chatPrompt and runner do
it, model names, request parsing (unknown keys dropped with a warning, bad values named), tool calls in Ollama's
shape (object arguments), done reasons, durations."""

from __future__ import annotations

import logging
import random

import pytest

from octo.errors import ContextLengthExceeded, InvalidRequest
from octo.protocol.ollama import ChatRequest, EmbedRequest, GenerateRequest, parse
from octo.scheduler.jobs import Result
from octo.serving.ollama import (
    Clock,
    Options,
    block_start,
    chat_messages,
    chat_prompt,
    done_reason,
    fit_window,
    model_name,
    tool_calls,
    warn_ignored,
)


class Info:
    n_ctx = 4096


class Engine:
    name = "fake"
    sampling_params = frozenset({"temperature", "top_k", "top_p", "seed"})
    penalty_last_n = 64
    info = Info()


def test_options_map_onto_sampling_and_limits():
    o = Options.parse({"temperature": 0, "top_k": 40, "top_p": 0.9, "seed": 7, "num_predict": 12, "stop": ["x"],
                       "num_ctx": 2048, "typical_p": 1.0, "num_keep": 8, "repeat_last_n": 64, "num_gpu": None},
                      Engine)
    sp = o.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed) == (0.0, 40, 0.9, 7)
    assert o.num_predict == 12 and o.stop == ["x"] and o.num_ctx == 2048 and o.num_keep == 8 and o.ignored == []
    assert Options.parse({"num_predict": -1, "seed": -1}).num_predict is None
    assert Options.parse({"seed": -1}).sampling.seed is None
    assert Options.parse({"top_k": 40.7}).sampling.top_k == 40  # an integer option takes a JSON float (Go truncates)
    assert Options.parse({"top_p": 1}).sampling.top_p == 1.0  # a float option takes a JSON integer
    assert Options.parse({"num_ctx": 0}).num_ctx is None  # 0: the model's own, as Ollama's default
    # past a sampler's range: what the samplers make of it (top_p above 1: all; a negative temperature: greedy)
    o = Options.parse({"top_p": 2, "min_p": -1, "temperature": -0.5, "top_k": -3})
    assert (o.sampling.top_p, o.sampling.min_p, o.sampling.temperature, o.sampling.top_k) == (1.0, 0.0, 0.0, 0)


# the "With options" example of Ollama's docs/api.md (0.32.15): every option Ollama's API has, and the older ones
DOCS_EXAMPLE = {"num_keep": 5, "seed": 42, "num_predict": 100, "draft_num_predict": 4, "top_k": 20, "top_p": 0.9,
                "min_p": 0.0, "typical_p": 0.7, "repeat_last_n": 33, "temperature": 0.8, "repeat_penalty": 1.2,
                "presence_penalty": 1.5, "frequency_penalty": 1.0, "penalize_newline": True, "stop": ["\n", "user:"],
                "numa": False, "num_ctx": 1024, "num_batch": 2, "num_gpu": 1, "main_gpu": 0, "use_mmap": True,
                "num_thread": 8}


def test_options_octo_cannot_use_are_ignored_by_name():
    o = Options.parse(DOCS_EXAMPLE, Engine)
    # load-time options (set when octo loads a model), unknown keys, typical sampling, a penalty window other than
    # the model's, and sampling settings this engine lacks (repeat_penalty, penalties)
    assert sorted(o.ignored) == sorted(["draft_num_predict", "typical_p", "repeat_last_n", "repeat_penalty",
                                        "presence_penalty", "frequency_penalty", "penalize_newline", "numa",
                                        "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"])
    assert o.sampling.changed() <= Engine.sampling_params  # what the engine cannot apply is not asked of it
    assert (o.num_keep, o.num_ctx, o.num_predict, o.stop) == (5, 1024, 100, ["\n", "user:"])
    unknown = Options.parse({"mirostat": 2, "tfs_z": 0.5, "logit_bias": {"1": 5}, "no_such_option": "x"}, Engine)
    assert unknown.ignored == ["mirostat", "tfs_z", "logit_bias", "no_such_option"]
    assert Options.parse({"repeat_last_n": -1}, type("E", (Engine,), {"penalty_last_n": 4096})).ignored == []
    assert Options.parse({"repeat_penalty": 0}).ignored == ["repeat_penalty"]  # no meaning: ignored, not applied


def test_one_warning_line_names_the_ignored_options(caplog):
    with caplog.at_level(logging.WARNING, "octo.serving.ollama"):
        warn_ignored("/api/chat", ["num_thread", "\x1b[31mred", "num_thread"])
        warn_ignored("/api/chat", [])
    (rec,) = caplog.records
    assert "num_thread" in rec.getMessage() and "\\x1b" in rec.getMessage()  # quoted: no raw escape in the log


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": "hot"}, 'option "temperature" must be of type float32'),
    ({"top_k": True}, 'option "top_k" must be of type integer'),
    ({"num_thread": "8"}, 'option "num_thread" must be of type integer'),
    ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean'),
    ({"stop": "x"}, 'option "stop" must be of type array'),
    ({"stop": ["x", 1]}, 'option "stop" must be of an array of strings'),
])
def test_a_value_of_the_wrong_type_is_ollamas_error(options, message):
    with pytest.raises(InvalidRequest) as e:
        Options.parse(options)
    assert e.value.message == message and e.value.param == f"options.{next(iter(options))}"


# -- truncation --------------------------------------------------------------------------------------------------
class WordEngine:
    """A chat template and tokenizer in words: each message renders as its role and its words."""

    @staticmethod
    def tokenize(text: str, special: bool = True) -> list[str]:
        return text.split()


def render(messages: list[dict]) -> str:
    return " ".join(f"{m['role']} {m.get('content') or ''}" for m in messages) + " assistant"


def ollama_chat_prompt(messages: list[dict], window: int) -> str:
    """Ollama's chatPrompt loop as written (server/prompt.go): each start in turn until one fits."""
    start = 0
    for i in range(len(messages)):
        start = block_start(messages, i)
        kept = [m for m in messages[:start] if m["role"] == "system"] + messages[start:]
        if len(WordEngine.tokenize(render(kept))) <= window or i == len(messages) - 1:
            break
    return render([m for m in messages[:start] if m["role"] == "system"] + messages[start:])


def msg(role: str, words: int, calls: bool = False) -> dict:
    m = {"role": role, "content": " ".join(["w"] * words)}
    if calls:
        m["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    return m


def test_the_oldest_turns_go_the_system_message_and_the_last_stay():
    convo = [msg("system", 5), msg("user", 20), msg("assistant", 20), msg("user", 20), msg("assistant", 20),
             msg("user", 10)]
    text, tokens = chat_prompt(WordEngine, convo, render, 60, True)
    assert text == render([convo[0], *convo[3:]])  # system + the latest turns that fit
    assert len(tokens) <= 60
    assert chat_prompt(WordEngine, convo, render, 1000, True)[0] == render(convo)  # fits: unchanged
    assert chat_prompt(WordEngine, convo, render, 60, False)[0] == render(convo)  # truncate: false
    # the last message is kept even when it alone does not fit (the runner's cut handles it)
    assert chat_prompt(WordEngine, convo, render, 8, True)[0] == render([convo[0], convo[-1]])


def test_a_tool_result_keeps_the_turn_that_called_it():
    convo = [msg("system", 2), msg("user", 30), msg("assistant", 3, calls=True), msg("tool", 3), msg("tool", 3),
             msg("user", 4)]
    assert block_start(convo, 4) == 2 and block_start(convo, 3) == 2 and block_start(convo, 5) == 5
    text, _ = chat_prompt(WordEngine, convo, render, 30, True)
    assert text == render([convo[0], *convo[2:]])  # not a tool result without its call


def test_truncation_matches_ollamas_loop():
    rng = random.Random(7)
    roles = ["user", "assistant", "tool", "system"]
    for _ in range(300):
        convo = [msg(rng.choice(roles), rng.randint(0, 30), calls=rng.random() < 0.3)
                 for _ in range(rng.randint(1, 14))]
        window = rng.randint(1, 200)
        assert chat_prompt(WordEngine, convo, render, window, True)[0] == ollama_chat_prompt(convo, window), convo


def test_a_prompt_that_still_does_not_fit_is_cut_as_ollamas_runner_cuts_it():
    tokens = list(range(100))
    assert fit_window(tokens, 101, 4, True, True) == tokens  # room for one token: unchanged
    cut = fit_window(tokens, 40, 4, True, True)
    assert cut[:4] == [0, 1, 2, 3] and cut[4:] == tokens[-(len(cut) - 4):]  # num_keep first, then the latest
    assert len(cut) == 40 - (40 - 4) // 2  # half the room left for the answer, as Ollama's context shift
    assert fit_window(tokens, 40, -1, True, True)[:39] == tokens[:39]  # num_keep -1: keep all (to the window)
    with pytest.raises(ContextLengthExceeded) as e:
        fit_window(tokens, 40, 4, False, True)
    assert e.value.status == 400 and "exceeds the context length" in e.value.message
    with pytest.raises(ContextLengthExceeded) as e:
        fit_window(tokens, 40, 4, True, False)
    assert "longer than the context length" in e.value.message


def test_model_names():
    assert model_name("smollm-360m:latest") == "smollm-360m"
    assert model_name("smollm-360m:8bit") == "smollm-360m:8bit"
    assert model_name("org/name") == "org/name"
    with pytest.raises(InvalidRequest):
        model_name("")


def test_parse_drops_unknown_keys_with_a_warning_and_names_bad_values(caplog):
    req = parse(ChatRequest, b'{"model": "m", "messages": [{"role": "USER", "content": "hi"}], "tools": []}')
    assert req.messages[0].role == "user" and req.streaming
    with caplog.at_level(logging.WARNING, "octo.protocol.ollama"):
        req = parse(ChatRequest, b'{"model": "m", "nope": 1, "messages": [{"role": "user", "content": "x", '
                                 b'"extra": 1}]}', "/api/chat")
    assert not req.model_extra and not req.messages[0].model_extra  # dropped, as Ollama's Go decoder drops them
    (rec,) = caplog.records
    assert "/api/chat" in rec.getMessage() and '"nope"' in rec.getMessage() and "messages[0].extra" in rec.getMessage()
    for body, where in ((b'{"model": "m", "think": "extreme"}', "think"),
                        (b'{"model": "m", "stream": "yes"}', "stream"),
                        (b'{"model": "m", "options": {"x": NaN}}', None)):
        with pytest.raises(InvalidRequest) as e:
            parse(ChatRequest, body)
        assert where is None or e.value.param == where, body
    with pytest.raises(InvalidRequest):
        parse(GenerateRequest, b"")
    assert parse(EmbedRequest, b'{"model": "m", "input": ["a", "b"]}').input == ["a", "b"]


def test_tool_calls_have_object_arguments_and_tool_results_find_their_call():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert tool_calls(calls) == [{"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]
    req = parse(ChatRequest, b'{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": '
                             b'[{"function": {"name": "f", "arguments": {"a": 1}}}]}, {"role": "tool", '
                             b'"content": "2", "tool_name": "f"}]}')
    assistant, tool = chat_messages(req)
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] and tool["name"] == "f"


def test_done_reason_and_durations_in_nanoseconds():
    r = Result("x", "tool_calls", 10, 3, 0, [1, 2, 3], prompt_eval_s=0.25, eval_s=0.5)
    assert done_reason(r) == "stop" and done_reason(Result("x", "length", 1, 1, 0, [1])) == "length"
    m = Clock(start=1.0, loaded=1.5, done=3.0).metrics(r)
    assert m == {"total_duration": 2_000_000_000, "load_duration": 500_000_000, "prompt_eval_count": 10,
                 "prompt_eval_duration": 250_000_000, "eval_count": 3, "eval_duration": 500_000_000}
