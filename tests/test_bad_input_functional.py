"""A bad-input corpus against a real `octo serve`, on echo and on llama.cpp: every case gets its 4xx (never a 500 nor
a hang), in the API's error shape (OpenAI's; Anthropic's on /v1/messages), naming the field, with no traceback in
the body; `/health` answers after the corpus. Raw sockets where the HTTP framing is the point."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from serverproc import rss_tree, run_octo

ANY = object()  # any param
ENGINES = ["echo", "llamacpp"]
M = [{"role": "user", "content": "hi"}]
CHAT, CMPL, EMB, MSG = "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"
RESP = "/v1/responses"
AUDIO, TRANSL = "/v1/audio/transcriptions", "/v1/audio/translations"
JSON = {"Content-Type": "application/json"}


@dataclass
class Case:
    id: str
    path: str
    body: Any = None  # a dict/list (sent as JSON), bytes (sent as is) or None
    status: Any = 400  # an int, a set of ints, or {engine: either}
    param: Any = ANY  # the error's param (None included), or {engine: param}
    code: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))

    def expected(self, what: Any, engine: str) -> Any:
        return what[engine] if isinstance(what, dict) else what


def chat(**kw):
    return {"messages": M, "max_tokens": 4, **kw}


def cmpl(**kw):
    return {"max_tokens": 4, **kw}


def anth(**kw):
    return {"max_tokens": 4, "messages": M, **kw}


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "octoBOUNDARY") -> tuple[bytes, dict]:
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def gz(obj: Any) -> bytes:
    return gzip.compress(json.dumps(obj).encode())


WAV = b"RIFF" + (36).to_bytes(4, "little") + b"WAVEfmt " + bytes(20) + b"data" + bytes(4)
TEXT_FILE, TEXT_CT = multipart([("file", "notes.txt", b"this is text, not audio\n" * 20)])
NO_FILE, NO_FILE_CT = multipart([("model", None, b"whisper-1")])
EMPTY_FILE, EMPTY_FILE_CT = multipart([("file", "a.wav", b"")])
UNKNOWN_FIELD, UNKNOWN_FIELD_CT = multipart([("file", "a.wav", WAV), ("chunking_strategy", None, b"auto")])
TWO_FILES, TWO_FILES_CT = multipart([("file", "a.wav", WAV), ("file", "b.wav", WAV)])
BAD_TEMP, BAD_TEMP_CT = multipart([("file", "a.wav", WAV), ("temperature", None, b"hot")])
NESTED_PART = (b"--octoBOUNDARY\r\nContent-Disposition: form-data; name=\"file\"\r\nContent-Type: multipart/mixed; "
               b"boundary=inner\r\n\r\n--inner\r\n\r\nx\r\n--inner--\r\n\r\n--octoBOUNDARY--\r\n")
B64_PART = (b"--octoBOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Transfer-Encoding: base64\r\n\r\n" + WAV + b"\r\n--octoBOUNDARY--\r\n")
DEEP = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_OBJ = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
LLAMA_VOCAB = 4096  # the tiny synthetic GGUF's

CASES = [
    # -- /v1/chat/completions: bodies -------------------------------------------------------------------------
    Case("chat-not-json", CHAT, b"{not json", param=None, code="invalid_json"),
    Case("chat-empty-body", CHAT, b"", param=None),
    Case("chat-whitespace-body", CHAT, b"  \n ", param=None),
    Case("chat-array-body", CHAT, b"[1, 2]", param=None, code="invalid_type"),
    Case("chat-null-body", CHAT, b"null", param=None, code="invalid_type"),
    Case("chat-number-body", CHAT, b"42", param=None, code="invalid_type"),
    Case("chat-string-body", CHAT, b'"hello"', param=None, code="invalid_type"),
    Case("chat-bool-body", CHAT, b"true", param=None, code="invalid_type"),
    Case("chat-invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', param=None),
    Case("chat-latin1-body", CHAT, '{"messages": [{"role": "user", "content": "café"}]}'.encode("latin-1"), param=None),
    Case("chat-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', param=None),
    Case("chat-lone-low-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', param=None),
    Case("chat-nul-in-content", CHAT, chat(messages=[{"role": "user", "content": "a\u0000b c"}]), status={200, 400}),
    Case("chat-nul-in-stop", CHAT, chat(stop=["\u0000"]), status=200),
    Case("chat-lone-surrogate-stop", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}',
         param=None),
    Case("chat-deep-arrays", CHAT, DEEP, param=None, code="invalid_json"),
    Case("chat-deep-objects", CHAT, DEEP_OBJ, param=None, code="invalid_json"),
    Case("chat-trailing-garbage", CHAT, json.dumps(chat()).encode() + b" {}", param=None),
    Case("chat-nan-literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         param="temperature"),
    Case("chat-infinity-literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
         param="top_p"),
    # -- chat: messages ----------------------------------------------------------------------------------------
    Case("chat-no-messages", CHAT, {}, param="messages", code="missing_required_parameter"),
    Case("chat-messages-string", CHAT, {"messages": "hi"}, param="messages", code="invalid_type"),
    Case("chat-messages-object", CHAT, {"messages": {"role": "user"}}, param="messages", code="invalid_type"),
    Case("chat-messages-empty", CHAT, {"messages": []}, param="messages"),
    Case("chat-message-int", CHAT, {"messages": [1]}, param="messages[0]", code="invalid_type"),
    Case("chat-message-null", CHAT, {"messages": [None]}, param="messages[0]", code="invalid_type"),
    Case("chat-message-list", CHAT, {"messages": [M]}, param="messages[0]", code="invalid_type"),
    Case("chat-second-message-int", CHAT, {"messages": [M[0], 7]}, param="messages[1]", code="invalid_type"),
    Case("chat-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, param="messages[0].role"),
    Case("chat-role-int", CHAT, {"messages": [{"role": 1, "content": "x"}]}, param="messages[0].role"),
    Case("chat-no-role", CHAT, {"messages": [{"content": "x"}]}, param="messages[0].role",
         code="missing_required_parameter"),
    Case("chat-content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, param="messages[0].content",
         code="invalid_type"),
    Case("chat-content-object", CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]},
         param="messages[0].content", code="invalid_type"),
    Case("chat-content-part-int", CHAT, {"messages": [{"role": "user", "content": [1]}]},
         param="messages[0].content[0]", code="invalid_type"),
    Case("chat-text-part-not-string", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         param="messages[0].content[0].text", code="invalid_type"),
    Case("chat-text-part-missing-text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         param="messages[0].content[0].text", code="missing_required_parameter"),
    Case("chat-text-part-extra-key", CHAT,
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
         param="messages[0].content[0].x", code="unknown_parameter"),
    Case("chat-part-type-int", CHAT, {"messages": [{"role": "user", "content": [{"type": 3}]}]},
         param="messages[0].content[0].type", code="invalid_type"),
    Case("chat-image-part", CHAT,  # (a text-only model: the part is named, and the model in the message)
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         param="messages[0].content[0]", code="model_not_multimodal"),
    Case("chat-message-extra-key", CHAT, {"messages": [{"role": "user", "content": "x", "zz": 1}]},
         param="messages[0].zz", code="unknown_parameter"),
    Case("chat-tool-message-no-id", CHAT, {"messages": [{"role": "tool", "content": "x"}]},
         param="messages[0].tool_call_id"),
    Case("chat-function-message", CHAT, {"messages": [{"role": "function", "content": "x", "name": "f"}]},
         param="messages[0]", code="unsupported_parameter"),
    Case("chat-tool-calls-on-user", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         param="messages[0].tool_calls"),
    Case("chat-tool-call-args-object", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
         param="messages[0].tool_calls[0].function.arguments", code="invalid_type"),
    Case("chat-name-int", CHAT, {"messages": [{"role": "user", "content": "x", "name": 5}]},
         param="messages[0].name", code="invalid_type"),
    Case("chat-prompt-beyond-context", CHAT, chat(messages=[{"role": "user", "content": "w " * 9000}]),
         param="messages", code="context_length_exceeded"),
    # -- chat: parameters ----------------------------------------------------------------------------------------
    Case("chat-max-tokens-string", CHAT, chat(max_tokens="8"), param="max_tokens", code="invalid_type"),
    Case("chat-max-tokens-bool", CHAT, chat(max_tokens=True), param="max_tokens", code="invalid_type"),
    Case("chat-max-tokens-float", CHAT, chat(max_tokens=8.5), param="max_tokens", code="invalid_type"),
    Case("chat-max-tokens-zero", CHAT, chat(max_tokens=0), param="max_tokens", code="invalid_value"),
    Case("chat-max-tokens-negative", CHAT, chat(max_tokens=-1), param="max_tokens"),
    Case("chat-max-tokens-huge", CHAT, chat(max_tokens=10**30), param="max_tokens"),
    Case("chat-max-tokens-beyond-context", CHAT, chat(max_tokens=100_000), param="max_tokens"),
    Case("chat-max-completion-tokens-string", CHAT, chat(max_completion_tokens="x"), param="max_completion_tokens",
         code="invalid_type"),
    Case("chat-stream-string", CHAT, chat(stream="yes"), param="stream", code="invalid_type"),
    Case("chat-stream-int", CHAT, chat(stream=1), param="stream", code="invalid_type"),
    Case("chat-temperature-string", CHAT, chat(temperature="0.5"), param="temperature", code="invalid_type"),
    Case("chat-temperature-high", CHAT, chat(temperature=2.5), param="temperature", code="invalid_value"),
    Case("chat-temperature-negative", CHAT, chat(temperature=-1), param="temperature"),
    Case("chat-temperature-int-ok", CHAT, chat(temperature=1), status=200),
    Case("chat-top-p-zero", CHAT, chat(top_p=0), param="top_p"),
    Case("chat-top-p-string", CHAT, chat(top_p="1"), param="top_p", code="invalid_type"),
    Case("chat-n-zero", CHAT, chat(n=0), param="n"),
    Case("chat-n-huge", CHAT, chat(n=1000), param="n"),
    Case("chat-n-beyond-queue", CHAT, chat(n=73), param="n"),
    Case("chat-n-string", CHAT, chat(n="2"), param="n", code="invalid_type"),
    Case("chat-n-float", CHAT, chat(n=2.0), param="n", code="invalid_type"),
    Case("chat-seed-string", CHAT, chat(seed="1"), param="seed", code="invalid_type"),
    Case("chat-seed-huge", CHAT, chat(seed=2**70), param="seed"),
    Case("chat-seed-negative-ok", CHAT, chat(seed=-5), status=200),
    Case("chat-stop-int", CHAT, chat(stop=5), param="stop", code="invalid_type"),
    Case("chat-stop-list-int", CHAT, chat(stop=[5]), param="stop[0]", code="invalid_type"),
    Case("chat-stop-too-many", CHAT, chat(stop=[f"s{i}" for i in range(17)]), param="stop", code="invalid_value"),
    Case("chat-stop-too-long", CHAT, chat(stop=["x" * 501]), param="stop", code="invalid_value"),
    Case("chat-stop-16-of-500-ok", CHAT, chat(stop=[chr(65 + i) * 500 for i in range(16)]), status=200),
    Case("chat-stream-options-string", CHAT, chat(stream=True, stream_options="yes"), param="stream_options",
         code="invalid_type"),
    Case("chat-stream-options-unknown", CHAT, chat(stream=True, stream_options={"foo": 1}),
         param="stream_options.foo", code="unknown_parameter"),
    Case("chat-stream-options-bad-type", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}),
         param="stream_options.include_usage", code="invalid_type"),
    Case("chat-stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}),
         param="stream_options"),
    Case("chat-response-format-string", CHAT, chat(response_format="json"), param="response_format",
         code="invalid_type"),
    Case("chat-response-format-type", CHAT, chat(response_format={"type": "xml"}), param="response_format.type"),
    Case("chat-response-format-unknown", CHAT, chat(response_format={"type": "json_object", "foo": 1}),
         param="response_format.foo", code="unknown_parameter"),
    Case("chat-json-schema-unknown", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "bar": 1}}),
         param="response_format.json_schema.bar", code="unknown_parameter"),
    Case("chat-json-schema-not-object", CHAT, chat(response_format={"type": "json_schema", "json_schema": []}),
         param="response_format.json_schema", code="invalid_type"),
    Case("chat-logit-bias-list", CHAT, chat(logit_bias=[1]), param="logit_bias", code="invalid_type"),
    Case("chat-logit-bias-unicode-digit", CHAT, chat(logit_bias={"\u00b2": 1}), param="logit_bias"),
    Case("chat-logit-bias-negative-key", CHAT, chat(logit_bias={"-3": 1}), param="logit_bias"),
    Case("chat-logit-bias-word-key", CHAT, chat(logit_bias={"hello": 1}), param="logit_bias"),
    Case("chat-logit-bias-string-value", CHAT, chat(logit_bias={"5": "x"}), param="logit_bias.5",
         code="invalid_type"),
    Case("chat-logit-bias-out-of-range", CHAT, chat(logit_bias={"5": 1000}), param="logit_bias"),
    Case("chat-logit-bias-outside-vocab", CHAT, chat(logit_bias={"99999999": 1}), param="logit_bias"),
    Case("chat-unknown-param", CHAT, chat(unknown_field=1), param="unknown_field", code="unknown_parameter"),
    Case("chat-tools-not-list", CHAT, chat(tools={"type": "function"}), param="tools", code="invalid_type"),
    Case("chat-tools-web-search", CHAT, chat(tools=[{"type": "web_search"}]), param="tools[0].type"),
    Case("chat-tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
         param="tools[0].function.name"),
    Case("chat-tools-duplicate", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
         param="tools[1].function.name"),
    Case("chat-tools-unknown-key", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "foo": 1}}]),
         param="tools[0].function.foo", code="unknown_parameter"),
    Case("chat-tools-params-list", CHAT, chat(tools=[{"type": "function", "function": {"name": "f",
                                                                                       "parameters": []}}]),
         param="tools[0].function.parameters", code="invalid_type"),
    Case("chat-tool-choice-without-tools", CHAT, chat(tool_choice="required"), param="tool_choice"),
    Case("chat-tool-choice-word", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                             tool_choice="always"), param="tool_choice"),
    Case("chat-tool-choice-unknown-function", CHAT,
         chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), param="tool_choice.function.name"),
    Case("chat-tool-choice-extra-key", CHAT,
         chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "f"}, "x": 1}), param="tool_choice.x",
         code="unknown_parameter"),
    Case("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Case("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("chat-json-schema-remote-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "$ref": "http://example.com/x"}}}),
         param={"echo": "response_format", "llamacpp": "response_format.json_schema.schema"}),
    Case("chat-json-schema-strict-open", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}),
         param={"echo": "response_format", "llamacpp": "response_format.json_schema.schema"}),
    Case("chat-keep-alive-bool", CHAT, chat(keep_alive=True), param="keep_alive", code="invalid_type"),
    Case("chat-keep-alive-word", CHAT, chat(keep_alive="later"), param="keep_alive"),
    Case("chat-model-int", CHAT, chat(model=5), param="model", code="invalid_type"),
    Case("chat-model-unknown", CHAT, chat(model="gpt-99"), status=404, param="model"),
    Case("chat-user-int", CHAT, chat(user=5), param="user", code="invalid_type"),
    Case("chat-metadata-int-value", CHAT, chat(metadata={"a": 1}), param="metadata.a", code="invalid_type"),
    Case("chat-top-k-negative", CHAT, chat(top_k=-1), param="top_k"),
    Case("chat-top-k-huge", CHAT, chat(top_k=2**40), param="top_k"),
    Case("chat-repeat-penalty-zero", CHAT, chat(repeat_penalty=0), param="repeat_penalty"),
    Case("chat-frequency-penalty-high", CHAT, chat(frequency_penalty=3), param="frequency_penalty"),
    # -- /v1/completions -------------------------------------------------------------------------------------------
    Case("cmpl-no-prompt", CMPL, cmpl(), param="prompt", code="missing_required_parameter"),
    Case("cmpl-empty-string", CMPL, cmpl(prompt=""), param="prompt", code=None),
    Case("cmpl-empty-list", CMPL, cmpl(prompt=[]), param="prompt", code=None),
    Case("cmpl-list-of-empty-string", CMPL, cmpl(prompt=[""]), param="prompt", code=None),
    Case("cmpl-list-of-empty-list", CMPL, cmpl(prompt=[[]]), param="prompt", code=None),
    Case("cmpl-whitespace-only", CMPL, cmpl(prompt=["a", "   "]), status={200, 400}, param="prompt"),
    Case("cmpl-id-outside-vocab", CMPL, cmpl(prompt=[99999]), param="prompt"),
    Case("cmpl-second-list-outside-vocab", CMPL, cmpl(prompt=[[1, 2], [99999]]), param="prompt"),
    Case("cmpl-id-just-outside-llama-vocab", CMPL, cmpl(prompt=[LLAMA_VOCAB]), status={"echo": {200, 400},
                                                                                       "llamacpp": 400},
         param="prompt"),
    Case("cmpl-negative-id", CMPL, cmpl(prompt=[-1]), param="prompt"),
    Case("cmpl-negative-id-in-list", CMPL, cmpl(prompt=[[1, -5]]), param="prompt"),
    Case("cmpl-huge-id", CMPL, cmpl(prompt=[2**70]), param="prompt"),
    Case("cmpl-float-id", CMPL, cmpl(prompt=[1.5]), param="prompt[0]", code="invalid_type"),
    Case("cmpl-prompt-int", CMPL, cmpl(prompt=5), param="prompt", code="invalid_type"),
    Case("cmpl-prompt-null", CMPL, cmpl(prompt=None), param="prompt", code="invalid_type"),
    Case("cmpl-prompt-object", CMPL, cmpl(prompt={"text": "x"}), param="prompt", code="invalid_type"),
    Case("cmpl-mixed-nested", CMPL, cmpl(prompt=[[1, "a"]]), param="prompt[0][1]", code="invalid_type"),
    Case("cmpl-ids-beyond-context", CMPL, cmpl(prompt=[0] * 9000), param="prompt", code="context_length_exceeded"),
    Case("cmpl-suffix", CMPL, cmpl(prompt="x", suffix="y"), param="suffix"),
    Case("cmpl-echo-string", CMPL, cmpl(prompt="x", echo="yes"), param="echo", code="invalid_type"),
    Case("cmpl-echo-stream", CMPL, cmpl(prompt="x", echo=True, stream=True), param="echo"),
    Case("cmpl-best-of", CMPL, cmpl(prompt="x", best_of=2), param="best_of"),
    Case("cmpl-logprobs-6", CMPL, cmpl(prompt="x", logprobs=6), param="logprobs"),
    Case("cmpl-too-many-prompts", CMPL, cmpl(prompt=["x"] * 100), param="prompt"),
    Case("cmpl-nul-in-prompt", CMPL, cmpl(prompt="a\u0000b c"), status={200, 400}),
    Case("cmpl-max-tokens-string", CMPL, cmpl(prompt="x", max_tokens="8"), param="max_tokens", code="invalid_type"),
    Case("cmpl-stop-too-many", CMPL, cmpl(prompt="x", stop=["a"] * 17), param="stop"),
    Case("cmpl-unknown", CMPL, cmpl(prompt="x", foo=1), param="foo", code="unknown_parameter"),
    # -- /v1/embeddings (the tiny GGUF is not an embedding model: 400 naming model once the input passes) ---------
    Case("emb-no-input", EMB, {}, param="input", code="missing_required_parameter"),
    Case("emb-empty-string", EMB, {"input": ""}, param={"echo": "input", "llamacpp": "model"}),
    Case("emb-empty-list", EMB, {"input": []}, param="input"),
    Case("emb-id-outside-vocab", EMB, {"input": [99999]}, param={"echo": "input", "llamacpp": "model"}),
    Case("emb-negative-id", EMB, {"input": [-1]}, param="input"),
    Case("emb-negative-id-nested", EMB, {"input": [[1], [-2]]}, param="input"),
    Case("emb-empty-id-list", EMB, {"input": [[1], []]}, param="input"),
    Case("emb-input-int", EMB, {"input": 5}, param="input", code="invalid_type"),
    Case("emb-input-float-item", EMB, {"input": [1.5]}, param="input[0]", code="invalid_type"),
    Case("emb-too-many-inputs", EMB, {"input": ["a"] * 2049}, param="input"),
    Case("emb-too-many-token-ids", EMB, {"input": [[1] * 200] * 1600}, param="input"),
    Case("emb-too-much-text", EMB, {"input": "x" * 1_200_001}, param="input"),
    Case("emb-encoding-format", EMB, {"input": "x", "encoding_format": "hex"}, param="encoding_format"),
    Case("emb-dimensions-zero", EMB, {"input": "x", "dimensions": 0}, param="dimensions"),
    Case("emb-dimensions-string", EMB, {"input": "x", "dimensions": "3"}, param="dimensions", code="invalid_type"),
    Case("emb-unknown", EMB, {"input": "x", "foo": 1}, param="foo", code="unknown_parameter"),
    Case("emb-model-unknown", EMB, {"input": "x", "model": "nope"}, status=404, param="model"),
    # -- /v1/messages (Anthropic's error shape) -------------------------------------------------------------------
    Case("msg-not-json", MSG, b"{", param=None),
    Case("msg-array-body", MSG, b"[]", param=None),
    Case("msg-no-max-tokens", MSG, {"messages": M}),
    Case("msg-max-tokens-string", MSG, anth(max_tokens="8")),
    Case("msg-max-tokens-huge", MSG, anth(max_tokens=10**20)),
    Case("msg-messages-empty", MSG, anth(messages=[])),
    Case("msg-text-block-int", MSG, anth(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])),
    Case("msg-text-block-list", MSG, anth(messages=[{"role": "user", "content": [{"type": "text", "text": ["a"]}]}])),
    Case("msg-system-text-int", MSG, anth(system=[{"type": "text", "text": 5}])),
    Case("msg-system-int", MSG, anth(system=5)),
    Case("msg-content-int-item", MSG, anth(messages=[{"role": "user", "content": [1]}])),
    Case("msg-image-block", MSG, anth(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])),
    Case("msg-system-role", MSG, anth(messages=[{"role": "system", "content": "x"}])),
    Case("msg-block-extra-key", MSG, anth(messages=[{"role": "user", "content": [{"type": "text", "text": "a",
                                                                                    "zz": 1}]}])),
    Case("msg-stop-sequences-too-many", MSG, anth(stop_sequences=["s"] * 17)),
    Case("msg-stop-sequence-too-long", MSG, anth(stop_sequences=["s" * 501])),
    Case("msg-stop-sequences-string", MSG, anth(stop_sequences="s")),
    Case("msg-temperature-high", MSG, anth(temperature=1.5)),
    Case("msg-stream-string", MSG, anth(stream="yes")),
    Case("msg-unknown", MSG, anth(foo=1)),
    Case("msg-model-unknown", MSG, anth(model="nope"), status=404),
    Case("msg-count-tokens-max-tokens", "/v1/messages/count_tokens", anth()),  # not a count_tokens field
    Case("msg-count-tokens-no-messages", "/v1/messages/count_tokens", {"model": "test-model"}),
    Case("msg-wrong-method", MSG, None, status=405, method="GET"),
    # -- audio (text models here: bad forms are refused before the model is asked) --------------------------------
    Case("audio-json-body", AUDIO, {"file": "x"}, param="file"),
    Case("audio-no-content-type", AUDIO, b"abc", param="file", headers={}),
    Case("audio-broken-multipart", AUDIO, b"--nope\r\ngarbage", param="file",
         headers={"Content-Type": "multipart/form-data; boundary=octoBOUNDARY"}),
    Case("audio-multipart-no-boundary", AUDIO, b"--x--\r\n", param="file",
         headers={"Content-Type": "multipart/form-data"}),
    Case("audio-no-file", AUDIO, NO_FILE, param="file", headers=NO_FILE_CT),
    Case("audio-empty-file", AUDIO, EMPTY_FILE, param="file", headers=EMPTY_FILE_CT),
    Case("audio-two-files", AUDIO, TWO_FILES, param="file", headers=TWO_FILES_CT),
    Case("audio-unknown-field", AUDIO, UNKNOWN_FIELD, param="chunking_strategy", headers=UNKNOWN_FIELD_CT),
    Case("audio-text-file-on-text-model", AUDIO, TEXT_FILE, param="model", headers=TEXT_CT),
    Case("audio-bad-temperature", AUDIO, BAD_TEMP, param={"echo": "model", "llamacpp": "model"}, headers=BAD_TEMP_CT),
    Case("audio-gzip-encoded", AUDIO, gzip.compress(TEXT_FILE), status=415,
         headers={**TEXT_CT, "Content-Encoding": "gzip"}),
    Case("audio-translation-not-multipart", TRANSL, b"x", param="file", headers={"Content-Type": "text/plain"}),
    Case("audio-translation-no-file", TRANSL, NO_FILE, param="file", headers=NO_FILE_CT),
    Case("audio-wrong-method", AUDIO, None, status=405, method="GET"),
    # -- models, admin, info routes --------------------------------------------------------------------------------
    Case("models-unknown", "/v1/models/nope", None, status=404, param="model", method="GET"),
    Case("models-load-unknown", "/v1/models/nope/load", None, status=404, param="model"),
    Case("models-unload-unknown", "/v1/models/nope/unload", None, status=404, param="model"),
    Case("models-post", "/v1/models", {}, status=405),
    Case("models-delete", "/v1/models", None, status=405, method="DELETE"),
    Case("models-load-get", "/v1/models/nope/load", None, status=404, method="GET"),
    Case("models-delete-one", "/v1/models/nope", None, status=405, method="DELETE"),
    Case("health-post", "/health", {}, status=405),
    Case("health-delete", "/health", None, status=405, method="DELETE"),
    Case("metrics-post", "/metrics", {}, status=405),
    Case("engines-post", "/v1/engines", {}, status=405),
    Case("queue-stats-put", "/v1/queue/stats", {}, status=405, method="PUT"),
    Case("chat-get", CHAT, None, status=405, method="GET"),
    Case("chat-head", CHAT, None, status=405, method="HEAD"),
    Case("chat-options", CHAT, None, status=204, method="OPTIONS"),  # always answered (CORS preflights)
    Case("cmpl-put", CMPL, chat(), status=405, method="PUT"),
    Case("emb-delete", EMB, None, status=405, method="DELETE"),
    Case("msg-patch", MSG, anth(), status=405, method="PATCH"),
    Case("unknown-endpoint", "/v1/nothing", {}, status=404),
    Case("unknown-root", "/nothing", None, status=404, method="GET"),  # GET / is the dashboard (octo/api_dashboard.py)
    Case("dashboard-post", "/", {}, status=405),
    Case("dashboard-unknown-file", "/dashboard/nothing.js", None, status=404, method="GET"),
    # -- content types and encodings --------------------------------------------------------------------------------
    Case("ct-text-plain", CHAT, chat(), status=415, headers={"Content-Type": "text/plain"}),
    Case("ct-form", CHAT, chat(), status=415, headers={"Content-Type": "application/x-www-form-urlencoded"}),
    Case("ct-multipart-on-json", CMPL, TEXT_FILE, status=415, headers=TEXT_CT),
    Case("ct-xml", EMB, b"<input/>", status=415, headers={"Content-Type": "application/xml"}),
    Case("ct-messages-text-plain", MSG, anth(), status=415, headers={"Content-Type": "text/plain"}),
    Case("ct-none", CHAT, chat(), status=415, headers={}),  # a page's no-cors Blob post: no preflight, refused
    Case("ct-json-charset", CHAT, chat(), status=200, headers={"Content-Type": "application/json; charset=utf-8"}),
    Case("ct-vendor-json", CHAT, chat(), status=200, headers={"Content-Type": "application/vnd.api+json"}),
    Case("ce-gzip-not-compressed", CHAT, chat(), param=None, headers={**JSON, "Content-Encoding": "gzip"}),
    Case("ce-deflate-not-compressed", CHAT, chat(), param=None, headers={**JSON, "Content-Encoding": "deflate"}),
    Case("ce-unknown", CHAT, chat(), status=415, headers={**JSON, "Content-Encoding": "br"}),
    Case("ce-double", CHAT, gzip.compress(gz(chat())), status=415, headers={**JSON, "Content-Encoding": "gzip, gzip"}),
    Case("ce-gzip-ok", CHAT, gz(chat()), status=200, headers={**JSON, "Content-Encoding": "gzip"}),
    Case("ce-deflate-ok", CHAT, zlib.compress(json.dumps(chat()).encode()), status=200,
         headers={**JSON, "Content-Encoding": "deflate"}),
    Case("ce-gzip-truncated", CHAT, gz(chat())[:-12], param=None, headers={**JSON, "Content-Encoding": "gzip"}),
    Case("ce-gzip-trailing-garbage", CHAT, gz(chat()) + b"garbage", param=None,
         headers={**JSON, "Content-Encoding": "gzip"}),
    Case("ce-gzip-bad-json-inside", CHAT, gzip.compress(b"{nope"), param=None,
         headers={**JSON, "Content-Encoding": "gzip"}),
    Case("ce-messages-gzip-not-compressed", MSG, anth(), headers={**JSON, "Content-Encoding": "gzip"}),
    # -- found by fuzzing: each was a 500, a 2xx for a bad input or a wrong param --------------------------------
    Case("chat-model-name-too-long", CHAT, chat(model="x" * 5000), status=404, param="model"),
    Case("models-load-name-too-long", "/v1/models/" + "x" * 5000 + "/load", None, status=404, param="model"),
    Case("models-load-unreadable-file", "/v1/models/%2Fproc%2Fself%2Fmem/load", None, status=404, param="model"),
    Case("chat-model-many-colons", CHAT, chat(model="a:" * 5000), status=404, param="model"),
    Case("chat-model-adapter-chain", CHAT, chat(model="test-model" + ":x" * 2000), status=404, param="model"),
    Case("chat-model-unknown-home", CHAT, chat(model="~nosuchuser/m.gguf"), status=404, param="model"),
    Case("chat-keep-alive-nan", CHAT, chat(keep_alive="nan"), param="keep_alive"),
    Case("chat-keep-alive-inf", CHAT, chat(keep_alive="1e400"), param="keep_alive"),
    Case("chat-nan-in-tool-schema", CHAT,
         b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
         b'"parameters": {"type": "object", "x": NaN}}}]}', param="tools[0].function.parameters.x",
         code="invalid_value"),
    Case("msg-infinity-in-tool-input", MSG,
         b'{"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": '
         b'"f", "input": {"a": [Infinity]}}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": '
         b'"t"}]}]}'),
    Case("chat-json-schema-missing", CHAT, chat(response_format={"type": "json_schema"}),
         param="response_format.json_schema", code="missing_required_parameter"),
    Case("chat-strict-schema-properties-int", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "properties": 1, "additionalProperties": False}}}),
         param={"echo": "response_format", "llamacpp": "response_format.json_schema.schema"}),
    Case("chat-strict-schema-type-int", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": 1}}, "required": ["a"],
                                                "additionalProperties": False}}}),
         param={"echo": "response_format", "llamacpp": "response_format.json_schema.schema"}),
    Case("chat-strict-schema-required-int", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "properties": {}, "required": 1,
                                                "additionalProperties": False}}}),
         param={"echo": "response_format", "llamacpp": "response_format.json_schema.schema"}),
    Case("chat-required-tool-bad-schema", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 5}}}], tool_choice="required"),
         param={"echo": "tool_choice", "llamacpp": "tools[0].function.parameters"}),
    Case("chat-tool-message-without-call", CHAT, chat(messages=[M[0], {"role": "tool", "tool_call_id": "c1",
                                                                       "content": "r"}]),
         param="messages[1].tool_call_id"),
    Case("chat-tool-message-wrong-id", CHAT, chat(messages=[M[0], {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "r"}]), param="messages[2].tool_call_id"),
    Case("chat-tool-call-unanswered", CHAT, chat(messages=[M[0], {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, M[0]]),
         param="messages[1].tool_calls"),
    Case("resp-item-type-list", RESP, {"input": [{"type": [], "role": "user", "content": "x"}]},
         param="input[0].type"),
    Case("resp-item-type-object", RESP, {"input": [{"type": {"a": 1}, "role": "user", "content": "x"}]},
         param="input[0].type"),
    Case("resp-huge-int-in-tool-schema", RESP, {"input": "x", "max_output_tokens": 2, "store": False, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object", "x": 2**70}}]}, status=200),
    Case("resp-output-without-call", RESP, {"input": [{"type": "function_call_output", "call_id": "c1",
                                                      "output": "r"}]}, param="input[0].call_id"),
    Case("resp-call-without-output", RESP, {"input": [{"role": "user", "content": "x"}, {
        "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}, param="input[1]"),
    Case("msg-empty-content-list", MSG, anth(messages=[{"role": "user", "content": []}])),
    Case("msg-empty-content-string", MSG, anth(messages=[{"role": "user", "content": ""}, {"role": "assistant",
                                                                                         "content": "a"}, M[0]])),
    Case("msg-empty-final-assistant-ok", MSG, anth(messages=[M[0], {"role": "assistant", "content": ""}]),
         status=200),
    Case("msg-metadata-unknown-key", MSG, anth(metadata={"user_id": "u", "session": "s"})),
    Case("msg-metadata-user-id-int", MSG, anth(metadata={"user_id": 5})),
    Case("msg-context-edit-unknown-key", MSG, anth(context_management={"edits": [
        {"type": "clear_thinking_20251015", "keep": "all", "zz": 1}]})),
    Case("ct-latin1-bytes", CHAT, chat(), status=415, headers={"Content-Type": "text/\xe9"}),
    Case("ce-latin1-bytes", CHAT, chat(), status=415, headers={**JSON, "Content-Encoding": "\xe9"}),
    Case("chat-json-schema-no-name", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), param="response_format.json_schema.name", code="missing_required_parameter"),
    Case("chat-json-schema-bad-name", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "my schema", "schema": {"type": "object"}}}), param="response_format.json_schema.name"),
    Case("resp-json-schema-bad-name", RESP, {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "my schema", "schema": {"type": "object"}}}}, param="text.format.name"),
    Case("chat-n-stream-null-ok", CHAT, chat(n=None, stream=None), status=200),  # nullable in OpenAI's API
    Case("cmpl-echo-n-null-ok", CMPL, cmpl(prompt="x", echo=None, n=None, stream=None, max_tokens=None),
         status=200),
    Case("resp-store-stream-null-ok", RESP, {"input": "x", "max_output_tokens": 2, "store": None, "stream": None},
         status=200),
    Case("audio-nested-multipart", AUDIO, NESTED_PART, param="file",
         headers={"Content-Type": "multipart/form-data; boundary=octoBOUNDARY"}),
    Case("audio-base64-part", AUDIO, B64_PART, status=415,
         headers={"Content-Type": "multipart/form-data; boundary=octoBOUNDARY"}),
]


# -- servers --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=ENGINES)
def server(request):
    if request.param == "echo":
        with run_octo("test-model", "--engine", "echo") as s:
            s.engine = "echo"
            yield s
            assert "unhandled error" not in s.log(), s.log()[-4000:]
    else:
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
        from octo.synth.gguf import build_gguf

        path = str(build_gguf("tiny", ftype="q8_0"))
        with run_octo(path, "--engine", "llamacpp", "-o", "n_threads=1") as s:
            s.engine = "llamacpp"
            yield s
            assert "unhandled error" not in s.log(), s.log()[-4000:]


def send(server, method: str, path: str, body: Any = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def check_error(body: bytes, path: str, param: Any = ANY, code: str | None = None, status: int = 400) -> dict:
    """The body is an error in the API's shape (Anthropic's under /v1/messages), with no traceback."""
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text and 'File "' not in text, text
    doc = json.loads(body)
    if path.startswith("/v1/messages"):
        assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}, doc
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large"}.get(
            status, "invalid_request_error")
        assert doc["error"]["type"] == kind and doc["error"]["message"], doc
        return doc["error"]
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], doc
    assert err["type"] == ("authentication_error" if status == 401 else "invalid_request_error"), err
    if param is not ANY:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_corpus(server, case):
    status, headers, body = send(server, case.method, case.path, case.body, case.headers)
    want = case.expected(case.status, server.engine)
    assert status in (want if isinstance(want, set) else {want}), (status, body[:500])
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text and 'File "' not in text, text
    if status >= 400 and case.method != "HEAD":
        check_error(body, case.path, case.expected(case.param, server.engine), case.code, status)


def test_a_path_spelled_another_way_is_the_loaded_model(server):
    """A request naming the served file by another spelling (./, ..) uses the loaded model: it never loads the file
    again (a copy per spelling would let requests fill the memory)."""
    if server.engine != "llamacpp":
        pytest.skip("the echo engine serves no file")
    from pathlib import Path

    loaded = [m["id"] for m in server.get_json("/v1/models")["data"] if m["state"] == "ready"]
    path = Path(loaded[0])
    for other in (f"{path.parent}/./{path.name}", f"{path.parent}/../{path.parent.name}/{path.name}"):
        status, _, body = send(server, "POST", CHAT, chat(model=other), JSON)
        assert status == 200, body[:300]
    assert [m["id"] for m in server.get_json("/v1/models")["data"] if m["state"] == "ready"] == loaded


def test_corpus_has_enough_cases():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    assert {c.path for c in CASES} >= {CHAT, CMPL, EMB, MSG, AUDIO, TRANSL, "/v1/models/nope/load", "/health",
                                       "/metrics", "/v1/models"}


# -- HTTP framing, on raw sockets ---------------------------------------------------------------------------------
def raw(server, data: bytes, *, half_close: bool = False, timeout: float = 10) -> bytes:
    """Send ``data`` as is; the first response (or b"" when the server closed without one)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(rest) >= length:
                    return head + sep + rest[:length]
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return buf
            if not chunk:
                return buf
            buf += chunk


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


REQ = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
BODY = json.dumps(chat()).encode()
FRAMING = {
    # name: (bytes, half-close, allowed statuses: 0 = the server closed without answering)
    "content-length-short-then-eof": (REQ + b"Content-Length: 100\r\n\r\n" + BODY[:10], True, {0, 400}),
    "content-length-smaller-than-body": (REQ + b"Content-Length: 5\r\n\r\n" + BODY, False, {400}),
    "content-length-not-a-number": (REQ + b"Content-Length: abc\r\n\r\n", False, {400}),
    "content-length-negative": (REQ + b"Content-Length: -5\r\n\r\n", False, {400}),
    "content-length-and-chunked": (REQ + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                                   False, {400}),
    "content-length-over-the-limit": (REQ + b"Content-Length: 40000000\r\n\r\n", False, {413}),
    "chunked-bad-size": (REQ + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", False, {400}),
    "chunked-truncated-then-eof": (REQ + b"Transfer-Encoding: chunked\r\n\r\n20\r\nabc", True, {0, 400}),
    "chunked-ok": (REQ + b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(BODY):x}\r\n".encode() + BODY
                   + b"\r\n0\r\n\r\n", False, {200}),
    "header-too-long": (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", False,
                        {400, 431}),
    "too-many-headers": (b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                         + b"".join(b"X-H%d: 1\r\n" % i for i in range(300)) + b"\r\n", False, {400, 431}),
    "url-too-long": (b"GET /v1/models/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", False,
                     {400, 414}),
    "not-http": (b"HELLO WORLD\r\n\r\n", False, {400}),
    "binary-garbage": (bytes(range(256)) * 4, False, {0, 400}),
    "bad-http-version": (b"GET /health HTTP/9.9\r\nHost: localhost\r\n\r\n", False, {400, 505}),
    "header-without-colon": (b"GET /health HTTP/1.1\r\nHost: localhost\r\nBroken header\r\n\r\n", False, {400}),
}


@pytest.mark.parametrize("name", list(FRAMING))
def test_http_framing(server, name):
    data, half_close, allowed = FRAMING[name]
    t0 = time.monotonic()
    response = raw(server, data, half_close=half_close)
    assert time.monotonic() - t0 < 5, "no hang"
    status = status_of(response) if response else 0
    assert status in allowed, response[:300]
    assert b"Traceback" not in response and b'File "' not in response
    if status in (200, 413):
        head, _, body = response.partition(b"\r\n\r\n")
        assert b"application/json" in head
        if status == 413:
            check_error(body, "/v1/chat/completions", status=413)


def test_gzip_bomb_is_413_at_once_and_costs_nothing_after(server, bomb):
    """1 MB of gzip that inflates to 1 GiB: 413 quickly, inflating stops at the body limit (32 MB), and the server
    spends no CPU and keeps no memory on the rest."""
    pid = server.proc.pid
    rss0 = rss_tree(pid)
    t0 = time.monotonic()
    status, _, body = send(server, "POST", CHAT, bomb, {**JSON, "Content-Encoding": "gzip"})
    took = time.monotonic() - t0
    assert status == 413 and took < 5, (status, took)
    check_error(body, CHAT, status=413)
    cpu0 = _cpu_seconds(pid)
    time.sleep(1.0)
    assert _cpu_seconds(pid) - cpu0 < 0.3  # nothing inflates in the background
    assert rss_tree(pid) - rss0 < 150 * 2**20, (rss0, rss_tree(pid))
    assert send(server, "GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A JSON body of 1 GiB of zeros in 1 MB of gzip (built once, 4 s, then kept beside the test models)."""
    from pathlib import Path

    path = Path(os.environ["OCTO_HOME"]) / "gzip-bomb-1gib.gz"
    if not path.exists():
        comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        zeros = bytes(2**20)
        out = [comp.compress(b'{"messages": [{"role": "user", "content": "')]
        out += [comp.compress(zeros) for _ in range(1024)]
        out.append(comp.flush())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(b"".join(out))
        tmp.replace(path)
    data = path.read_bytes()
    assert len(data) < 1_100_000
    return data


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_slowloris_does_not_starve_normal_requests(server):
    """50 connections sending their headers at 1 byte per 0.5 s: normal requests still answer at once."""
    stop = threading.Event()
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        socks.append(s)

    def drip():
        while not stop.wait(0.5):
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        time.sleep(0.5)
        for _ in range(5):
            t0 = time.monotonic()
            status, _, body = send(server, "POST", CHAT, chat(), JSON, timeout=10)
            assert status == 200 and time.monotonic() - t0 < 2.0, (status, body[:200])
        assert send(server, "GET", "/health", timeout=5)[0] == 200
    finally:
        stop.set()
        dripper.join()
        for s in socks:
            s.close()


def test_health_after_the_corpus(server):
    status, _, body = send(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert "unhandled error" not in server.log()
    # malformed HTTP (the framing tests) is logged in one line each, never as a traceback
    assert "Traceback" not in server.log(), server.log()[-4000:]


# -- auth: every method of every protected route -------------------------------------------------------------------
PROTECTED = [CHAT, CMPL, EMB, MSG, AUDIO, TRANSL, "/v1/models", "/v1/models/test-model", "/v1/models/test-model/load",
             "/v1/models/test-model/unload", "/v1/engines", "/v1/queue/stats", "/v1/cache/stats", "/metrics",
             "/v1/dashboard/live", "/v1/nothing"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def test_every_method_of_every_protected_route_needs_the_key():
    with run_octo("test-model", "--engine", "echo", api_key="s3cret") as server:
        for path in PROTECTED:
            for method in METHODS:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                                {"Authorization": "Basic s3cret"}):
                    if method == "OPTIONS":  # a preflight never carries credentials: always answered, 204
                        assert send(server, method, path, None, headers)[0] == 204
                        continue
                    status, _, body = send(server, method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None,
                                           {**JSON, **headers})
                    assert status == 401, (method, path, headers, status, body[:200])
                    if method != "HEAD":
                        doc = json.loads(body)
                        kind = doc["error"]["type"]
                        assert kind == "authentication_error", (method, path, doc)
        key = {"Authorization": "Bearer s3cret"}
        assert send(server, "GET", "/health")[0] == 200  # open
        assert send(server, "GET", "/v1/models", None, key)[0] == 200
        assert send(server, "OPTIONS", CHAT, None, key)[0] == 204
        assert send(server, "POST", CHAT, chat(), {**JSON, "x-api-key": "s3cret"})[0] == 200
        for bad in ({"Authorization": "Bearer \xe9"}, {"x-api-key": "\xe9\xff"}):  # bytes that are not UTF-8
            status, _, body = send(server, "POST", CHAT, chat(), {**JSON, **bad})
            assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error", body
