"""Every bad input gets a 4xx with the OpenAI error shape, naming the field (raw HTTP)."""

import json
import urllib.error
import urllib.request

import pytest
from serverproc import run_octo


def post(server, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url(path), data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(status_body, status, param=None, contains=None):
    code, body = status_body
    assert code == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err


OK = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    (b'"a string"', 400, None),
    ({"model": "test-model"}, 400, "messages"),
    ({"model": "test-model", "messages": "hi"}, 400, "messages"),
    ({"model": "test-model", "messages": []}, 400, "messages"),
    ({"model": "test-model", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({**OK, "temperature": 2.5}, 400, "temperature"),
    ({**OK, "temperature": -0.1}, 400, "temperature"),
    ({**OK, "top_p": 0}, 400, "top_p"),
    ({**OK, "top_p": 1.5}, 400, "top_p"),
    ({**OK, "max_tokens": 0}, 400, "max_tokens"),
    ({**OK, "n": 0}, 400, "n"),
    ({**OK, "unknown_field": 1}, 400, "unknown_field"),
    ({**OK, "frequency_penalty": 0.5}, 400, "frequency_penalty"),  # echo cannot honour it
    ({**OK, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({**OK, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # a Unicode digit int() cannot read: not a 500
    ({**OK, "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    ({**OK, "n": 73}, 400, "n"),  # more than --max-queue + --max-batch can ever admit: 400, never a 503 to retry
    ({**OK, "keep_alive": "later"}, 400, "keep_alive"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400,
     "tool_choice"),  # echo cannot constrain its output
    ({**OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**OK, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "test-model", "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
])
def test_chat_bad_inputs(echo_server, body, status, param):
    assert_error(post(echo_server, "/v1/chat/completions", body), status, param)


def test_unknown_model_404(echo_server):
    assert_error(post(echo_server, "/v1/chat/completions", {**OK, "model": "nope"}), 404, "model", "nope")
    assert_error(post(echo_server, "/v1/embeddings", {"model": "nope", "input": "x"}), 404, "model")


def test_abandoned_non_stream_requests_are_cancelled():
    """Clients that give up on a non-stream request: its sequence leaves the batch, counted as cancelled."""
    import concurrent.futures
    import time

    for isolation in ("thread", "process"):
        with run_octo("m", "--engine", "echo", "-o", "token_delay_ms=50", "--isolation", isolation) as server:
            def give_up(_, url=server.url("/v1/chat/completions")):
                body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w " * 200}]}).encode()
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=0.3)
                except OSError:
                    return True
                return False

            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                assert all(pool.map(give_up, range(20)))
            deadline = time.monotonic() + 3
            while True:
                stats = server.get_json("/v1/queue/stats")
                if stats["active"] == 0 and stats["pending"] == 0:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            assert stats["total_cancelled"] == 20 and stats["total_processed"] == 0, stats


def test_completions_and_embeddings_bad_inputs(echo_server):
    assert_error(post(echo_server, "/v1/completions", {"model": "test-model", "prompt": ["x"] * 100}), 400,
                 "prompt")
    assert_error(post(echo_server, "/v1/completions", {"model": "test-model"}), 400, "prompt")
    assert_error(post(echo_server, "/v1/completions", {"model": "test-model", "prompt": "x", "suffix": "y"}),
                 400, "suffix")
    assert_error(post(echo_server, "/v1/embeddings", {"model": "test-model", "input": ""}), 400, "input")
    assert_error(post(echo_server, "/v1/embeddings", {"model": "test-model", "input": "x", "dimensions": 3}),
                 400, "dimensions")


def test_unknown_endpoint_and_method(echo_server):
    assert_error(post(echo_server, "/v1/nothing", {}), 404)
    req = urllib.request.Request(echo_server.url("/v1/chat/completions"))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 405 and "error" in json.loads(e.value.read())


def test_body_too_large_is_413():
    with run_octo("m", "--engine", "echo", "--max-body-mb", "0.01") as server:
        big = {**OK, "model": "m", "messages": [{"role": "user", "content": "x " * 20000}]}
        assert_error(post(server, "/v1/chat/completions", big), 413)


def test_prompt_longer_than_context_is_400():
    with run_octo("m", "--engine", "echo", "-o", "n_ctx=32") as server:
        long = {"model": "m", "messages": [{"role": "user", "content": "w " * 100}]}
        assert_error(post(server, "/v1/chat/completions", long), 400, "messages", "maximum context length is 32")
        over = {"model": "m", "messages": [{"role": "user", "content": "w"}], "max_tokens": 100}
        assert_error(post(server, "/v1/chat/completions", over), 400, "max_tokens", "32")


def test_unknown_engine_option_fails_at_start():
    with pytest.raises(RuntimeError, match="Unknown option 'bogus'"):
        with run_octo("m", "--engine", "echo", "-o", "bogus=1", timeout=30):
            pass


def test_token_ids_outside_the_vocabulary_and_empty_prompts(echo_server):
    """In the gateway and in an engine worker: ids the model does not have, negative ids and empty prompts are a 400
    naming the field, never an engine error."""
    for prompt in ([99999], [[1, 2], [99999]], [-1], [[0, -5]], "", [], [""], [[]]):
        assert_error(post(echo_server, "/v1/completions", {"model": "test-model", "prompt": prompt}), 400, "prompt")
    for inp in ([99999], [[0], [99999]], [-1], [[0], [-2]], [[]]):
        assert_error(post(echo_server, "/v1/embeddings", {"model": "test-model", "input": inp}), 400, "input")
    ok = post(echo_server, "/v1/completions", {"model": "test-model", "prompt": [0, 0], "max_tokens": 2})
    assert ok[0] == 200, ok


@pytest.mark.parametrize("body,param", [
    ({**OK, "max_tokens": "8"}, "max_tokens"),
    ({**OK, "max_tokens": True}, "max_tokens"),
    ({**OK, "stream": "yes"}, "stream"),
    ({**OK, "temperature": "0.5"}, "temperature"),
    ({**OK, "messages": [1]}, "messages[0]"),
    ({**OK, "stream_options": "yes", "stream": True}, "stream_options"),
    ({**OK, "response_format": "json"}, "response_format"),
])
def test_wrong_types_are_invalid_type_never_coerced(echo_server, body, param):
    code, err = post(echo_server, "/v1/chat/completions", body)
    assert_error((code, err), 400, param)
    assert err["error"]["code"] == "invalid_type"
