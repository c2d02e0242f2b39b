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
    with run_octo(gguf_path, "--engine", "poisoned", "--plugins-dir", plugins, "-o", "after=3") as server:
        client = server.async_openai(max_retries=0)
        prompts = ["The old lighthouse POISON stood", *PROMPTS[:3]]

        async def one(prompt):
            try:
                r = await client.completions.create(model=server.get_json("/v1/models")["data"][0]["id"],
                                                    prompt=prompt, max_tokens=12, temperature=0)
                return r.choices[0].text, r.choices[0].finish_reason
            except Exception as exc:  # noqa: BLE001
                return exc, None

        async def go():
            return await asyncio.gather(*(one(p) for p in prompts))

        bad, *good = asyncio.run(go())
        assert isinstance(bad[0], Exception) and "poisoned" in str(bad[0]), bad
        for text, finish in good:
            assert isinstance(text, str) and finish == "length", (text, finish)
        assert "was run again in smaller groups" in server.log()
