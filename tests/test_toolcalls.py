"""Tool-call formats (octo.text.toolcalls): family detection from chat templates, parsing of each family's output (text
around calls, several calls, malformed calls kept as text), streaming equal to the whole-text parse at every split,
rendering round trips, and the fallback prompt for templates without tool support."""

from __future__ import annotations

import json
import random
import re
import time

import jinja2
import pytest

from octo.errors import InvalidRequest
from octo.synth.tokenizer import CHAT_TEMPLATE as SYNTH_CHATML
from octo.text.toolcalls import (
    FORMATS,
    ContentDelta,
    ParsedMessage,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    assemble,
    detect_format,
    new_call_id,
    parse_tool_calls,
    to_openai_delta,
)
from octo.text.toolprompt import prepare_chat, tool_system_prompt

NAMES = ["get_weather", "get_time"]
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for n in NAMES]

# Excerpts of the real templates (the parts format detection looks at).
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions "
    "to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>"
    "\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}{%- endfor %}"
)
LLAMA31 = (
    "{{- bos_token }}{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
    "{%- if builtin_tools is defined or tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}{%- if builtin_tool is defined %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- endif %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{%- elif message.role == \"tool\" or message.role == \"ipython\" %}"
    "{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}"
)
LLAMA32 = (
    "{{- bos_token }}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}{%- if tools is not none %}"
    "{{- \"Environment: ipython\\n\" }}{%- endif %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
    "{{- '\"parameters\": ' }}{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}"
)
MISTRAL = (
    "{%- for message in loop_messages %}{%- if message[\"role\"] == \"user\" %}{%- if tools is not none and "
    "(message == user_messages[-1]) %}{{- \"[AVAILABLE_TOOLS] [\" }}{%- for tool in tools %}{%- endfor %}"
    "{{- \"[/AVAILABLE_TOOLS]\" }}{%- endif %}{{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- \"[TOOL_CALLS] [\" }}"
    "{%- elif message[\"role\"] == \"tool\" %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string }}"
)
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not "
    "none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + "
    "'<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
# Gemma 3's template (text parts only): no tools, and roles must alternate after an optional system turn.
GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- set role = \"model\" if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)


def test_detect_format_from_templates():
    cases = [(QWEN25, "hermes", "template"), (LLAMA31, "llama3", "template"), (LLAMA32, "llama3", "template"),
             (MISTRAL, "mistral", "template"), (PHI4_MINI, "phi4", "system_field"), (GEMMA3, "gemma", "prompt"),
             (SYNTH_CHATML, "hermes", "prompt"), (None, "hermes", "prompt")]
    for template, family, tools_in in cases:
        fmt = detect_format(template)
        assert (fmt.name, fmt.tools_in) == (family, tools_in), template[:60] if template else template
    assert detect_format(QWEN25, override="gemma").name == "gemma"
    with pytest.raises(InvalidRequest) as info:
        detect_format(QWEN25, override="nope")
    assert info.value.param == "tool_format"


def test_call_ids():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id("mistral"))
    assert len({new_call_id() for _ in range(200)}) == 200
    call = parse_tool_calls('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "mistral").tool_calls[0]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])  # Mistral's templates refuse other ids


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})

# (family, model output, expected content, expected calls)
CASES = [
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [WEATHER]),
    ("hermes", f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", "Let me check.",
     [WEATHER, TIME]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\nI asked the weather service.", "I asked the weather service.",
     [WEATHER]),
    ("hermes", f"<tool_call>{W}", "", [WEATHER]),  # close tag missing at the end: still a call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', None, []),  # malformed
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "",
     [WEATHER]),  # arguments as a JSON string
    ("hermes", "Use <b>bold</b> or <tool_ and {braces} freely.", None, []),
    ("hermes", '<tool_call>\n{"type": "function", "function": {"name": "get_time", "arguments": {}}}\n</tool_call>',
     "", [TIME]),
    ("hermes", "<tool_call>\n{\"name\": \"get_time\"}} oops\n</tool_call>", None, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', "",
     [WEATHER, TIME]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {}}', "", [TIME]),
    ("llama3", 'Sure. <|python_tag|>{"type": "function", "name": "get_time", "parameters": {}}', "Sure.", [TIME]),
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris")', "",
     [("brave_search", {"query": "weather in Paris"})]),
    ("llama3", '{"name": "unknown_tool", "parameters": {}}', None, []),  # bare JSON must name an offered tool
    ("llama3", '{"answer": 42}', None, []),
    ("llama3", 'The JSON is {"name": "get_time", "parameters": {}}', None, []),  # bare JSON only at the start
    ("llama3", '{"name": "get_time", "parameters": {}}; and then', "; and then", [TIME]),
    ("mistral", f"[TOOL_CALLS] [{W[:-1]}, \"id\": \"abcdefghi\"}}, {T}]", "", [WEATHER, TIME]),
    ("mistral", f"[{W}]", "", [WEATHER]),  # [TOOL_CALLS] decoded to nothing (a special token)
    ("mistral", 'I will check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "I will check.", [WEATHER]),
    ("mistral", "[1, 2, 3] are numbers", None, []),
    ("mistral", f"[TOOL_CALLS] [{W}", None, []),  # unterminated array
    ("phi4", f"<|tool_call|>[{W}, {T}]<|/tool_call|>", "", [WEATHER, TIME]),
    ("phi4", f"functools[{W}]", "", [WEATHER]),
    ("phi4", f"Checking.<|tool_call|>[{W}]", "Checking.", [WEATHER]),
    ("phi4", f"[{T}]", "", [TIME]),
    ("phi4", "<|tool_call|>[not json]<|/tool_call|>", None, []),
    ("gemma", 'Sure.\n```tool_code\nget_weather(city="Paris")\n```', "Sure.", [WEATHER]),
    ("gemma", '```tool_code\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
              '{"name": "get_time", "parameters": {}}\n```', "", [WEATHER, TIME]),
    ("gemma", '```tool_code\n[get_weather(city="Paris"), get_time()]\n```\nDone.', "Done.", [WEATHER, TIME]),
    ("gemma", '```tool_code\nget_weather("Paris")\n```', None, []),  # positional arguments: not a call
    ("gemma", "```python\nprint('hi')\n```", None, []),
    ("gemma", f"```json\n{W.replace('arguments', 'parameters')}\n```", "", [WEATHER]),
    ("gemma", "Plain answer, no tools.", None, []),
]


def _calls(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_parse(family, text, content, calls):
    parsed = parse_tool_calls(text, family, NAMES)
    assert _calls(parsed) == calls
    assert parsed.content == (text if content is None else content)
    for call in parsed.tool_calls:
        assert call["type"] == "function" and call["id"]
        assert isinstance(call["function"]["arguments"], str)


def _fixed_ids():
    n = iter(range(10**6))
    return lambda: f"id{next(n)}"


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_streaming_equals_whole_parse_at_every_split(family, text, content, calls):
    whole = parse_tool_calls(text, family, NAMES, new_id=_fixed_ids())
    for cut in range(len(text) + 1):
        p = ToolCallParser(family, NAMES, new_id=_fixed_ids())
        assert assemble(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()) == whole, cut
    p = ToolCallParser(family, NAMES, new_id=_fixed_ids())
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert assemble(events) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        p = ToolCallParser(family, NAMES, new_id=_fixed_ids())
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert assemble([e for part in parts for e in p.feed(part)] + p.finish()) == whole


def test_events_and_openai_deltas():
    p = ToolCallParser("hermes", NAMES, new_id=lambda: "call_x")
    events = p.feed(f"Hi <tool_call>\n{W}\n</tool_call>") + p.finish()
    assert events == [ContentDelta("Hi"), ToolCallStart(0, "call_x", "get_weather"),
                      ToolCallArguments(0, '{"city": "Paris"}')]
    assert to_openai_delta(events[0]) == {"content": "Hi"}
    assert to_openai_delta(events[1]) == {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                                          "function": {"name": "get_weather", "arguments": ""}}]}
    assert to_openai_delta(events[2]) == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
    with pytest.raises(RuntimeError):
        p.feed("more")


def test_text_is_not_held_longer_than_needed():
    p = ToolCallParser("hermes", NAMES)
    assert p.feed("Hello world, ") == [ContentDelta("Hello world,")]  # trailing space held until we know more
    assert p.feed("see <tool") == [ContentDelta(" see")]  # "<tool" could open a call
    assert p.feed("s> are tags") == [ContentDelta(" <tools> are tags")]
    p = ToolCallParser("mistral", NAMES)  # a bare "[" opens a call only as '[{"'
    assert assemble(p.feed("[Note: this")).content == "[Note: this"
    p = ToolCallParser("llama3", NAMES)
    assert assemble(p.feed("{not JSON")).content == "{not JSON"


def test_long_call_streams_in_linear_time():
    args = {"path": "a.txt", "content": "x\\\"y " * 5000}
    text = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": args}) + "\n</tool_call>"
    t0 = time.perf_counter()
    p = ToolCallParser("hermes", NAMES)
    events = [e for i in range(0, len(text), 3) for e in p.feed(text[i:i + 3])] + p.finish()
    assert time.perf_counter() - t0 < 2.0
    assert json.loads(assemble(events).tool_calls[0]["function"]["arguments"]) == args


@pytest.mark.parametrize("family", list(FORMATS))
def test_render_calls_round_trip(family):
    fmt = FORMATS[family]
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    text = fmt.render_calls(calls)
    assert _calls(fmt.parse(text, NAMES)) == [WEATHER, TIME]
    prefixed = fmt.parse("Before. " + text, NAMES)
    if family == "llama3":  # bare JSON is a call only at the start of the answer
        assert not prefixed.tool_calls
    else:
        assert prefixed.content == "Before." and len(prefixed.tool_calls) == 2


def test_prepare_chat_native_template():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = prepare_chat(messages, TOOLS, detect_format(QWEN25))
    assert chat.tools == TOOLS
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates use |tojson
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def test_prepare_chat_phi4_system_field():
    chat = prepare_chat([{"role": "user", "content": "Weather?"}], TOOLS, detect_format(PHI4_MINI))
    assert chat.tools is None and chat.messages[0]["role"] == "system"
    assert [f["name"] for f in json.loads(chat.messages[0]["tools"])] == NAMES
    rendered = jinja2.Environment().from_string(PHI4_MINI).render(messages=chat.messages, add_generation_prompt=True)
    assert rendered.startswith("<|system|><|tool|>[") and rendered.endswith("<|user|>Weather?<|end|><|assistant|>")


def test_prepare_chat_fallback_prompt_renders_with_gemma_template():
    fmt = detect_format(GEMMA3)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather and time in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    chat = prepare_chat(messages, TOOLS, fmt, tool_choice="required")
    assert chat.tools is None
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    system = chat.messages[0]["content"]
    assert system.startswith("Be brief.") and "get_weather" in system and "```tool_code" in system
    assert "must call" in system
    assert _calls(fmt.parse(chat.messages[2]["content"], NAMES)) == [("get_weather", {"city": "P"}), TIME]
    assert chat.messages[3]["content"].count("<tool_response>") == 2 and '"name": "get_time"' in chat.messages[3][
        "content"]

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env = jinja2.Environment()
    env.globals["raise_exception"] = raise_exception
    out = env.from_string(GEMMA3).render(messages=chat.messages, bos_token="<bos>", add_generation_prompt=True)
    assert out.count("<start_of_turn>") == 4 and out.endswith("<start_of_turn>model\n")


def test_tool_system_prompt_example_parses():
    for family, fmt in FORMATS.items():
        prompt = tool_system_prompt(TOOLS, fmt, {"type": "function", "function": {"name": "get_time"}})
        example = prompt.split("parameters schema):\n", 1)[1].split("\nCall a function", 1)[0]
        assert fmt.parse(example, NAMES).tool_calls, family
        assert "get_time now" in prompt


# -- arguments as written, truncated calls (issue 35) ---------------------------------------------------------------
@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1.50, "y": 1e5}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1.50, "y": 1e5}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1.50, "y": 1e5}'),
    ("llama3", '{"name": "f", "parameters": {"x": 1.50, "y": 1e5}}'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1.50, \\"y\\": 1e5}"}\n</tool_call>'),
])
def test_arguments_keep_the_models_text(fmt, text):
    parsed = parse_tool_calls(text, fmt, ["f"])
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"x": 1.50, "y": 1e5}'], parsed


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1e999}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"x": -Infinity}}\n</tool_call>',
])
def test_numbers_without_a_json_value_are_no_call(text):
    parsed = parse_tool_calls(text, "hermes", ["f"])
    assert parsed.tool_calls == [] and parsed.content == text
    assert parse_tool_calls("```tool_code\nf(x=1e999)\n```", "gemma", ["f"]).tool_calls == []


def test_truncated_call_is_a_call_with_what_was_generated():
    cut = 'Sure. <tool_call>\n{"name": "f", "arguments": {"city": "Pa'
    parsed = parse_tool_calls(cut, "hermes", ["f"], truncated=True)
    assert parsed.content == "Sure." and [(c["function"]["name"], c["function"]["arguments"])
                                          for c in parsed.tool_calls] == [("f", '{"city": "Pa')]
    assert parse_tool_calls(cut, "hermes", ["f"]).tool_calls == []  # not cut off: an unfinished call is text
    for markup in ("<tool_c", '<tool_call>\n{"na'):  # cut before the name: markup of no call
        assert parse_tool_calls(markup, "hermes", ["f"], truncated=True) == ParsedMessage("", [])
    whole = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_'  # only its closing tag is cut
    parsed = parse_tool_calls(whole, "hermes", ["f"], truncated=True)
    assert parsed.content == "" and parsed.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    streamed = ToolCallParser("hermes", ["f"])
    events = [e for piece in cut for e in streamed.feed(piece)] + streamed.finish(truncated=True)
    assert assemble(events).tool_calls[0]["function"]["arguments"] == '{"city": "Pa'
