"""llama.cpp's ``kv_rollback`` (octo.scheduler.step_isolation): a step undone and run again gives the tokens it gave,
and the
generation goes on exactly as if nothing had happened (prompt steps and decode steps; a plain greedy chain, and a
chain with penalties, which keeps state and is rebuilt; the unified pool and per-sequence streams). And through a
real `octo serve`: a llama.cpp engine poisoned by one of four concurrent requests (tests/plugins/poisoned.py) fails
that request alone."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from serverproc import REPO, run_octo  # noqa: E402
from test_llamacpp import PROMPTS, generate, gguf_path  # noqa: E402,F401

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402


def generate_undoing(engine, prompts, max_tokens, sampling, undo_at) -> list[list[int]]:
    """``generate``, but each step in ``undo_at`` runs, is undone (kv_rollback), and runs again: same tokens."""
    seqs = [Sequence(id=i, tokens=list(p), sampling=s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))]
    for s in seqs:
        engine.add_sequence(s)
    out = {s.id: [] for s in seqs}
    feeds = [Feed(s, s.tokens[:], True) for s in seqs]
    step = 0
    while feeds:
        starts = [f.seq.n_cached for f in feeds]
        tokens = engine.step(feeds)
        if step in undo_at:
            for f, start in zip(feeds, starts, strict=True):
                engine.kv_rollback(f.seq, start)
                assert f.seq.n_cached == start
            again = engine.step(feeds)
            assert again == tokens, step
        step += 1
        nxt = []
        for f, t in zip(feeds, tokens, strict=True):
            f.seq.tokens.append(t)
            out[f.seq.id].append(t)
            if len(out[f.seq.id]) < max_tokens:
                nxt.append(Feed(f.seq, [t], True))
        feeds = nxt
    for s in seqs:
        engine.remove_sequence(s)
    return [out[s.id] for s in seqs]


@pytest.mark.parametrize("options", [{}, {"kv_unified": "false"}])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_step_undone_and_run_again_changes_nothing(gguf_path, options, penalty):  # noqa: F811
    engine = LlamaCppEngine(EngineConfig(max_batch=4, options=options))
    engine.load(gguf_path, "tiny")
    try:
        prompts = [engine.tokenize(p) for p in PROMPTS[:4]]
        sampling = [SamplingParams(temperature=0, repetition_penalty=penalty) for _ in prompts]
        reference = generate(engine, prompts, 16, sampling, stop_at_eos=False)
        undone = generate_undoing(engine, prompts, 16, sampling, undo_at={0, 3, 9})
        assert undone == reference
    finally:
        engine.unload()


def test_a_poisoned_llamacpp_step_costs_one_request(gguf_path):  # noqa: F811
    plugins = str(REPO / "tests" / "plugins")
    with run_octo(gguf_path, "--engine", "poisoned", "--plugins-dir", plugins, "-o", "after=3",
                  "-o", "step_ms=5") as server:
        client = server.async_openai(max_retries=0)
        model = server.get_json("/v1/models")["data"][0]["id"]

        async def good(prompt, running: asyncio.Event):
            text, finish = [], None
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=96, temperature=0,
                                                     stream=True)
            async for chunk in stream:
                running.set()
                for choice in chunk.choices:
                    text.append(choice.text)
                    finish = choice.finish_reason or finish
            return "".join(text), finish

        async def poisoned(others: list[asyncio.Event]):
            # sent once the others decode (96 steps of at least 5 ms: still running when it is poisoned); sent
            # together with 12 tokens each, the tiny model's others could end before it was, and it failed alone
            await asyncio.gather(*(e.wait() for e in others))
            try:
                await client.completions.create(model=model, prompt="The old lighthouse POISON stood", max_tokens=12,
                                                temperature=0)
            except Exception as exc:  # noqa: BLE001
                return exc
            return None

        async def go():
            running = [asyncio.Event() for _ in range(3)]
            goods = (good(p, e) for p, e in zip(PROMPTS[:3], running, strict=True))
            return await asyncio.gather(poisoned(running), *goods)

        bad, *good_ones = asyncio.run(go())
        assert isinstance(bad, Exception) and "poisoned" in str(bad), bad
        for text, finish in good_ones:
            assert text and finish in ("length", "stop"), (text, finish)
        assert "was run again in smaller groups" in server.log()
