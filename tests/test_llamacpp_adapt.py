"""The KV layout follows the load (engines/llamacpp/adapt.py): a unified pool runs bursts of short concurrent sequences
in per-sequence streams of the same memory, and goes back to the pool when a sequence outgrows its stream. A switch
changes where the KV lives, never the text: every test compares greedy tokens with an engine that never switches."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine, adapt, background, layout  # noqa: E402
from probefiles import cached_verdict  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


def _load(path: str, **opts: str) -> LlamaCppEngine:
    e = LlamaCppEngine(EngineConfig(max_batch=4, options={"n_ctx": "2048", **opts}))
    e.load(path, "tiny")
    return e


@pytest.fixture
def pair(gguf_path):
    """An engine that adapts (streams of 512 cells: a 2,048-cell pool over 4 sequences) and one that never does."""
    ref, e = _load(gguf_path, kv_unified="true", kv_adapt="false"), _load(gguf_path, kv_unified="true", kv_adapt="true")
    assert ref.layout.policy is None and e.layout.policy is not None and e.layout.policy.cells == 512
    yield ref, e
    ref.unload()
    e.unload()


def _run(e: LlamaCppEngine, prompts: list[list[int]], n: int, first_id: int = 0) -> list[list[int]]:
    """Greedy: every prompt decodes ``n`` tokens together, then all leave (a busy period)."""
    seqs = [Sequence(first_id + i, list(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    for s in seqs:
        e.add_sequence(s)
    outs = e.step([Feed(s, s.tokens, True) for s in seqs])
    for _ in range(n - 1):
        for s, o in zip(seqs, outs, strict=True):
            s.tokens.append(o)
        outs = e.step([Feed(s, s.tokens[-1:], True) for s in seqs])
    for s, o in zip(seqs, outs, strict=True):
        s.tokens.append(o)
    for s in seqs:
        e.remove_sequence(s)
    assert e.cells.book.used() == 0 and not e.active
    return [s.tokens for s in seqs]


def _prompts(e: LlamaCppEngine, k: int = 4) -> list[list[int]]:
    return [e.tokenize(t) for t in ("the lighthouse keeper", "a tide table", "seven ships left", "ink and salt")[:k]]


def test_short_bursts_run_in_streams_and_the_text_is_the_same(pair):
    ref, e = pair
    for burst in range(3):
        assert _run(ref, _prompts(ref), 30) == _run(e, _prompts(e), 30)
        assert e.kv_unified is (burst == 0)  # after a burst of 4 short sequences (nothing shared): streams
    assert not e.kv_unified and e.layout.policy.switches == 1 and e.layout.policy.forced == 0
    assert e.layout.policy.last == {"peak": 4, "longest": max(len(p) for p in _prompts(e)) + 29, "prompt":
                            sum(map(len, _prompts(e))), "reused": 0, "sequences": 4}
    assert e.kv_room() is None and e.n_ctx_seq == ref.n_ctx_seq == 2048  # a sequence may still use the whole context
    st = e.kv_stats()  # what /v1/queue/stats shows per model under "kv"
    assert (st["layout"], st["adaptive"], st["stream_cells"], st["layout_switches"], st["forced_switches"]) == (
        "streams", True, 512, 1, 0) and st["cells"] == 2048
    assert st["last_period"] == e.layout.policy.last and st["last_period"] is not e.layout.policy.last  # a copy
    assert ref.kv_stats()["layout"] == "unified" and ref.kv_stats()["adaptive"] is False


def test_a_sequence_that_outgrows_its_stream_moves_everyone_to_the_pool(pair):
    ref, e = pair
    _run(e, _prompts(e), 10)
    _run(ref, _prompts(ref), 10)
    # the next burst starts in streams; two of its sequences run past 512 cells: at that step all of them (and
    # their KV) move to a new unified pool
    assert _run(ref, _prompts(ref, 3), 600) == _run(e, _prompts(e, 3), 600)
    assert e.kv_unified and e.layout.policy.forced == 1 and e.layout.policy.switches == 2
    assert e.layout.policy.last["longest"] > 512
    # that burst was long: the next one stays in the pool
    assert _run(ref, _prompts(ref), 10) == _run(e, _prompts(e), 10)
    assert e.kv_unified and e.layout.policy.switches == 2


def test_a_long_prompt_takes_the_pool_at_once_even_beside_running_streams(pair):
    ref, e = pair
    _run(e, _prompts(e), 10)  # the next burst starts in streams
    out = {}
    for eng in (ref, e):
        short = [Sequence(i, p, SamplingParams(temperature=0)) for i, p in enumerate(_prompts(eng, 2))]
        for s in short:
            eng.add_sequence(s)
        assert eng.kv_unified is (eng is ref)
        eng.step([Feed(s, s.tokens[:-1], False) for s in short])
        long = Sequence(9, eng.tokenize("a long prompt " * 200)[:700], SamplingParams(temperature=0))
        eng.add_sequence(long)  # 700 tokens: more than a stream holds
        assert eng.kv_unified
        while long.n_cached < len(long.tokens) - 1:
            eng.step([Feed(long, long.tokens[long.n_cached:min(len(long.tokens) - 1, long.n_cached + 256)], False)])
        seqs = [*short, long]
        outs = eng.step([Feed(s, s.tokens[s.n_cached:], True) for s in seqs])
        for _ in range(20):
            for s, o in zip(seqs, outs, strict=True):
                s.tokens.append(o)
            outs = eng.step([Feed(s, s.tokens[-1:], True) for s in seqs])
        out[eng is e] = [s.tokens for s in seqs]
        for s in seqs:
            eng.remove_sequence(s)
    assert out[True] == out[False] and e.layout.policy.forced == 1


def test_cached_prefixes_survive_a_switch_both_ways(pair):
    """A prefix-cache entry made in the pool (cells) is moved to RAM when streams take over and restores there; one
    made in streams (a snapshot of 4 streams) restores into the pool (its stream count rewritten: kvcache.restream)."""
    ref, e = pair
    prompt = e.tokenize("a system prompt that several requests share, word for word " * 4)
    a = Sequence(0, list(prompt), SamplingParams(temperature=0))
    e.add_sequence(a)
    e.step([Feed(a, a.tokens, False)])
    in_pool = e.kv_save(a)
    assert isinstance(in_pool.data, int)
    e.remove_sequence(a)
    _run(e, _prompts(e), 5)  # a short burst of 4 (the entry's cells stay idle in the pool)
    b = Sequence(1, list(prompt) + [5], SamplingParams(temperature=0))
    e.add_sequence(b)  # this burst starts in streams: the entry went to RAM first
    assert not e.kv_unified and not isinstance(in_pool.data, int) and in_pool.data is not None
    e.kv_restore(b, in_pool, len(prompt))
    assert b.n_cached == len(prompt)
    tail = e.step([Feed(b, b.tokens[b.n_cached:], True)])
    in_streams = e.kv_save(b)  # a RAM snapshot of the streams context
    e.remove_sequence(b)
    e.layout.relayout(True)
    c = Sequence(2, list(prompt) + [5, 7], SamplingParams(temperature=0))
    e.add_sequence(c)
    e.kv_restore(c, in_streams, len(prompt) + 1)
    assert e.kv_unified and c.n_cached == len(prompt) + 1
    got = e.step([Feed(c, c.tokens[c.n_cached:], True)])
    e.remove_sequence(c)
    want = _run(ref, [list(prompt) + [5]], 1)[0][-1], _run(ref, [list(prompt) + [5, 7]], 1)[0][-1]
    assert (tail[0], got[0]) == want
    e.kv_free(in_pool)
    e.kv_free(in_streams)


def test_the_policy():
    p = adapt.Adaptive(1000, {"source": "test"})
    assert p.opening(0, 10, True) is None  # nothing seen yet
    for n in (1, 2, 3):
        p.added(n, 10)
    p.reused(5)
    for left in (2, 1, 0):
        p.removed(200, left)
    assert p.period is None and p.last == {"peak": 3, "longest": 200, "prompt": 30, "reused": 5, "sequences": 3}
    assert p.opening(0, 10, True) is False  # short, concurrent, little shared: streams
    assert p.opening(0, 600, True) is True  # a prompt beyond half a stream: the pool
    assert p.opening(2, 10, False) is None  # not idle: no switch
    assert p.opening(2, 1000, False) is True  # it cannot fit a stream: the pool, whatever runs
    p.last = {**p.last, "reused": 20}
    assert p.opening(0, 10, False) is True  # prefixes shared: the pool
    p.last = {**p.last, "reused": 0, "longest": 501}
    assert p.opening(0, 10, False) is True  # a sequence past half a stream: the pool
    p.last = {**p.last, "longest": 100, "peak": 1}
    assert p.opening(0, 10, False) is None  # one at a time: the layouts cost the same


@pytest.fixture
def auto(monkeypatch, tmp_path):
    from octo.benchload import LoadMonitor

    monkeypatch.delenv(layout.ENV, raising=False)
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    real = LoadMonitor.stop  # measurements count as undisturbed (the suite's host is busy)
    monkeypatch.setattr(LoadMonitor, "stop", lambda self: {**real(self), "disturbed": False})
    monkeypatch.setattr(layout, "_workload", lambda engine, *shape, reps: ([1.0], [1.0]) if engine.kv_unified
                        else ([2.0], [2.0]))  # the layout probe: the pool wins
    return tmp_path


@pytest.mark.parametrize("pays", [True, False])
def test_measured_when_idle_then_cached(gguf_path, auto, monkeypatch, pays):
    real = adapt.probe
    calls = []

    def probe(engine, cells):
        verdict = real(engine, cells)  # it runs through the engine, in both layouts
        calls.append(verdict)
        return {**verdict, "pays": pays}

    monkeypatch.setattr(adapt, "probe", probe)
    e = _load(gguf_path)
    try:
        assert not calls and e.layout.policy is None and e.layout.verdicts["adapt"]["pending"], "no probe at load"
        background.settle(e.layout)
        assert len(calls) == 1 and calls[0]["unified_step_s"] > 0 and calls[0]["streams_step_s"] > 0
        assert e.kv_unified and not e.active and e.cells.book.used() == 0, "the probe left nothing behind"
        assert (e.layout.policy is not None) is pays
        verdict = e.info.extra["kv_layout"]["adapt"]  # shown whether or not it pays
        assert verdict["source"] == "measured" and verdict["pays"] is pays
        assert _run(e, _prompts(e), 5)
    finally:
        e.unload()
    cached = cached_verdict(auto, "adapt", False)
    assert cached["pays"] is pays
    again = _load(gguf_path)
    try:
        assert len(calls) == 1 and (again.layout.policy is not None) is pays
        assert again.info.extra["kv_layout"]["adapt"]["cached"] is True
    finally:
        again.unload()


@pytest.mark.parametrize("outcome", ["disturbed", "pays", "does not pay"])
def test_on_from_16_sequences_until_a_probe_says_otherwise(gguf_path, auto, monkeypatch, outcome):
    """With --max-batch 16 or more the adaptation is on from the load (16 short streams decoded 0.93x llama-server's
    tok/s from the pool, 1.06x in streams); the idle probe still runs: "no" turns it off, a disturbed one leaves it
    on (and is tried again later), "yes" keeps it."""
    from octo.benchload import LoadMonitor

    real = adapt.probe
    monkeypatch.setattr(adapt, "probe", lambda engine, cells: {**real(engine, cells), "pays": outcome == "pays"})
    if outcome == "disturbed":
        monkeypatch.setattr(LoadMonitor, "stop", lambda self: {"disturbed": True})
    ref = LlamaCppEngine(EngineConfig(max_batch=16, options={"n_ctx": "4096", "kv_adapt": "false"}))
    ref.load(gguf_path, "tiny")
    e = LlamaCppEngine(EngineConfig(max_batch=16, options={"n_ctx": "4096"}))
    e.load(gguf_path, "tiny")
    few = LlamaCppEngine(EngineConfig(max_batch=8, options={"n_ctx": "4096"}))
    few.load(gguf_path, "tiny")
    try:
        assert few.layout.policy is None and few.layout.verdicts["adapt"]["source"].startswith("off"), "below 16: off"
        verdict = e.layout.verdicts["adapt"]
        assert e.layout.policy is not None and e.layout.policy.cells == 256 and verdict["pending"]
        assert "--max-batch >= 16" in e.info.extra["kv_layout"]["adapt"]["source"]
        prompts = _prompts(e)
        assert _run(e, prompts, 5) == _run(ref, prompts, 5)  # (short traffic: it may switch; the text is the same)
        background.settle(e.layout)
        assert e.kv_unified and not e.active, "the probe left the pool serving, nothing behind"
        verdict = e.layout.verdicts["adapt"]
        if outcome == "disturbed":
            assert e.layout.policy is not None and verdict["pending"] and verdict["attempts"] == 1
            assert "--max-batch >= 16" in verdict["source"]
        else:
            assert (e.layout.policy is not None) is (outcome == "pays") and verdict["source"] == "measured"
        assert _run(e, prompts, 5) == _run(ref, prompts, 5)
    finally:
        for x in (ref, e, few):
            x.unload()


def test_off_when_the_layout_is_given_or_asked_off(gguf_path, auto, forbid):
    forbid(adapt, "probe")
    for opts in ({"kv_unified": "true"}, {"kv_unified": "false"}, {"kv_adapt": "false"}, {"kv_cells": "4096"},
                 {"kv_unified": "false", "kv_adapt": "true"}):
        e = _load(gguf_path, **opts)
        try:
            assert e.layout.policy is None and "adapt" not in e.info.extra["kv_layout"], opts
        finally:
            e.unload()
    with pytest.raises(ConfigError, match="kv_adapt"):
        _load(gguf_path, kv_adapt="sometimes")


def test_a_layout_it_cannot_build_leaves_the_one_it_had(pair, monkeypatch):
    """Building the streams context fails (memory): the engine rebuilds its pool, keeps serving, stops switching."""
    ref, e = pair
    real = e.rebuild_context

    def build(unified, stream_cells):
        if not unified:
            raise MemoryError("no room for the streams")
        return real(unified, stream_cells)

    monkeypatch.setattr(e, "rebuild_context", build)
    assert _run(ref, _prompts(ref), 10) == _run(e, _prompts(e), 10)
    assert _run(ref, _prompts(ref), 10) == _run(e, _prompts(e), 10)  # its first add tried streams
    assert e.kv_unified and e.layout.policy is None and e.ctx
    assert _run(ref, _prompts(ref), 10) == _run(e, _prompts(e), 10)


def test_a_forced_switch_that_cannot_build_the_pool_fails_the_step_and_keeps_the_streams(pair, monkeypatch):
    """In streams, a sequence outgrows its stream and the pool cannot be built: that step fails with a clear error, the
    streams (of the same cells) are rebuilt with every sequence's KV, and the others go on."""
    from octo.errors import EngineError

    ref, e = pair
    _run(e, _prompts(e), 10)
    seqs = [Sequence(i, p, SamplingParams(temperature=0)) for i, p in enumerate(_prompts(e, 2))]
    for s in seqs:
        e.add_sequence(s)
    assert not e.kv_unified and e.stream_cells == 512
    outs = e.step([Feed(s, s.tokens, True) for s in seqs])
    real = e.rebuild_context

    def build(unified, stream_cells):
        if unified:
            raise MemoryError("no room for the pool")
        return real(unified, stream_cells)

    monkeypatch.setattr(e, "rebuild_context", build)
    long = seqs[0]
    with pytest.raises(EngineError, match="outgrew its KV stream"):
        e.step([Feed(long, [7] * 520, False)])  # past its 512 cells
    assert not e.kv_unified and e.stream_cells == 512 and e.layout.policy is None
    short = seqs[1]
    short.tokens.append(outs[1])
    got = [short.tokens[-1]]
    for _ in range(5):
        got.append(e.step([Feed(short, short.tokens[-1:], True)])[0])
        short.tokens.append(got[-1])
    for s in seqs:
        e.remove_sequence(s)
    want = _run(ref, [_prompts(ref, 2)[1]], 7)[0]
    assert short.tokens == want[:len(short.tokens)]
