"""`octo serve TINY.gguf --engine llamacpp` as a real process, driven with the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")
openai = pytest.importorskip("openai")

from octo.engines.llamacpp.native import physical_cores  # noqa: E402

MODEL = "tiny-q8_0"  # the alias octo derives from the file name
SYSTEM = (
    "You are a careful assistant. The old lighthouse stood at the edge of the harbor, and every evening "
    "the keeper climbed the narrow stairs to light the lamp. Answer briefly and never forget the rocks."
)
SCHEMA = {
    "type": "object",
    "properties": {
        # bounded: random weights' greedy digits need not end (on an AVX-512 host this model wrote 110 of them), and
        # with a bound the grammar itself ends the number, on any host
        "answer": {"type": "integer", "minimum": -999, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["answer", "ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


@pytest.fixture(scope="module")
def server(gguf_path):
    from serverproc import run_octo

    with run_octo(gguf_path, "--engine", "llamacpp", "--max-batch", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_served_with_llamacpp(client, server):
    models = [m for m in client.models.list().data if m.model_extra.get("source") != "catalog"]
    assert len(models) == 1 and models[0].model_extra["engine"] == "llamacpp"
    assert MODEL in models[0].model_extra["aliases"]
    assert models[0].model_extra["context_length"] == 2048


def test_completion_equals_bare_llama_cpp_python(client, gguf_path):
    prompt = "The old lighthouse stood at the edge of the harbor, and"
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=2048, n_threads=physical_cores(), flash_attn=True, verbose=False)
    try:
        ref = llm.create_completion(prompt, max_tokens=24, temperature=0)
    finally:
        llm.close()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    # octo decodes invalid UTF-8 from this random model as U+FFFD; llama-cpp-python drops it
    assert r.choices[0].text.replace("\ufffd", "") == ref["choices"][0]["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        ref["usage"]["prompt_tokens"],
        ref["usage"]["completion_tokens"],
    )


def test_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me about the harbor."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_eight_concurrent_streams_complete(server):
    from octo.synth.tokenizer import special_ids

    no_eos = {str(special_ids()[t]): -100 for t in ("<|im_end|>", "<|endoftext|>")}

    async def one(c, i):
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Question {i}: where is the lighthouse?"}],
            max_tokens=24,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            logit_bias=no_eos,
        )
        text, usage, finish = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return "".join(text), usage, finish

    async def main():
        async with server.async_openai() as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    results = asyncio.run(main())
    assert all(finish == "length" and usage.completion_tokens == 24 for _, usage, finish in results)
    assert len({text for text, _, _ in results}) == 8


def test_json_schema_response_format(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"answer", "ok", "color"}
    assert isinstance(obj["answer"], int) and -999 <= obj["answer"] <= 999
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")


def test_json_object_response_format(client):
    """A random model rarely closes a free JSON string, so favour "}": the grammar must still open an object."""
    from octo.synth.tokenizer import load_tokenizer

    close = load_tokenizer().token_to_id("}")
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me JSON."}],
        max_tokens=50,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={str(close): 30},
    )
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == {}
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me JSON."}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(close): 30},
    )
    assert plain.choices[0].message.content.startswith("}")  # without JSON mode the bias wins


def test_context_overflow_is_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="harbor " * 3000, max_tokens=4)
    assert e.value.status_code == 400
    body = e.value.body if isinstance(e.value.body, dict) else {}
    err = body.get("error", body)
    assert err.get("code") == "context_length_exceeded" and "2048" in err.get("message", "")
    # the server is still fine
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1


def test_shared_system_prompt_is_a_prefix_cache_hit(client, server):
    import urllib.request

    def ask(user):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            max_tokens=8,
            temperature=0,
        )

    first = ask("Where is the lighthouse?")
    second = ask("Who lights the lamp?")
    # the first may reuse the chat header cached by earlier tests; the second reuses the whole system turn
    assert first.usage.prompt_tokens_details.cached_tokens < 10
    assert second.usage.prompt_tokens_details.cached_tokens > 40
    with urllib.request.urlopen(server.url("/v1/cache/stats")) as r:
        stats = json.loads(r.read())
    assert stats["hits"] >= 1 and stats["bytes"] > 0


def test_embeddings_endpoint():
    from serverproc import run_octo

    from octo.synth.gguf import build_gguf

    path = str(build_gguf("tiny", ftype="f16", pooling="mean"))
    with run_octo(path, "--engine", "llamacpp") as s:
        c = s.openai()
        r = c.embeddings.create(model="tiny-embmean-f16", input=["the harbor", "the lamp", "the rocks at night"])
        assert [d.index for d in r.data] == [0, 1, 2]
        assert all(len(d.embedding) == 64 for d in r.data)
        assert abs(sum(x * x for x in r.data[0].embedding) - 1.0) < 1e-4
        assert r.usage.prompt_tokens > 0
        with pytest.raises(openai.APIStatusError):
            c.chat.completions.create(
                model="tiny-embmean-f16", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )


def test_corrupt_gguf_fails_at_start_up(tmp_path, gguf_path):
    from pathlib import Path

    from serverproc import run_octo

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(Path(gguf_path).read_bytes()[:5000])
    with pytest.raises(RuntimeError) as e:
        with run_octo(str(bad), "--engine", "llamacpp", timeout=60):
            pass
    assert "broken.gguf" in str(e.value)


def _kv(srv) -> dict:
    """The one loaded model's KV state in ``/v1/queue/stats``."""
    (st,) = srv.get_json("/v1/queue/stats")["models"].values()
    return st["kv"]


# words whose first tokens differ in the synthetic vocabulary (so no prompt shares a prefix with another)
WORDS = ("apple river stone cloud maple tiger ocean amber violet copper silver garden winter forest desert island "
         "valley harbor canyon lantern thunder pebble rocket jungle bridge yellow noble quiet").split()
TOKENS = 64  # a burst lasts long enough for its requests to overlap (32 tokens took ~8 ms here)


def test_short_bursts_switch_to_streams_through_the_sdk(gguf_path):
    """A server with ``-o kv_adapt=true``, driven by the openai SDK: after a burst of 4 concurrent short completions
    the next burst runs in per-sequence streams (``/v1/queue/stats`` says so under ``kv``) and every request is
    answered in full. (That a switch leaves the text unchanged is tested where the batching is controlled,
    tests/test_llamacpp_adapt.py: across two servers, which requests share a step depends on timing.)"""
    from concurrent.futures import ThreadPoolExecutor

    from serverproc import run_octo

    def burst(clients: list, words: list[str]) -> list:
        start = threading.Barrier(len(words))

        def one(i: int):
            start.wait()
            return clients[i].completions.create(model=MODEL, prompt=f"{words[i]} story:", max_tokens=TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(len(words)) as pool:
            return list(pool.map(one, range(len(words))))

    with run_octo(gguf_path, "--engine", "llamacpp", "--max-batch", "8", "-o", "kv_adapt=true") as adaptive:
        kv = _kv(adaptive)
        assert (kv["layout"], kv["adaptive"], kv["layout_switches"]) == ("unified", True, 0)
        # one client per thread, each connected by a request of its own first (one sequence at a time: no switch),
        # so a burst's requests arrive together instead of behind four connection set-ups (a first burst split
        # in two busy periods would switch within it)
        clients = [adaptive.openai() for _ in range(4)]
        for c in clients:
            c.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0)
        assert _kv(adaptive)["layout_switches"] == 0
        # Every prompt starts with a token of its own: prompts that share most of their tokens (with each other or
        # with an earlier burst's, still in the prefix cache) are what the pool does best, and the policy rightly
        # keeps such a period there (``last_period``'s ``reused``: "burst 0 story 1:" and its kind reused 18 of 24).
        for k in range(len(WORDS) // 4):  # a burst whose requests did not overlap (a loaded host) keeps the layout
            answers = burst(clients, WORDS[4 * k:4 * k + 4])
            assert all(a.usage.completion_tokens == TOKENS and a.choices[0].finish_reason == "length"
                       for a in answers)
            kv = _kv(adaptive)
            if kv["layout"] == "streams":
                break
        assert (kv["layout"], kv["layout_switches"], kv["forced_switches"]) == ("streams", 1, 0), kv
        last = kv["last_period"]  # the burst that just ran (in streams): what decides the next one's layout
        assert set(last) == {"peak", "longest", "prompt", "reused", "sequences"} and last["sequences"] >= 1, last
        assert last["longest"] >= TOKENS and last["reused"] * 2 <= last["prompt"], last
        # Usually the second burst is the first in streams; on a loaded host a first burst's requests can reach the
        # server as two busy periods (the first ends before the last request arrives), and the second of them then
        # opens in streams: the policy's own rule either way (a period may only open in streams after one that ran
        # several sequences at once; the one-at-a-time connection requests above could not), so only one switch,
        # none forced, is asserted (above).
