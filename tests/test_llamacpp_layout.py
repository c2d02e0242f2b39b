"""llama.cpp's KV layout chosen by measurement while the model is idle (engines/llamacpp/layout.py, background.py):
the load serves at once from the unified pool; the probe times both layouts through the engine's own serving paths,
the faster wins (streams by a margin), an undisturbed verdict is cached per host and load settings and the next load
serves with it; a request interrupts the probe, which leaves the engine as it serves.

The suite pins ``OCTO_LLAMACPP_KV_UNIFIED=true`` (conftest) so other tests do not depend on a timing; these tests
unset it."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine, background, layout  # noqa: E402
from octo.engines.llamacpp.native import bindings  # noqa: E402
from probefiles import cached_verdict  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """No pinned layout, a probe cache of this test's own, and measurements that count as undisturbed (the host of
    the suite is busy; a disturbed one has its own test)."""
    from octo.benchload import LoadMonitor

    monkeypatch.delenv(layout.ENV, raising=False)
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    real = LoadMonitor.stop
    monkeypatch.setattr(LoadMonitor, "stop", lambda self: {**real(self), "disturbed": False})
    monkeypatch.setattr(background, "quiet_now", lambda: True)
    return tmp_path


def _load(path: str, max_batch: int = 4, settle: bool = False, **opts: str) -> LlamaCppEngine:
    e = LlamaCppEngine(EngineConfig(max_batch=max_batch, options={"n_ctx": "512", **opts}))
    e.load(path, "tiny")
    if settle:  # what the engine loop does when the model is idle
        background.settle(e.layout)
    return e


def _measured(path: str, **kw) -> dict:
    """The layout verdict of a load whose probe ran to its end (then unloaded)."""
    e = _load(path, settle=True, **kw)
    try:
        assert not e.active and e.cells.book.used() == 0 and e.kv_unified, "the probe left the pool as it served"
        return dict(e.info.extra["kv_layout"])
    finally:
        e.unload()


def _greedy(e: LlamaCppEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = [Sequence(i, list(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    for s in seqs:
        e.add_sequence(s)
        out = e.step([Feed(s, s.tokens, True)])
        s.tokens.append(out[0])
    for _ in range(n - 1):
        for s, tok in zip(seqs, e.step([Feed(s, s.tokens[-1:], True) for s in seqs]), strict=True):
            s.tokens.append(tok)
    for s in seqs:
        e.remove_sequence(s)
    return [s.tokens[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def test_serves_at_once_then_measured_when_idle_then_cached(gguf_path, auto):
    e = _load(gguf_path)
    try:
        lay = e.info.extra["kv_layout"]
        assert lay["pending"] and lay["chosen"] == "unified" and e.kv_unified, "the safe default, no probe at load"
        assert _greedy(e, [e.tokenize("hello there")], 3)[0]
        background.settle(e.layout)
        lay = e.info.extra["kv_layout"]
        assert lay["source"] == "measured" and not lay.get("cached") and not lay.get("pending")
        assert lay["unified_s"] > 0 and lay["streams_s"] > 0
        assert lay["probe"] == {"seqs": 4, "prefix": lay["probe"]["prefix"], "own": lay["probe"]["own"],
                                "decode": lay["probe"]["decode"]} and lay["probe"]["prefix"] > lay["probe"]["own"]
        # the verdict follows the numbers: streams only when faster by the margin on both probes
        assert lay["solo_unified_s"] > 0 and lay["solo_streams_s"] > 0
        streams = (lay["streams_s"] <= layout.MARGIN * lay["unified_s"]
                   and lay["solo_streams_s"] <= layout.MARGIN * lay["solo_unified_s"])
        assert e.kv_unified and lay.get("next_load") == ("streams" if streams else None), lay
        assert e.info.extra["kv_unified"] is e.kv_unified and e.kv_shares_cells is e.kv_unified
        assert not e.active and e.cells.book.used() == 0, "the probe's sequences are gone"
        tokens = _greedy(e, [e.tokenize("hello there"), e.tokenize("a longer prompt about engines")], 6)
        assert all(len(t) == 6 for t in tokens)
    finally:
        e.unload()
    cached = cached_verdict(auto, "layout", False)
    assert cached["unified"] is (not streams)
    again = _load(gguf_path)
    try:
        assert again.info.extra["kv_layout"]["cached"] is True and not again.info.extra["kv_layout"].get("pending")
        assert again.kv_unified is (not streams)
        assert again.idle_work(lambda: False) is None or again.layout.verdicts.get("adapt"), "nothing left to measure"
    finally:
        again.unload()
    other = _load(gguf_path, max_batch=3)  # another setting the timing depends on: measured again
    try:
        assert other.info.extra["kv_layout"].get("pending")
    finally:
        other.unload()


def test_a_request_interrupts_the_probe_which_leaves_the_engine_as_it_serves(gguf_path, auto):
    e = _load(gguf_path)
    try:
        calls = []

        def interrupted() -> bool:
            calls.append(1)
            return len(calls) > 6  # a request arrives a few probe steps in

        assert e.idle_work(interrupted) == background.INTERRUPTED_RETRY_S
        assert e.layout.verdicts["pending"] and e.kv_unified and not e.active and e.cells.book.used() == 0
        assert not list((auto / "probe").glob("llamacpp-layout-*.json")), "nothing concluded, nothing cached"
        assert _greedy(e, [e.tokenize("served meanwhile")], 3)[0]
        background.settle(e.layout)  # the next idle moment: it starts again and concludes
        assert e.layout.verdicts["source"] == "measured" and cached_verdict(auto, "layout", False)
    finally:
        e.unload()


def test_a_disturbed_measurement_is_not_followed_and_waits_for_its_retry(gguf_path, auto, monkeypatch, forbid):
    from octo.benchload import LoadMonitor

    monkeypatch.setattr(LoadMonitor, "stop", lambda self: {"disturbed": True})
    lay = _measured(gguf_path)
    assert lay["pending"] and lay["attempts"] == 1 and lay["last"]["disturbed"] and lay["chosen"] == "unified"
    assert cached_verdict(auto, "layout", True) is None
    forbid(layout, "_workload")  # the next start does not measure again before the retry time
    e = _load(gguf_path)
    try:
        assert e.layout.verdicts["pending"] and e.layout.verdicts["attempts"] == 1
        assert e.layout.verdicts["retry_at"] >= background.retry_at(1) - 60
        wait = e.idle_work(lambda: False)
        assert wait is not None and wait > background.DISTURBED_RETRY_S[0] / 2
    finally:
        e.unload()


@pytest.mark.parametrize("faster", ["streams", "unified"])
def test_the_faster_layout_serves(gguf_path, auto, monkeypatch, faster):
    """The verdict drives the serving context: with the probe's timings scripted, the context has that layout."""
    real = layout._workload

    def timed(engine, *shape, reps):
        agent, solo = real(engine, *shape, reps=reps)  # the probe still runs through the engine
        assert len(agent) == len(solo) == reps and min(agent + solo) > 0
        return ([1.0, 1.5], [0.5]) if engine.kv_unified == (faster == "unified") else ([2.0, 2.5], [1.0])

    monkeypatch.setattr(layout, "_workload", timed)
    _measured(gguf_path)
    e = _load(gguf_path)  # the next load serves with the verdict
    try:
        assert e.info.extra["kv_layout"]["chosen"] == faster
        assert e.kv_unified is (faster == "unified") and e.kv_shares_cells is e.kv_unified
        L = e.lib  # a unified pool is one sequence's whole context; streams are n_ctx cells each
        assert L.llama_n_ctx_seq(e.ctx) == (L.llama_n_ctx(e.ctx) if faster == "unified" else 512)
        assert (e.n_cache_seqs > 0) is (faster == "unified")
        assert (e.kv_room() is None) is (faster == "streams")
        assert _greedy(e, [e.tokenize("same text"), e.tokenize("same text")], 5)[0] != []
    finally:
        e.unload()


@pytest.mark.parametrize("agent, solo, chosen", [(0.96, 0.5, "unified"), (0.5, 0.96, "unified"),
                                                 (0.94, 0.94, "streams")])
def test_streams_win_only_by_the_margin_on_both_probes(gguf_path, auto, monkeypatch, agent, solo, chosen):
    monkeypatch.setattr(layout, "_workload",
                        lambda engine, *shape, reps: ([1.0], [1.0]) if engine.kv_unified else ([agent], [solo]))
    lay = _measured(gguf_path)
    assert lay.get("next_load", "unified") == chosen
    assert (lay["streams_over_unified"], lay["solo_streams_over_unified"]) == (agent, solo)


def test_no_probe_when_the_choice_is_given_or_moot(gguf_path, auto, monkeypatch, forbid):
    forbid(layout, "_workload")
    for opts, source, unified in (({"kv_unified": "false"}, "option", False), ({"kv_unified": "true"}, "option", True),
                                  ({"kv_cells": "1024"}, "option kv_cells", True)):
        e = _load(gguf_path, **opts)
        try:
            assert e.info.extra["kv_layout"]["source"].startswith(source) and e.kv_unified is unified
        finally:
            e.unload()
    e = _load(gguf_path, max_batch=1)
    try:
        assert e.info.extra["kv_layout"]["source"].startswith("max_batch 1") and e.kv_unified
    finally:
        e.unload()
    monkeypatch.setenv(layout.ENV, "false")
    e = _load(gguf_path)
    try:
        assert e.info.extra["kv_layout"]["source"] == layout.ENV and not e.kv_unified
    finally:
        e.unload()
    monkeypatch.setenv(layout.ENV, "sideways")
    with pytest.raises(ConfigError, match=layout.ENV):
        _load(gguf_path)
    with pytest.raises(ConfigError, match="kv_unified"):
        LlamaCppEngine(EngineConfig(options={"kv_unified": "maybe"}))


def test_streams_that_would_not_fit_memory_are_not_tried(gguf_path, auto, monkeypatch):
    monkeypatch.setattr(layout, "available_memory", lambda: 1024)
    monkeypatch.setattr(layout, "_workload", lambda *a: (_ for _ in ()).throw(AssertionError("probed")))
    e = _load(gguf_path)
    try:
        lay = e.info.extra["kv_layout"]
        assert lay["source"] == "memory" and lay["streams_kv_bytes"] > 1024 and e.kv_unified
    finally:
        e.unload()


@pytest.mark.parametrize("phase", ["unified", "streams"])
def test_a_failing_probe_costs_the_choice_not_the_load(gguf_path, auto, monkeypatch, phase):
    real = layout._workload

    def fails(engine, *shape, reps):
        if engine.kv_unified == (phase == "unified"):
            engine.add_sequence(Sequence(123, [1, 2, 3], SamplingParams(temperature=0)))  # left behind
            raise RuntimeError("probe broke")
        return real(engine, *shape, reps=reps)

    monkeypatch.setattr(layout, "_workload", fails)
    e = _load(gguf_path, settle=True)
    try:
        assert e.kv_unified and "probe broke" in e.info.extra["kv_layout"]["source"]
        assert not e.layout.verdicts.get("pending")
        assert e.idle_work(lambda: False) in (None, background.INTERRUPTED_RETRY_S)
        assert not e.active and e.cells.book.used() == 0, "a fresh context: nothing of the probe is left"
        assert _greedy(e, [e.tokenize("still serves")], 3)[0]
    finally:
        e.unload()
    assert not list((auto / "probe").glob("llamacpp-layout-*.json"))


def test_probe_shape_fits_small_contexts_and_slow_models():
    assert layout._shape(16, 4096, 4096) == (4, layout.PREFIX, layout.OWN, layout.DECODE)
    assert layout._shape(16, 4096, 4096, rate=10_000.0) == (4, layout.PREFIX, layout.OWN, layout.DECODE)
    seqs, prefix, own, decode = layout._shape(4, 256, 256)
    assert seqs == 4 and prefix + own + decode <= 256 - 8 and prefix + seqs * (own + decode) <= 256 - 8
    assert layout._shape(2, 64, 128)[0] == 2
    # a model prefilling 30 tok/s (a 7B on 2 cores) gets a probe of about BUDGET_S, at a floor of work
    seqs, prefix, own, decode = layout._shape(16, 4096, 4096, rate=30.0)
    work = 2 * prefix + 2 * layout.REPS * seqs * (own + layout.DECODE_COST * decode)
    assert prefix < layout.PREFIX and work <= 2 * layout.BUDGET_S * 30
    assert (prefix, own, decode) >= (16, 4, 2)


def test_streams_decode_a_step_as_one_micro_batch_in_any_feed_order(gguf_path, monkeypatch):
    """In streams llama.cpp puts in one micro-batch only sequences whose ids rise by one in batch order: the engine
    orders each step by sequence id and gives a new sequence the lowest free id, so a step of every sequence is one
    pass over the weights whatever the scheduler's order (it was one pass per sequence: 0.53x the tok/s at 16
    streams). The answers still reach their feeds: the same tokens as the unified pool's."""
    import ctypes
    import os

    pytest.importorskip("llama_cpp")
    L = bindings()  # the ctypes bindings the engine calls (llama_cpp.llama_cpp)
    ggml = ctypes.CDLL(os.path.join(os.path.dirname(L.__file__), "lib", "libggml-base.so"))
    ggml.ggml_get_name.restype, ggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    passes = [0]

    @L.ggml_backend_sched_eval_callback
    def observe(tensor, ask, _data):  # asked once per graph computed: the logits of one micro-batch
        if ask and ggml.ggml_get_name(tensor) == b"result_output":
            passes[0] += 1
        return False

    plain = L.llama_context_default_params

    def params():
        p = plain()
        p.cb_eval = observe
        return p

    monkeypatch.setattr(L, "llama_context_default_params", params)
    runs = {}
    for unified in ("true", "false"):
        e = _load(gguf_path, kv_unified=unified)
        try:
            seqs = [Sequence(i, e.tokenize(f"prompt number {i}"), SamplingParams(temperature=0)) for i in range(4)]
            for s in seqs:
                e.add_sequence(s)
            e.remove_sequence(seqs[1])  # its id is free again: the next sequence takes it (the lowest)
            seqs[1] = Sequence(9, e.tokenize("a later prompt"), SamplingParams(temperature=0))
            e.add_sequence(seqs[1])
            assert sorted(s.slot.seq_id for s in seqs) == [0, 1, 2, 3] and seqs[1].slot.seq_id == 1
            order = [seqs[i] for i in (2, 0, 3, 1)]  # not the ids' order
            for s, tok in zip(order, e.step([Feed(s, s.tokens, True) for s in order]), strict=True):
                s.tokens.append(tok)
            steps = []
            for _ in range(4):
                passes[0] = 0
                for s, tok in zip(order, e.step([Feed(s, s.tokens[-1:], True) for s in order]), strict=True):
                    s.tokens.append(tok)
                steps.append(passes[0])
            assert steps == [1, 1, 1, 1], f"micro-batches per decode step ({unified=}): {steps}"
            runs[unified] = [s.tokens for s in seqs]
        finally:
            e.unload()
    assert runs["false"] == runs["true"]


def test_a_busy_host_postpones_the_probe_without_running_it(gguf_path, auto, monkeypatch, forbid):
    """Other processes keep the cores busy: the due probe does not start (its measurement would be thrown away) and
    no attempt is counted; it looks again in BUSY_RETRY_S."""
    looks = []
    monkeypatch.setattr(background, "quiet_now", lambda: looks.append(1) or False)
    e = _load(gguf_path)
    try:
        forbid(layout, "_workload")
        assert e.idle_work(lambda: False) == background.BUSY_RETRY_S and looks == [1]
        assert e.layout.verdicts["pending"] and not e.layout.verdicts.get("attempts")
    finally:
        e.unload()


def test_a_probe_that_others_disturb_stops_and_leaves_the_engine_as_it_serves(gguf_path, auto, monkeypatch):
    """A competitor starts while the probe runs: it stops at its next look (no wasted minutes of probing), counts no
    attempt, leaves the pool as it serves, and runs to its end at a later quiet moment."""
    looks = []
    monkeypatch.setattr(background, "disturbed", lambda monitor: looks.append(1) or len(looks) >= 2)
    monkeypatch.setattr(background, "LOOK_AFTER_S", 0.0)
    monkeypatch.setattr(background, "LOOK_EVERY_S", 0.0)
    e = _load(gguf_path)
    try:
        assert e.idle_work(lambda: False) == background.BUSY_RETRY_S and len(looks) == 2
        assert e.layout.verdicts["pending"] and not e.layout.verdicts.get("attempts")
        assert e.kv_unified and not e.active and e.cells.book.used() == 0
        assert not list((auto / "probe").glob("llamacpp-layout-*.json")), "nothing concluded, nothing cached"
        assert _greedy(e, [e.tokenize("served meanwhile")], 3)[0]
        monkeypatch.setattr(background, "disturbed", lambda monitor: False)
        while (wait := e.idle_work(lambda: False)) is not None and e.layout.verdicts.get("pending"):
            assert wait == background.INTERRUPTED_RETRY_S or wait < 60, wait
            e.layout.verdicts["retry_at"] = 0.0
        assert e.layout.verdicts["source"] == "measured" and cached_verdict(auto, "layout", False)
    finally:
        e.unload()


def test_flash_attention_follows_the_layout_the_model_loads_with(gguf_path):
    """On the CPU a model loaded into per-sequence streams computes without flash attention (llama.cpp's CPU kernel
    takes steps of under 64 tokens a query row at a time; in streams a query's cells are its own: bench/agent.py
    --octo-ab, 0.44x the wall time); in the unified pool it keeps llama.cpp's auto; an explicit option wins; and an
    engine keeps its load's setting in every context it builds, so KV snapshots move between them."""
    if bindings().llama_supports_gpu_offload():
        pytest.skip("a GPU build of llama.cpp keeps auto in both layouts")
    for opts, want in (({"kv_unified": "false"}, "off"), ({"kv_unified": "true"}, "auto"),
                       ({"kv_unified": "false", "flash_attn": "on"}, "on")):
        e = _load(gguf_path, **opts)
        try:
            assert e.flash_attn == want and e.info.extra["flash_attn"] == want, opts
            if opts["kv_unified"] == "true":
                e.rebuild_context(False, None)  # streams built later (a layout switch) keep the load's setting
                assert not e.kv_unified and e.flash_attn == "auto"
        finally:
            e.unload()


def test_flash_attention_default_by_build_and_layout():
    from octo.engines.llamacpp.context import default_flash_attn

    class Build:
        def __init__(self, gpu: bool) -> None:
            self.gpu = gpu

        def llama_supports_gpu_offload(self) -> bool:
            return self.gpu

    assert default_flash_attn(Build(False), {}, unified=False) == "off"
    assert default_flash_attn(Build(False), {}, unified=True) == "auto"
    assert default_flash_attn(Build(True), {}, unified=False) == "auto"  # layers on a GPU: llama.cpp's choice
    assert default_flash_attn(Build(True), {"n_gpu_layers": 0}, unified=False) == "off"  # a GPU build kept on the CPU
