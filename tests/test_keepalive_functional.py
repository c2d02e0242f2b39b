"""Streams that never go silent (issue 51), against a real `octo serve`: while a streamed request waits for its
model's load, the queue or its prompt's prefill, every API sends its own keep-alive at ``--stream-keepalive``
(Anthropic ``ping`` events, Responses ``response.in_progress`` events, SSE comments on chat and completions, empty
chunks on Ollama's API), through the official clients the answer is unchanged, an error after the headers is the
API's error event, a quick error keeps its status, and a client that goes away cancels its request.

The model is ``slowprefill`` (tests/plugins/slowprefill.py): echo whose prompt tokens cost ``prefill_ms`` each, fed
a few at a time; every prompt is new (random words), so no prefix-cache hit shortens a prefill. The bounds are
generous: keep-alives every 0.5 s must leave no gap over 2 s on a busy host."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serverproc import REPO, run_octo

PLUGINS = str(REPO / "tests" / "plugins")
INTERVAL = 0.5
MAX_GAP = INTERVAL + 1.5
PREFILL_MS = 25  # a prompt of N words prefills in about N * 25 ms
SERVE = ("slow", "--engine", "slowprefill", "--plugins-dir", PLUGINS, "--stream-keepalive", str(INTERVAL),
         "-o", f"prefill_ms={PREFILL_MS}", "-o", "prefill_chunk=8")


def words(n: int) -> str:
    """``n`` words no earlier prompt had (no prefix-cache hit)."""
    tag = random.randrange(10**9)
    return " ".join(f"w{tag}x{i}" for i in range(n))


@pytest.fixture(scope="module")
def server():
    with run_octo(*SERVE) as s:
        yield s


# -- what each API's stream looks like -----------------------------------------------------------------------------
def _sse_data(line: str) -> dict | None:
    return json.loads(line[6:]) if line.startswith("data: {") else None


def _chat(line):
    d = _sse_data(line)
    return d["choices"][0]["delta"].get("content") if d and d.get("choices") else None


def _completion(line):
    d = _sse_data(line)
    return d["choices"][0]["text"] if d and d.get("choices") else None


def _responses(line):
    d = _sse_data(line)
    return d["delta"] if d and d["type"] == "response.output_text.delta" else None


def _messages(line):
    d = _sse_data(line)
    return d["delta"]["text"] if d and d["type"] == "content_block_delta" else None


def _ollama(line):
    d = json.loads(line)
    text = d["message"]["content"] if "message" in d else d["response"]
    return text or None


def _ollama_beat(line):
    d = json.loads(line)
    return not d["done"] and not (d["message"]["content"] if "message" in d else d["response"])


# path, body of a prompt, the text a line adds to the answer (None: not content), whether a line is a keep-alive
APIS = {
    "chat": ("/v1/chat/completions", lambda p: {"messages": [{"role": "user", "content": p}]}, _chat,
             lambda line: line == ": keep-alive"),
    "completions": ("/v1/completions", lambda p: {"prompt": p, "max_tokens": 500}, _completion,
                    lambda line: line == ": keep-alive"),
    "responses": ("/v1/responses", lambda p: {"input": p}, _responses,
                  lambda line: line == "event: response.in_progress"),
    "messages": ("/v1/messages", lambda p: {"max_tokens": 500, "messages": [{"role": "user", "content": p}]},
                 _messages, lambda line: line == "event: ping"),
    "ollama-chat": ("/api/chat", lambda p: {"messages": [{"role": "user", "content": p}]}, _ollama, _ollama_beat),
    "ollama-generate": ("/api/generate", lambda p: {"prompt": p, "raw": True}, _ollama, _ollama_beat),
}


def timed_lines(server, api: str, prompt: str, **extra) -> tuple[int, float, list[tuple[float, str]]]:
    """(status, seconds to the headers, [(seconds, line)]) of one streamed request, raw."""
    path, body, _, _ = APIS[api]
    payload = {"model": "slow", "stream": True, **body(prompt), **extra}
    t0 = time.monotonic()
    with httpx.stream("POST", server.url(path), json=payload, timeout=120) as r:
        headers = time.monotonic() - t0
        lines = [(time.monotonic() - t0, line) for line in r.iter_lines() if line]
        return r.status_code, headers, lines


def until_content(api: str, lines: list[tuple[float, str]]) -> tuple[list[tuple[float, str]], str]:
    """The lines before the first content, and the answer's text."""
    content = APIS[api][2]
    texts = [(i, content(line)) for i, (_, line) in enumerate(lines)]
    first = next(i for i, text in texts if text)  # (chat's first chunk, the role, has no text)
    return lines[:first], "".join(text for _, text in texts if text)


def assert_alive(api: str, headers: float, before: list[tuple[float, str]], prefill: float,
                 interval: float = INTERVAL) -> None:
    """Keep-alives of the API's kind through the prefill, no silence longer than ``interval`` + 1.5 s from the
    request on."""
    beats = [t for t, line in before if APIS[api][3](line)]
    assert len(beats) >= prefill / interval / 2, (api, beats)
    times = [0.0, headers, *(t for t, _ in before)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= interval + 1.5, (api, gaps)


# -- keep-alives during the prefill --------------------------------------------------------------------------------
@pytest.mark.parametrize("api", list(APIS))
def test_a_slow_prefill_keeps_each_stream_alive_and_the_answer_is_unchanged(server, api):
    prompt = words(100)  # 2.5 s and more of prefill
    status, headers, lines = timed_lines(server, api, prompt)
    assert status == 200
    before, text = until_content(api, lines)
    assert text == prompt
    assert before[-1][0] >= 100 * PREFILL_MS / 1000 * 0.8  # the keep-alives did span the prefill
    assert_alive(api, headers, before, 100 * PREFILL_MS / 1000)
    if api == "responses":  # response.created first, as every client expects, then in_progress again and again
        kinds = [line for _, line in before if line.startswith("event: ")]
        kinds = kinds[:kinds.index("event: response.output_item.added")]
        assert kinds[0] == "event: response.created" and set(kinds[1:]) == {"event: response.in_progress"}
        seqs = [json.loads(line[6:])["sequence_number"] for _, line in lines if line.startswith("data: ")]
        assert seqs == list(range(len(seqs)))
    if api == "messages":  # message_start once, after admission (a keep-alive's ping before it is allowed)
        kinds = [line for _, line in before if line.startswith("event: ")]
        assert kinds.count("event: message_start") == 1


def test_the_official_clients_read_through_the_keep_alives(server):
    import anthropic
    import ollama

    client = server.openai()
    prompt = words(80)
    chat = client.chat.completions.create(model="slow", stream=True, messages=[{"role": "user", "content": prompt}])
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == prompt
    prompt = words(80)
    events = list(client.responses.create(model="slow", stream=True, input=prompt))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"], kinds
    assert kinds[-1] == "response.completed"
    prompt = words(80)
    with client.responses.stream(model="slow", input=prompt) as stream:  # the SDK's accumulating helper
        assert stream.get_final_response().output_text == prompt
    prompt = words(80)
    with anthropic.Anthropic(base_url=server.base_url, api_key="x").messages.stream(
            model="slow", max_tokens=500, messages=[{"role": "user", "content": prompt}]) as stream:
        assert stream.get_final_text() == prompt
    prompt = words(80)
    parts = list(ollama.Client(host=server.base_url).chat(model="slow", stream=True,
                                                          messages=[{"role": "user", "content": prompt}]))
    assert sum(1 for p in parts if not p.done and not p.message.content) >= 2  # the keep-alives, as plain chunks
    assert "".join(p.message.content for p in parts) == prompt and parts[-1].done


# -- the headers: at admission, or when the first keep-alive is due ------------------------------------------------
def test_quick_errors_keep_their_status_and_json(server):
    for api, (path, body, _, _) in APIS.items():
        r = httpx.post(server.url(path), json={"model": "no-such-model", "stream": True, **body("hi")}, timeout=30)
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), (api, r.text)
        assert "no-such-model" in r.text
    r = httpx.post(server.url("/v1/chat/completions"), timeout=30, json={
        "model": "slow", "stream": True, "temperature": 9, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def _hold(server, n: int) -> None:
    """A streamed chat of ``n`` words in a thread: its prefill holds the batch (and fails when the server stops)."""
    def run() -> None:
        try:
            timed_lines(server, "chat", words(n))
        except httpx.HTTPError:
            pass
    threading.Thread(target=run, daemon=True).start()
    time.sleep(0.5)


def _error_line(api: str, lines: list[tuple[float, str]]) -> tuple[dict, int]:
    """The body of the error that ended a stream, and how many lines it (and what closes it) took."""
    if api in ("chat", "completions"):
        assert lines[-1][1] == "data: [DONE]"
        return json.loads(lines[-2][1].removeprefix("data: ")), 2
    if api in ("responses", "messages"):
        assert lines[-2][1] == ("event: response.failed" if api == "responses" else "event: error")
        return json.loads(lines[-1][1].removeprefix("data: ")), 2
    return json.loads(lines[-1][1]), 1


def test_an_error_after_the_headers_ends_each_stream_with_its_error_event():
    """One long prefill holds the only batch slot; each API's request waits in the queue past --queue-timeout:
    its headers went out with the first keep-alive, so the time-out is the stream's error event."""
    with run_octo(*SERVE, "--max-batch", "1", "--queue-timeout", "2") as server:
        _hold(server, 400)  # 10 s of prefill
        with ThreadPoolExecutor(len(APIS)) as pool:
            runs = dict(zip(APIS, pool.map(lambda api: timed_lines(server, api, words(5)), APIS), strict=True))
    for api, (status, headers, lines) in runs.items():
        assert status == 200 and headers < MAX_GAP, (api, headers)
        body, n = _error_line(api, lines)
        if api in ("chat", "completions"):
            assert body["error"]["code"] == "queue_timeout", (api, lines)
        elif api == "responses":
            assert body["response"]["status"] == "failed" and body["response"]["error"]["code"] == "queue_timeout"
        elif api == "messages":
            assert body == {"type": "error", "error": {"type": "timeout_error", "message": body["error"]["message"]}}
        else:
            assert set(body) == {"error"} and "queue" in body["error"]
        assert_alive(api, headers, lines[:-n], 1.5)


def test_the_official_clients_raise_the_error_that_ended_a_stream():
    import anthropic
    import ollama
    import openai

    with run_octo(*SERVE, "--max-batch", "1", "--queue-timeout", "1.5") as server:
        _hold(server, 600)  # 15 s of prefill
        client = server.openai(max_retries=0)
        with pytest.raises(openai.APIError, match="queue"):
            list(client.chat.completions.create(model="slow", stream=True, messages=[{"role": "user", "content": "a"}]))
        events = list(client.responses.create(model="slow", stream=True, input="b"))
        assert events[-1].type == "response.failed" and events[-1].response.error.code == "queue_timeout"
        with pytest.raises(anthropic.APIError, match="queue"):
            with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages.stream(
                    model="slow", max_tokens=50, messages=[{"role": "user", "content": "c"}]) as stream:
                stream.get_final_text()
        with pytest.raises(ollama.ResponseError, match="queue"):
            list(ollama.Client(host=server.base_url).chat(model="slow", stream=True,
                                                           messages=[{"role": "user", "content": "d"}]))


def test_keep_alives_while_the_model_loads_on_demand():
    with run_octo(*SERVE, "-o", "load_s=3") as server:
        status, body = server.post_json("/v1/models/slow/unload", {})
        assert status == 200 and body["state"] == "available"
        prompt = words(20)
        status, headers, lines = timed_lines(server, "ollama-chat", prompt)
        before, text = until_content("ollama-chat", lines)
        assert status == 200 and text == prompt
        assert before[-1][0] >= 3.0  # the load, then the prefill
        assert_alive("ollama-chat", headers, before, 3.0)


# -- a client that goes away ---------------------------------------------------------------------------------------
def _cancelled(server) -> int:
    return server.get_json("/v1/queue/stats")["total_cancelled"]


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_client_that_goes_away_during_the_prefill_cancels_it(server, api):
    path, body, _, beat = APIS[api]
    cancelled = _cancelled(server)
    with httpx.stream("POST", server.url(path), timeout=60,
                      json={"model": "slow", "stream": True, **body(words(800))}) as r:  # 20 s of prefill
        for line in r.iter_lines():
            if beat(line):
                break  # the prefill runs: the client goes away
    t0 = time.monotonic()
    while _cancelled(server) == cancelled:
        assert time.monotonic() - t0 < 5, "the prefill went on after its client left"
        time.sleep(0.05)
    status, reply = server.post_json("/v1/completions", {"model": "slow", "prompt": "next one", "max_tokens": 5})
    assert status == 200 and reply["choices"][0]["text"] == "next one"
    assert time.monotonic() - t0 < 5  # the engine was free again: no 20 s prefill ran to its end first


# -- the demo model on llama.cpp: a real prefill -------------------------------------------------------------------
def test_a_real_prefill_on_the_demo_model_keeps_alive_and_stops_when_its_client_leaves():
    """llama.cpp feeds a prompt a chunk a step: a client that leaves in the middle of a prefill of thousands of
    tokens frees the engine within a step or two (a 29,000-token prefill on this 2-core host: the next request
    answered 0.2-1.3 s after the disconnect, docs/api.md). The prompts are long enough for a fast host too (2,000
    tokens took 0.3 s on one)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    interval = 0.2
    with run_octo("demo", "--engine", "llamacpp", "--stream-keepalive", str(interval), timeout=600) as server:
        prompt = words(600)  # about 8,000 tokens: seconds of prefill on 2 cores
        status, headers, lines = timed_lines(server, "messages", prompt, max_tokens=3, model="demo")
        assert status == 200 and lines[-1][1] == "data: {\"type\":\"message_stop\"}"
        first = next(i for i, (_, line) in enumerate(lines) if line == "event: content_block_start")
        assert lines[first][0] > 3 * interval  # a prefill long enough to need keep-alives
        assert_alive("messages", headers, lines[:first], lines[first][0] - headers, interval)
        path, body, _, beat = APIS["chat"]
        t0, busy = time.monotonic(), 0
        with httpx.stream("POST", server.url(path), timeout=120,
                          json={"model": "demo", "stream": True, **body(words(2000))}) as r:  # ~27,000 tokens
            assert r.status_code == 200
            for line in r.iter_lines():
                assert not _chat(line), "the prefill ended before the client left: make the prompt longer"
                if beat(line) and time.monotonic() - t0 > 2:
                    busy = server.get_json("/v1/queue/stats")["active"]
                    break  # the prefill runs: the client goes away
        assert busy == 1
        t0 = time.monotonic()  # most of the prefill was left
        status, reply = server.post_json("/v1/completions", {"model": "demo", "prompt": "next", "max_tokens": 2})
        assert status == 200 and time.monotonic() - t0 < 10, "the prefill went on after its client left"
