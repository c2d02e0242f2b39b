"""KV compaction in llama.cpp's unified pool (engines/llamacpp/kvcache.py): sequences that decode together interleave
their cells; a sequence whose cells form too many runs is rewritten as one. It must change nothing but where the cells
are: the same tokens, the same cells in use, a shared prefix still shared (and usable by its other holders)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


def _engine(path: str, min_runs: int | None) -> LlamaCppEngine:
    """``min_runs`` None: compaction off (``-o kv_compact=false``)."""
    off = {"kv_compact": "false"} if min_runs is None else {}
    e = LlamaCppEngine(EngineConfig(max_batch=4, options={"n_ctx": "512", "kv_unified": "true", **off}))
    e.load(path, "tiny")
    assert e.info.extra["kv_compact"] is (min_runs is not None)
    e.cells.COMPACT_RUNS = min_runs or 2
    return e


def _decode(e: LlamaCppEngine, seqs: list[Sequence], steps: int) -> None:
    outs = e.step([Feed(s, s.tokens[s.n_cached:], True) for s in seqs])
    for _ in range(steps):
        for s, o in zip(seqs, outs, strict=True):
            s.tokens.append(o)
        outs = e.step([Feed(s, s.tokens[-1:], True) for s in seqs])
        assert e.cells.book.used() == _cells(e)
    for s, o in zip(seqs, outs, strict=True):
        s.tokens.append(o)


def _cells(e: LlamaCppEngine) -> int:
    """Cells in use as llama.cpp itself reports them: the positions each sequence holds, counted once per cell (in
    these tests sequences share only a common first stretch, so a shared cell is one position of every holder)."""
    L = e.lib
    spans = []
    for sid in [*e.active, *e.cells.entries]:
        lo, hi = L.llama_memory_seq_pos_min(e.mem, sid), L.llama_memory_seq_pos_max(e.mem, sid)
        if hi >= 0:
            spans.append((sid, lo, hi))
    shared = e.cells.book.shared_prefix
    return sum(hi - lo + 1 for _, lo, hi in spans) - sum(
        min(shared(sid), hi + 1) for sid, lo, hi in spans[1:]) if spans else 0


def _prompts(e: LlamaCppEngine) -> list[list[int]]:
    return [e.tokenize(t) for t in ("the lighthouse keeper", "a tide table for", "seven ships left the", "ink")]


def test_compacted_cells_decode_the_same_tokens(gguf_path):
    ref, e = _engine(gguf_path, None), _engine(gguf_path, 4)
    try:
        out = {}
        for eng in (ref, e):
            seqs = [Sequence(i, list(p), SamplingParams(temperature=0)) for i, p in enumerate(_prompts(eng))]
            for s in seqs:
                eng.add_sequence(s)
            _decode(eng, seqs, 60)
            out[eng is e] = [s.tokens for s in seqs]
            assert eng.cells.book.used() == sum(s.n_cached for s in seqs)
            for s in seqs:
                eng.remove_sequence(s)
            assert eng.cells.book.used() == 0
        assert ref.cells.compactions == 0 and e.cells.compactions >= 5, e.cells.compactions
        assert out[True] == out[False]
        assert max(e.cells.runs.values(), default=0) < 2 * 4 + 1
    finally:
        ref.unload()
        e.unload()


def test_a_shared_prefix_stays_shared_and_whole(gguf_path):
    """B takes A's first 40 positions as shared cells (in-flight deduplication); both decode beside C, with
    compaction: C is compacted, A and B are left as they are (a copy would unshare the prefix), the prefix is still
    one set of cells, and every text is the text it gets without any compaction."""
    ref, e = _engine(gguf_path, None), _engine(gguf_path, 4)
    try:
        out = {}
        for eng in (ref, e):
            base = eng.tokenize("a shared system prompt that both requests send first, word for word, " * 3)[:41]
            a = Sequence(0, base + eng.tokenize(" question one"), SamplingParams(temperature=0))
            b = Sequence(1, base + eng.tokenize(" another question"), SamplingParams(temperature=0))
            eng.add_sequence(a)
            eng.step([Feed(a, a.tokens[:40], False)])
            eng.add_sequence(b)
            eng.kv_share(a, b, 40)
            assert b.n_cached == 40 and eng.cells.book.shared_prefix(b.slot.seq_id) == 40
            c = Sequence(2, eng.tokenize("an unrelated prompt"), SamplingParams(temperature=0))
            eng.add_sequence(c)
            _decode(eng, [a, b, c], 50)
            assert eng.cells.book.used() == a.n_cached + b.n_cached + c.n_cached - 40, "the prefix's cells counted once"
            assert eng.cells.book.shared_prefix(a.slot.seq_id) == eng.cells.book.shared_prefix(b.slot.seq_id) == 40
            eng.remove_sequence(a)
            _decode(eng, [b, c], 20)
            out[eng is e] = (a.tokens, b.tokens, c.tokens)
            eng.remove_sequence(b)
            eng.remove_sequence(c)
            assert eng.cells.book.used() == 0
        assert e.cells.compactions >= 3 and out[True] == out[False]
    finally:
        ref.unload()
        e.unload()


def test_runs_count_interleaved_steps_not_a_sequence_alone(gguf_path):
    e = _engine(gguf_path, 10**9)
    try:
        a, b = (Sequence(i, e.tokenize(t), SamplingParams(temperature=0)) for i, t in enumerate(("one", "two")))
        for s in (a, b):
            e.add_sequence(s)
        _decode(e, [a], 10)  # alone: its cells continue one run
        assert e.cells.runs[a.slot.seq_id] == 1
        _decode(e, [a, b], 5)  # together: a run per step
        assert e.cells.runs[a.slot.seq_id] == 1 + 6 and e.cells.runs[b.slot.seq_id] == 6
        e.cells.COMPACT_RUNS = 4
        e.step([Feed(a, a.tokens[-1:], True), Feed(b, b.tokens[-1:], True)])
        assert e.cells.compactions == 1 and e.cells.runs[a.slot.seq_id] == 2 and e.cells.runs[b.slot.seq_id] == 2
    finally:
        e.unload()
