"""The Ollama translation without a server: options honoured or refused by name, model names, request parsing
(unknown keys and bad values named), tool calls in Ollama's shape (object arguments), done reasons, durations."""

from __future__ import annotations

import pytest

from octo.errors import InvalidRequest, UnsupportedParameter
from octo.protocol.ollama import ChatRequest, EmbedRequest, GenerateRequest, parse
from octo.scheduler.jobs import Result
from octo.serving.ollama import Clock, Options, chat_messages, done_reason, model_name, tool_calls


class Engine:
    name = "fake"
    sampling_params = frozenset({"temperature", "top_k", "top_p", "seed"})


def test_options_map_onto_sampling_and_limits():
    o = Options.parse({"temperature": 0, "top_k": 40, "top_p": 0.9, "seed": 7, "num_predict": 12, "stop": ["x"],
                       "num_ctx": 2048, "mirostat": 0, "typical_p": 1.0, "num_gpu": None}, Engine)
    sp = o.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed) == (0.0, 40, 0.9, 7)
    assert o.num_predict == 12 and o.stop == ["x"] and o.num_ctx == 2048
    assert Options.parse({"num_predict": -1, "seed": -1}).num_predict is None
    assert Options.parse({"seed": -1}).sampling.seed is None
    assert Options.parse({"top_k": 40.0}).sampling.top_k == 40  # an integer option takes a JSON float (Go does)


@pytest.mark.parametrize(("options", "named"), [
    ({"repeat_penalty": 1.1}, "options.repeat_penalty"),  # the engine cannot
    ({"mirostat": 2}, "options.mirostat"),
    ({"num_gpu": 1}, "options.num_gpu"),
    ({"num_thread": 4}, "options.num_thread"),
])
def test_unhonoured_options_are_400s_naming_them(options, named):
    with pytest.raises(UnsupportedParameter) as e:
        Options.parse(options, Engine)
    assert e.value.param == named and e.value.status == 400


@pytest.mark.parametrize("options", [{"temperature": "hot"}, {"stop": "x"}, {"top_p": 2}, {"num_ctx": 0},
                                     {"top_k": True}])
def test_bad_option_values(options):
    with pytest.raises(InvalidRequest) as e:
        Options.parse(options)
    assert e.value.param.startswith("options.")


def test_model_names():
    assert model_name("smollm-360m:latest") == "smollm-360m"
    assert model_name("smollm-360m:8bit") == "smollm-360m:8bit"
    assert model_name("org/name") == "org/name"
    with pytest.raises(InvalidRequest):
        model_name("")


def test_parse_names_unknown_keys_and_bad_values():
    req = parse(ChatRequest, b'{"model": "m", "messages": [{"role": "USER", "content": "hi"}], "tools": []}')
    assert req.messages[0].role == "user" and req.streaming
    for body, where in ((b'{"model": "m", "nope": 1}', "nope"),
                        (b'{"model": "m", "messages": [{"role": "user", "content": "x", "extra": 1}]}',
                         "messages[0].extra"),
                        (b'{"model": "m", "think": "extreme"}', "think"),
                        (b'{"model": "m", "stream": "yes"}', "stream")):
        with pytest.raises(InvalidRequest) as e:
            parse(ChatRequest, body)
        assert e.value.param == where, body
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
