"""OpenAI's ``reasoning_effort`` (Chat Completions) and ``reasoning.effort`` (Responses), mapped as Ollama maps them
onto its ``think`` levels, and ``GET /v1/responses/{id}/input_items``, through the official ``openai`` SDK against a
real `octo serve`. The echo engine with ``-o think=1`` is a model whose template reasons (``<think>`` in what it
echoes is its reasoning); without it, a model that does not reason. The effort's template arguments are checked on
a stand-in engine whose template takes them."""

from __future__ import annotations

import openai
import pytest
from serverproc import run_octo

from octo.errors import InvalidRequest, UnsupportedParameter
from octo.serving.chatprep import reasoning_kwargs

SAID = "<think> first I plan </think> then I answer"


class _Engine:
    def __init__(self, template: str) -> None:
        self.template = template

    def chat_template(self) -> str:
        return self.template


class _Handle:
    name = "m"

    def __init__(self, template: str) -> None:
        self.engine = _Engine(template)


def test_efforts_become_template_arguments_as_ollamas_think_levels():
    levels = _Handle("{% if enable_thinking %}<think>{% endif %}{{ reasoning_effort }}")
    assert reasoning_kwargs(levels, "high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert reasoning_kwargs(levels, "minimal") == {"enable_thinking": True, "reasoning_effort": "low"}
    assert reasoning_kwargs(levels, "xhigh") == {"enable_thinking": True, "reasoning_effort": "high"}  # max
    assert reasoning_kwargs(levels, "none") == {"enable_thinking": False}
    on_off = _Handle("{% if enable_thinking %}<think>{% endif %}")  # no levels: any level thinks
    assert reasoning_kwargs(on_off, "low") == {"enable_thinking": True}
    plain = _Handle("{{ messages }}")
    assert reasoning_kwargs(plain, "none") is None
    with pytest.raises(UnsupportedParameter) as e:
        reasoning_kwargs(plain, "low")
    assert e.value.param == "reasoning_effort" and e.value.status == 400
    with pytest.raises(InvalidRequest) as e:
        reasoning_kwargs(levels, "extreme", "reasoning.effort")
    assert e.value.param == "reasoning.effort" and "minimal" in e.value.message


@pytest.fixture(scope="module")
def reasoning_model():
    with run_octo("test-model", "--engine", "echo", "-o", "think=1") as s:
        yield s


def test_reasoning_effort_on_a_model_that_reasons(reasoning_model):
    oa = reasoning_model.openai()
    for effort in ("low", "medium", "high", "minimal", "none"):
        r = oa.chat.completions.create(model="test-model", messages=[{"role": "user", "content": SAID}],
                                       reasoning_effort=effort)
        msg = r.choices[0].message
        assert msg.content == "then I answer" and msg.model_extra["reasoning_content"] == "first I plan ", effort
    r = oa.responses.create(model="test-model", input=SAID, reasoning={"effort": "high"})
    assert r.output_text == "then I answer" and r.reasoning.effort == "high"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="test-model", input="x", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort"


def test_reasoning_effort_on_a_model_that_does_not_reason(echo_server):
    oa = echo_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}],
                                   reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="test-model", input="x", reasoning={"effort": "medium"})
    assert e.value.body["param"] == "reasoning.effort"
    # "none" asks for what the model does anyway; a summary alone (what Codex sends) is accepted
    r = oa.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "plain"}],
                                   reasoning_effort="none")
    assert r.choices[0].message.content == "plain"
    assert oa.responses.create(model="test-model", input="plain", reasoning={"effort": "none", "summary": "auto"}) \
        .output_text == "plain"


def test_input_items_of_a_stored_conversation(echo_server):
    oa = echo_server.openai()
    first = oa.responses.create(model="test-model", input="one", instructions="be brief")
    second = oa.responses.create(model="test-model", previous_response_id=first.id,
                                 input=[{"role": "user", "content": "two"}, {"role": "user", "content": "three"}])
    items = oa.responses.input_items.list(second.id)  # default order: newest first
    texts = [(i.role, i.content[0].text) for i in items.data]
    assert texts == [("user", "three"), ("user", "two"), ("assistant", "one"), ("user", "one")]
    assert [i.content[0].type for i in items.data] == ["input_text", "input_text", "output_text", "input_text"]
    assert not items.has_more and items.first_id == items.data[0].id and items.last_id == items.data[-1].id
    asc = oa.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["one", "one"] and asc.has_more
    rest = oa.responses.input_items.list(second.id, order="asc", after=asc.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["two", "three"] and not rest.has_more
    paged = oa.responses.input_items.list(second.id, order="asc", limit=1)  # the SDK follows has_more and after
    assert [i.content[0].text for i in paged] == ["one", "one", "two", "three"]
    assert oa.responses.input_items.list(second.id).data[0].id == items.data[0].id  # ids stay the same
    status, body = echo_server.post_json("/v1/responses", {"model": "test-model", "input": "x"})
    got = echo_server.get_json(f"/v1/responses/{body['id']}/input_items?include=message.output_text.logprobs")
    assert [i["content"][0]["text"] for i in got["data"]] == ["x"]
    with pytest.raises(openai.NotFoundError):
        oa.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.input_items.list(second.id, limit=101)
    assert e.value.body["param"] == "limit"


def test_input_items_with_tool_calls(echo_server):
    oa = echo_server.openai()
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    first = oa.responses.create(model="test-model", input=call, tools=[tool])
    (fc,) = [o for o in first.output if o.type == "function_call"]
    second = oa.responses.create(model="test-model", previous_response_id=first.id, tools=[tool],
                                 input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    items = oa.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == fc.call_id and items[1].name == "get_weather" and items[2].output == "sunny"
