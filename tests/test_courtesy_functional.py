"""Courtesies browser and SDK clients rely on: CORS (--cors-origins), OPTIONS always answered, the OpenAI routes
without /v1, POST /tokenize and /detokenize (llama-server's and vLLM's shapes). A real `octo serve --engine echo`."""

import http.client
import json

import openai
import pytest
from click.testing import CliRunner
from serverproc import run_octo

ORIGIN = "http://localhost:3000"
KEY = "s3cret"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "the quick brown fox"}]}


def send(server, method, path, body=None, headers=None):
    """(status, headers (a repeated header joined by ", "), body bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        names = {k.lower() for k, _ in r.getheaders()}
        return r.status, {k: r.getheader(k) for k in names}, r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def cors_server():
    with run_octo("test-model", "--engine", "echo", "--cors-origins", f"{ORIGIN}, https://App.Example.com/",
                  api_key=KEY) as server:
        yield server


AUTH = {"Authorization": f"Bearer {KEY}"}


# -- CORS ----------------------------------------------------------------------------------------------------------
def test_cors_is_off_by_default_and_options_is_still_answered(echo_server):
    # a page of another origin is refused outright (docs/security.md), and gets no CORS headers
    status, headers, body = send(echo_server, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in headers and "vary" not in headers
    for path in ("/v1/chat/completions", "/v1/models", "/health", "/nothing", "/chat/completions"):
        status, headers, body = send(echo_server, "OPTIONS", path, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert status == 204 and body == b"", (path, status, body)
        assert not any(k.startswith("access-control-") for k in headers), headers


def test_preflight_from_an_allowed_origin_needs_no_key(cors_server):
    asked = "authorization, content-type, x-stainless-os, openai-organization, anthropic-version"
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/tokenize", "/nothing/at/all"):
        status, h, body = send(cors_server, "OPTIONS", path, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
        assert status == 204 and body == b"", (path, status, body)
        assert h["access-control-allow-origin"] == ORIGIN
        assert "POST" in h["access-control-allow-methods"] and "GET" in h["access-control-allow-methods"]
        assert h["access-control-allow-headers"] == asked
        assert int(h["access-control-max-age"]) > 0
        assert "Origin" in h["vary"]
    # no headers asked for: the ones the SDKs send are named
    _, h, _ = send(cors_server, "OPTIONS", "/v1/messages", headers={"Origin": "https://app.example.com",
                                                                     "Access-Control-Request-Method": "POST"})
    assert h["access-control-allow-origin"] == "https://app.example.com"
    allowed = h["access-control-allow-headers"].lower()
    assert all(n in allowed for n in ("authorization", "content-type", "x-api-key", "anthropic-version"))
    # a public page calling a server on localhost (Chrome's Private Network Access)
    _, h, _ = send(cors_server, "OPTIONS", "/v1/models", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "GET", "Access-Control-Request-Private-Network": "true"})
    assert h["access-control-allow-private-network"] == "true"
    # OPTIONS that is not a preflight, with or without the key: 204 too
    assert send(cors_server, "OPTIONS", "/v1/chat/completions")[0] == 204
    assert send(cors_server, "OPTIONS", "/v1/chat/completions", headers=AUTH)[0] == 204


def test_a_disallowed_origin_gets_no_cors_headers(cors_server):
    status, h, _ = send(cors_server, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 204 and not any(k.startswith("access-control-") for k in h)
    assert "Origin" in h["vary"]
    status, h, _ = send(cors_server, "GET", "/v1/models", headers={"Origin": "http://localhost:3001", **AUTH})
    assert status == 403 and "access-control-allow-origin" not in h and "Origin" in h["vary"]


def test_answers_and_errors_to_an_allowed_origin_carry_cors(cors_server):
    o = {"Origin": ORIGIN}
    status, h, _ = send(cors_server, "GET", "/v1/models", headers={**o, **AUTH})
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN and h["x-request-id"]
    exposed = h["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "retry-after" in exposed
    cases = [("POST", "/v1/chat/completions", CHAT, o, 401),  # no key
             ("POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, {**o, **AUTH}, 404),
             ("POST", "/v1/chat/completions", {**CHAT, "foo": 1}, {**o, **AUTH}, 400),
             ("GET", "/v1/nothing", None, {**o, **AUTH}, 404),
             ("GET", "/v1/chat/completions", None, {**o, **AUTH}, 405)]
    for method, path, body, headers, want in cases:
        status, h, raw = send(cors_server, method, path, body, headers)
        assert status == want, (path, status, raw)
        assert h["access-control-allow-origin"] == ORIGIN, (path, h)
        assert "error" in json.loads(raw)
    # a stream: its headers go out before the handler returns
    status, h, raw = send(cors_server, "POST", "/v1/chat/completions", {**CHAT, "stream": True},
                          {**o, **AUTH, "X-Request-Id": "req-mine"})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert h["access-control-allow-origin"] == ORIGIN and h["x-request-id"] == "req-mine"


def test_any_origin_from_the_environment():
    with run_octo("test-model", "--engine", "echo", env={"OCTO_CORS_ORIGINS": "*"}) as server:
        for origin in ("https://anything.example", "null"):
            status, h, _ = send(server, "GET", "/v1/models", headers={"Origin": origin})
            assert status == 200 and h["access-control-allow-origin"] == origin


def test_bad_cors_origins_flag():
    from octo.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--cors-origins", "localhost:3000", "m"])
    assert result.exit_code == 2 and "--cors-origins" in result.output


# -- the OpenAI routes without /v1 ------------------------------------------------------------------------------------
def test_openai_sdk_without_v1(echo_server):
    client = openai.OpenAI(base_url=echo_server.base_url, api_key="none")
    r = client.chat.completions.create(model="test-model", messages=CHAT["messages"])
    assert r.choices[0].message.content == "the quick brown fox"
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="test-model", messages=CHAT["messages"], stream=True) if c.choices)
    assert text == "the quick brown fox"
    assert "test-model" in [m.id for m in client.models.list()]
    assert client.models.retrieve("test-model").id == "test-model"
    assert client.completions.create(model="test-model", prompt="a b c", max_tokens=2).choices[0].text
    assert len(client.embeddings.create(model="test-model", input="hello").data[0].embedding) > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # the metrics count them under the /v1 route
    _, _, body = send(echo_server, "GET", "/metrics")
    metrics = body.decode()
    assert 'endpoint="/v1/chat/completions"' in metrics and 'endpoint="/chat/completions"' not in metrics


def test_anthropic_messages_without_v1(echo_server):
    body = {"model": "test-model", "max_tokens": 16, "messages": CHAT["messages"]}
    status, _, raw = send(echo_server, "POST", "/messages", body)
    assert status == 200 and json.loads(raw)["content"][0]["text"] == "the quick brown fox"
    status, _, raw = send(echo_server, "POST", "/messages", {**body, "foo": 1})
    assert status == 400 and json.loads(raw)["type"] == "error"  # Anthropic's error shape there too


def test_unprefixed_routes_need_the_key_too():
    with run_octo("test-model", "--engine", "echo", api_key=KEY) as server:
        assert send(server, "GET", "/models")[0] == 401
        assert send(server, "POST", "/chat/completions", CHAT)[0] == 401
        assert send(server, "POST", "/tokenize", {"content": "a"})[0] == 401
        assert send(server, "GET", "/models", headers=AUTH)[0] == 200


# -- /tokenize, /detokenize -----------------------------------------------------------------------------------------
def post(server, path, body):
    status, _, raw = send(server, "POST", path, body)
    return status, json.loads(raw)


def test_tokenize_round_trip(echo_server):
    text = "the quick brown fox"
    for path in ("/tokenize", "/v1/tokenize"):
        status, doc = post(echo_server, path, {"content": text})
        assert status == 200, doc
        assert len(doc["tokens"]) == 4 and all(isinstance(t, int) for t in doc["tokens"])
        assert doc["count"] == 4 and doc["max_model_len"] > 0
    status, back = post(echo_server, "/detokenize", {"tokens": doc["tokens"]})
    assert status == 200 and back["content"] == text and back["prompt"] == text
    assert post(echo_server, "/v1/detokenize", {"tokens": doc["tokens"], "model": "test-model"})[1]["content"] == text
    assert post(echo_server, "/detokenize", {"tokens": []}) == (200, {"content": "", "prompt": ""})
    assert post(echo_server, "/tokenize", {"content": ""})[1]["tokens"] == []


def test_tokenize_with_pieces_and_vllm_shape(echo_server):
    status, doc = post(echo_server, "/tokenize", {"content": "the quick brown fox", "with_pieces": True,
                                                  "add_special": True, "parse_special": False})
    assert status == 200, doc
    assert [t["piece"] for t in doc["tokens"]] == ["the", " quick", " brown", " fox"]
    plain = post(echo_server, "/tokenize", {"content": "the quick brown fox"})[1]["tokens"]
    assert [t["id"] for t in doc["tokens"]] == plain
    status, doc = post(echo_server, "/tokenize", {"model": "test-model", "prompt": "the quick brown fox",
                                                  "add_special_tokens": False})
    assert status == 200 and doc["tokens"] == plain and doc["count"] == 4 and doc["max_model_len"] > 0


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"content": "a", "foo": 1}, "foo"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "prompt"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "add_special": True, "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1], "foo": 1}, "foo"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_bad_input_is_400(echo_server, path, body, param):
    status, doc = post(echo_server, path, body)
    assert status == 400, doc
    assert doc["error"]["param"].split("[")[0] == param, doc


def test_tokenize_unknown_model_is_404(echo_server):
    status, doc = post(echo_server, "/tokenize", {"content": "a", "model": "nope"})
    assert status == 404 and doc["error"]["param"] == "model"


class _BosEngine:
    """A tokenizer like llama.cpp's for a model that adds BOS: one token per character, "<s>" parsed when special,
    no doubled BOS."""

    PIECES = {1: b"", 2: b"a", 3: b"b", 4: b"\xe2"}

    def tokenize(self, text, special=True):
        out = [1]
        while text:
            if special and text.startswith("<s>"):
                out.append(1)
                text = text[3:]
            else:
                out.append({"a": 2, "b": 3}.get(text[0], 4))
                text = text[1:]
        return out[1:] if out[:2] == [1, 1] else out

    def token_bytes(self, token):
        return self.PIECES[token]

    def special_tokens(self):
        return {"<s>": 1}


def test_tokenize_model_side_add_special_and_pieces():
    from types import SimpleNamespace

    from octo.errors import InvalidRequest
    from octo.serving import tokens as api_tokens

    h = SimpleNamespace(engine=_BosEngine(), info=SimpleNamespace(n_vocab=5, n_ctx=64), name="m", engine_name="x")
    assert api_tokens.tokenize(h, "ab", False, True, False)["tokens"] == [2, 3]
    assert api_tokens.tokenize(h, "ab", True, True, False)["tokens"] == [1, 2, 3]
    assert api_tokens.tokenize(h, "<s>ab", False, True, False)["tokens"] == [1, 2, 3]  # the text's own BOS stays
    assert api_tokens.tokenize(h, "", False, True, False)["tokens"] == []
    pieces = api_tokens.tokenize(h, "a\u2603", True, True, True)["tokens"]
    assert pieces == [{"id": 1, "piece": "<s>"}, {"id": 2, "piece": "a"}, {"id": 4, "piece": [0xe2]}]
    assert api_tokens.detokenize(h, [1, 2, 3]) == "<s>ab"
    with pytest.raises(InvalidRequest) as e:
        api_tokens.detokenize(h, [2, 5])
    assert e.value.param == "tokens"
