"""The OpenAI and Anthropic surfaces end to end: a real `octo serve --engine echo` process, official SDKs."""

import base64
import json
import math
import urllib.request

import anthropic
import numpy as np
import openai
import pytest

MSG = [{"role": "user", "content": "the quick brown fox"}]


def test_chat_completion(echo_server):
    client = echo_server.openai()
    r = client.chat.completions.create(model="test-model", messages=MSG)
    assert r.choices[0].message.content == "the quick brown fox"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.model == "test-model"


def test_chat_max_tokens_and_stop(echo_server):
    client = echo_server.openai()
    r = client.chat.completions.create(model="test-model", messages=MSG, max_tokens=2)
    assert r.choices[0].message.content == "the quick" and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="test-model", messages=MSG, stop=["own f"])
    assert r.choices[0].message.content == "the quick br" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="test-model", messages=MSG, max_completion_tokens=1)
    assert r.choices[0].message.content == "the"


def test_chat_streaming_shape(echo_server):
    client = echo_server.openai()
    chunks = list(client.chat.completions.create(model="test-model", messages=MSG, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "the quick brown fox"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_stream_ends_with_done(echo_server):
    body = json.dumps({"model": "test-model", "messages": MSG, "stream": True}).encode()
    req = urllib.request.Request(echo_server.url("/v1/chat/completions"), body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        raw = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_streaming_equals_non_streaming_with_n(echo_server):
    client = echo_server.openai()
    r = client.chat.completions.create(model="test-model", messages=MSG, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "the quick brown fox" for c in r.choices)
    assert r.usage.completion_tokens == 12
    texts = {}
    finishes = {}
    for c in client.chat.completions.create(model="test-model", messages=MSG, n=3, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {0: "the quick brown fox", 1: "the quick brown fox", 2: "the quick brown fox"}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


def test_completions(echo_server):
    client = echo_server.openai()
    r = client.completions.create(model="test-model", prompt="one two three four five", max_tokens=3)
    assert r.choices[0].text == "one two three" and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="test-model", prompt=["a b", "c d e"], max_tokens=10)
    assert [c.text for c in r.choices] == ["a b", "c d e"]
    assert r.usage.prompt_tokens == 5
    r = client.completions.create(model="test-model", prompt="x y", echo=True)
    assert r.choices[0].text == "x yx y"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="test-model", prompt="alpha beta gamma", stream=True) if c.choices)
    assert text == "alpha beta gamma"


def test_embeddings(echo_server):
    client = echo_server.openai()
    r = client.embeddings.create(model="test-model", input=["hello world", "hello world", "other"])
    v = [d.embedding for d in r.data]
    assert len(v) == 3 and len(v[0]) == 64
    assert v[0] == v[1] and v[0] != v[2]
    assert math.isclose(sum(x * x for x in v[0]), 1.0, rel_tol=1e-5)
    assert r.usage.prompt_tokens == 5
    one = client.embeddings.create(model="test-model", input="hello world", encoding_format="float")
    assert one.data[0].embedding == pytest.approx(v[0])


def test_embeddings_base64(echo_server):
    body = json.dumps({"model": "test-model", "input": "hi", "encoding_format": "base64"}).encode()
    req = urllib.request.Request(echo_server.url("/v1/embeddings"), body, {"Content-Type": "application/json"})
    data = json.loads(urllib.request.urlopen(req).read())
    vec = np.frombuffer(base64.b64decode(data["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (64,) and abs(float(np.dot(vec, vec)) - 1) < 1e-5


def test_models(echo_server):
    client = echo_server.openai()
    models = client.models.list()
    # the served model first, then catalog models this host could load on demand (the synthetic demo, ...)
    assert [m.id for m in models.data if m.model_extra["state"] != "available"] == ["test-model"]
    assert models.data[0].model_extra["state"] == "ready"
    assert all(m.model_extra.get("source") == "catalog" for m in models.data[1:])
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_model_is_404(echo_server):
    client = echo_server.openai()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-99", messages=MSG)
    assert "gpt-99" in str(e.value)


def test_anthropic_messages(echo_server):
    client = anthropic.Anthropic(base_url=echo_server.base_url, api_key="none")
    m = client.messages.create(model="test-model", max_tokens=100, system="be brief",
                               messages=[{"role": "user", "content": "red green blue"}])
    assert m.content[0].text == "red green blue" and m.stop_reason == "end_turn"
    assert m.usage.output_tokens == 3
    m = client.messages.create(model="test-model", max_tokens=2, messages=[{"role": "user", "content": "a b c"}])
    assert m.content[0].text == "a b" and m.stop_reason == "max_tokens"
    m = client.messages.create(model="test-model", max_tokens=50, stop_sequences=["c"],
                               messages=[{"role": "user", "content": "a b c d"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "c" and m.content[0].text == "a b "
    with client.messages.stream(model="test-model", max_tokens=100,
                                messages=[{"role": "user", "content": "one two three"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "one two three" and final.stop_reason == "end_turn"


def test_anthropic_errors_are_anthropic_shaped(echo_server):
    client = anthropic.Anthropic(base_url=echo_server.base_url, api_key="none")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="test-model", max_tokens=10, extra_body={"temperature": 3},
                               messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_info_endpoints(echo_server):
    def get(path):
        with urllib.request.urlopen(echo_server.url(path)) as r:
            return r.status, r.headers, r.read()

    status, _, body = get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    engines = json.loads(get("/v1/engines")[2])
    names = {e["name"] for e in engines["data"]}
    assert {"echo", "llamacpp", "mlx", "onnx", "whisper"} <= names
    assert len(names) == len(engines["data"])  # each engine once
    assert [e["name"] for m in engines["models"] for e in m.get("data", [])] == []  # not again under models
    assert engines["active"] == "echo" and engines["models"][0]["active"] == "echo"
    for e in engines["data"]:
        assert {"name", "available", "reason", "tasks", "formats", "benchmark"} <= set(e)
    q = json.loads(get("/v1/queue/stats")[2])
    assert {"pending", "active", "calls_running", "max_depth", "total_processed", "total_rejected"} <= set(q)
    c = json.loads(get("/v1/cache/stats")[2])
    assert {"entries", "bytes", "hits", "misses", "hit_rate"} <= set(c)
    status, headers, body = get("/metrics")
    text = body.decode()
    assert headers["Content-Type"].startswith("text/plain")
    assert 'octo_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "octo_request_duration_seconds_bucket" in text
    assert "octo_generated_tokens_total" in text and "octo_queue_depth" in text and "octo_cache_hits_total" in text


def test_prefix_cache_hit_for_shared_system_prompt(echo_server):
    client = echo_server.openai()
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(40))}
    before = json.loads(urllib.request.urlopen(echo_server.url("/v1/cache/stats")).read())
    a = client.chat.completions.create(model="test-model", messages=[system, {"role": "user", "content": "q one"}])
    b = client.chat.completions.create(model="test-model", messages=[system, {"role": "user", "content": "q two"}])
    after = json.loads(urllib.request.urlopen(echo_server.url("/v1/cache/stats")).read())
    assert a.choices[0].message.content == "q one" and b.choices[0].message.content == "q two"
    assert b.usage.prompt_tokens_details.cached_tokens >= 40
    assert after["hits"] > before["hits"] and after["entries"] >= 1


def test_transcription_on_chat_model_is_400(echo_server):
    client = echo_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="test-model", file=("a.wav", b"RIFF0000WAVE", "audio/wav"))
    assert "transcription" in str(e.value)


def test_text_parts_and_blocks(echo_server):
    """Content as typed parts (OpenAI) and blocks (Anthropic, system included) is read part by part."""
    client = echo_server.openai()
    parts = [{"type": "text", "text": "red green"}, {"type": "text", "text": " blue"}]
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": parts}])
    assert r.choices[0].message.content == "red green blue"
    ac = anthropic.Anthropic(base_url=echo_server.base_url, api_key="none")
    m = ac.messages.create(model="test-model", max_tokens=20, system=[{"type": "text", "text": "be brief"}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": "one two",
                                                                    "cache_control": {"type": "ephemeral"}}]}])
    assert m.content[0].text == "one two"
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="test-model", max_tokens=20, system=[{"type": "text", "text": 5}],
                           messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 400 and "system[0].text" in e.value.body["error"]["message"]


def test_compressed_request_bodies(echo_server):
    import gzip
    import zlib

    raw = json.dumps({"model": "test-model", "messages": MSG}).encode()
    for coding, data in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw))):
        req = urllib.request.Request(echo_server.url("/v1/chat/completions"), data,
                                     {"Content-Type": "application/json", "Content-Encoding": coding})
        with urllib.request.urlopen(req) as r:
            assert json.loads(r.read())["choices"][0]["message"]["content"] == "the quick brown fox"
