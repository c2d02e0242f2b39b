"""The MLX engine driven directly (no server): loading, tokenizer and template, greedy decoding against mlx-lm run
directly, continuous batching (joins and leaves mid-run), prefix-cache KV reuse, sampling, and the real shared
scheduler on top.

Uses the tiny synthetic MLX folders (qwen2 architecture, 64 hidden, 2 layers, 4k vocab; float32 and 4-bit with
float32 scales), converted from the shared synthetic HF folder once and cached under ``$OCTO_HOME/synth``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")

from octo.engines.mlx import MLXEngine  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence, Task  # noqa: E402
from octo.errors import ConfigError, InvalidRequest  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and",
    "Numbers can be written in many ways:",
    "def add(a, b):",
    "She opened the letter carefully,",
    "In the spring the river rose",
    "A good engine answers quickly, keeps its memory small, and never forgets a request",
    "Hello",
    "Café, naïve, résumé",
]
SYSTEM = (
    "You are a careful assistant. The old lighthouse stood at the edge of the harbor, and every evening "
    "the keeper climbed the narrow stairs to light the lamp. Answer briefly and never forget the rocks."
)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def folder() -> str:
    from octo.synth.mlx import build_mlx

    return str(build_mlx("tiny"))


@pytest.fixture(scope="module")
def folder4() -> str:
    from octo.synth.mlx import build_mlx

    return str(build_mlx("tiny", quant="4bit"))


@pytest.fixture(scope="module")
def engine(folder):
    e = MLXEngine(EngineConfig(max_batch=8))
    e.load(folder, "tiny")
    yield e
    e.unload()


class Driver:
    """Mirrors octo.scheduler.admission's step loop: prompt chunks (sample on the last), then one token per step."""

    def __init__(self, engine: MLXEngine, chunk: int | None = None, stop_on_eos: bool = True) -> None:
        self.engine = engine
        self.stop_on_eos = stop_on_eos
        self.chunk = chunk or engine.prefill_chunk
        self.active: list[Sequence] = []
        self.n_prompt: dict[int, int] = {}
        self.limit: dict[int, int] = {}
        self.ids = 0

    def add(self, tokens: list[int], max_tokens: int, sampling: SamplingParams = GREEDY, restore=None) -> Sequence:
        self.ids += 1
        seq = Sequence(self.ids, list(tokens), sampling)
        self.engine.add_sequence(seq)
        if restore is not None:
            handle, n = restore
            self.engine.kv_restore(seq, handle, n)
        self.active.append(seq)
        self.n_prompt[seq.id] = len(tokens)
        self.limit[seq.id] = max_tokens
        return seq

    def generated(self, seq: Sequence) -> list[int]:
        return seq.tokens[self.n_prompt[seq.id] :]

    def step(self) -> list[Feed]:
        feeds = []
        for s in self.active:
            rest = len(s.tokens) - s.n_cached
            if rest == 1:
                feeds.append(Feed(s, s.tokens[-1:], True))
            else:
                take = min(rest, self.chunk)
                feeds.append(Feed(s, s.tokens[s.n_cached : s.n_cached + take], take == rest))
        out = self.engine.step(feeds)
        assert len(out) == len(feeds)
        eos = self.engine.info.eos_token_ids
        for f, tok in zip(feeds, out, strict=True):
            assert (tok is None) == (not f.sample)
            if tok is None:
                continue
            f.seq.tokens.append(tok)
            if (self.stop_on_eos and tok in eos) or len(self.generated(f.seq)) >= self.limit[f.seq.id]:
                self.finish(f.seq)
        return feeds

    def finish(self, seq: Sequence, save: bool = False):
        self.active.remove(seq)
        handle = self.engine.kv_save(seq) if save else None
        self.engine.remove_sequence(seq)
        return handle

    def run(self) -> None:
        while self.active:
            self.step()


def generate(engine, prompt: list[int], max_tokens: int = 24, sampling=GREEDY, chunk=None) -> list[int]:
    d = Driver(engine, chunk)
    seq = d.add(prompt, max_tokens, sampling)
    d.run()
    return d.generated(seq)


def chat_tokens(engine, user: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return engine.tokenize(engine.render_chat(msgs, add_generation_prompt=True), special=True)


# -- discovery, loading, text ------------------------------------------------------------------------
def test_detect_and_format(folder, tmp_path):
    det = MLXEngine.detect()
    assert det.available, det.reason
    assert "CPU" in det.reason or "Metal" in det.reason
    assert MLXEngine.artifact_format(folder) == "mlx"
    assert MLXEngine.artifact_format(str(tmp_path)) is None
    assert "+mlx-lm." in MLXEngine.version()


def test_unknown_option_rejected():
    with pytest.raises(ConfigError) as e:
        MLXEngine(EngineConfig(options={"threads": "4"}))
    assert e.value.param == "threads"
    with pytest.raises(ConfigError):
        MLXEngine(EngineConfig(options={"n_ctx": "many"}))


def test_load_info(engine):
    info = engine.info
    assert info.n_ctx == 2048 and info.n_vocab == 4096
    assert info.eos_token_ids == {engine.tokenize("<|im_end|>")[0], engine.tokenize("<|endoftext|>")[0]}
    assert info.extra["device"].startswith(("CPU", "Apple")) and info.extra["quantization"] is None
    assert "BatchKVCache" in info.extra["batching"] and "blas" in info.extra
    assert Task.CHAT in MLXEngine.tasks


def test_dtype_auto_upcasts_bfloat16_scales_on_cpu(tmp_path):
    """A 4-bit folder with bfloat16 scales (what ``mlx_lm.convert -q`` writes from a bf16 model) computes in
    float32 on CPU with dtype=auto: the packed 4-bit weights stay, scales/biases/norms become float32."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from octo.synth.hf import build_hf

    hf = build_hf("tiny")
    model, config = load_model(hf)
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    model, config = quantize_model(model, config, 64, 4)
    save_model(tmp_path, model)
    save_config(config, tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(hf / name, tmp_path / name)
    keep = MLXEngine(EngineConfig(options={"dtype": "keep"}))
    keep.load(str(tmp_path), "bf16")
    assert "bfloat16" in keep.info.extra["dtypes"]
    auto = MLXEngine()
    auto.load(str(tmp_path), "bf16")
    assert auto.info.extra["dtypes"] == ["float32", "uint32"] and auto.info.extra["quantization"]["bits"] == 4
    assert len(generate(auto, auto.tokenize(PROMPTS[0]), 8)) == 8
    with pytest.raises(ConfigError):
        MLXEngine(EngineConfig(options={"dtype": "float64"}))


def test_missing_folder_is_config_error(tmp_path):
    e = MLXEngine()
    with pytest.raises(ConfigError):
        e.load(str(tmp_path / "nope"), "x")
    with pytest.raises(ConfigError):
        e.load(str(tmp_path), "x")  # exists but is no MLX folder


_OWN_PROCESS = r"""
import json, sys
pre = sys.argv[3] == "torch-first"
if pre:
    import torch  # noqa: F401 - something in this process needs torch before the engine loads
from octo.engines.mlx import MLXEngine
from octo.engine import EngineConfig, SamplingParams
e = MLXEngine(EngineConfig(max_batch=2, own_process=sys.argv[2] == "own"))
e.load(sys.argv[1], "tiny")
prompt = e.tokenize(e.render_chat([{"role": "user", "content": "Tell me about the lighthouse."}]))
from test_mlx import generate
print(json.dumps({"tokens": generate(e, prompt, 16), "torch": sys.modules.get("torch") is not None}))
"""


@pytest.mark.parametrize("mode", ["own", "torch-first"])
def test_own_process_load_leaves_torch_out(folder, mode):
    """An engine worker of its own (``EngineConfig.own_process``) loads mlx-lm without torch, and generates the same
    tokens as a load in a shared process (which imports torch through transformers, where it is installed); torch that
    the process imported before stays usable."""
    import subprocess
    import sys

    pytest.importorskip("torch")

    def run(own: str, pre: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _OWN_PROCESS, folder, own, pre], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    shared = run("shared", "")
    own = run("own", mode)
    assert shared["torch"] is True  # transformers imports torch where it is installed
    assert own["torch"] is (mode == "torch-first")
    assert own["tokens"] == shared["tokens"] and len(own["tokens"]) == 16


def test_tokenizer_matches_shared_synthetic_tokenizer(engine):
    from octo.synth.tokenizer import load_tokenizer

    shared = load_tokenizer()
    for text in PROMPTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert engine.tokenize(text) == shared.encode(text, add_special_tokens=False).ids
        if "<|" not in text:
            assert b"".join(engine.token_bytes(t) for t in engine.tokenize(text)) == text.encode()
    im_start = shared.token_to_id("<|im_start|>")
    assert engine.tokenize("<|im_start|>") == [im_start]
    assert im_start not in engine.tokenize("<|im_start|>", special=False)  # plain text: not the special token
    assert engine.token_bytes(im_start) == b""


def test_chat_template_from_tokenizer(engine):
    text = engine.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert not engine.render_chat([{"role": "user", "content": "U"}], add_generation_prompt=False).endswith(
        "assistant\n"
    )


# -- correctness against mlx-lm itself ----------------------------------------------------------------
def _mlx_lm_greedy(folder: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    import mlx_lm

    model, tok = mlx_lm.load(folder)
    toks = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens)]
    text = mlx_lm.generate(model, tok, prompt, max_tokens=max_tokens)
    return toks, text


@pytest.mark.parametrize("quant", [None, "4bit"])
def test_greedy_equals_mlx_lm_generate(quant, folder, folder4):
    path = folder if quant is None else folder4
    e = MLXEngine()
    e.load(path, "tiny")
    if quant:
        assert e.info.extra["quantization"]["bits"] == 4 and "float32" in e.info.extra["dtypes"]
    prompt = chat_tokens(e, "Tell me about the lighthouse and the harbor.")
    ours = generate(e, prompt, 40)
    ref_tokens, ref_text = _mlx_lm_greedy(path, prompt, 40)
    # mlx-lm stops at EOS without yielding it; the scheduler's loop ends on it too
    ours_no_eos = [t for t in ours if t not in e.info.eos_token_ids]
    assert ours_no_eos == [t for t in ref_tokens if t not in e.info.eos_token_ids]
    assert len(ours_no_eos) >= 10
    text = b"".join(e.token_bytes(t) for t in ours_no_eos).decode("utf-8", "replace")
    assert text.removeprefix(" ") == ref_text  # mlx-lm's BPE detokenizer drops one leading space
    # chunked prefill (7-token chunks) gives the same tokens as one chunk
    assert generate(e, prompt, 40, chunk=7) == ours
    e.unload()


def test_batch_of_8_equals_single(engine):
    prompts = [engine.tokenize(p) for p in PROMPTS]
    singles = [generate(engine, p, 20) for p in prompts]
    d = Driver(engine, chunk=5)
    seqs = [d.add(p, 20) for p in prompts]
    widths = []
    while d.active:
        d.step()
        widths.append(len(engine.batch))
    assert max(widths) == 8  # all eight decoded in one batch
    assert [d.generated(s) for s in seqs] == singles


def test_batch_equals_mlx_lm_batch_generator(engine):
    """Eight sequences through our batch == mlx-lm's own continuous batcher (BatchGenerator) on the same model."""
    from mlx_lm.generate import BatchGenerator

    prompts = [engine.tokenize(p) for p in PROMPTS]
    gen = BatchGenerator(engine.model, max_tokens=16, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert(prompts)
    ref: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            ref[r.uid].append(r.token)
    gen.close()
    d = Driver(engine, stop_on_eos=False)
    seqs = [d.add(p, 16) for p in prompts]
    d.run()
    assert [d.generated(s) for s in seqs] == [ref[u] for u in uids]


def test_join_and_leave_mid_run(engine):
    a, b, c = (engine.tokenize(p) for p in PROMPTS[:3])
    want = {name: generate(engine, p, 16) for name, p in (("a", a), ("b", b), ("c", c))}
    d = Driver(engine)
    sa, sb = d.add(a, 16), d.add(b, 16)
    for _ in range(3):
        d.step()
    assert len(engine.batch) == 2
    sc = d.add(c, 16)  # joins the running batch at step 4
    d.step()
    assert len(engine.batch) == 3 and sc in engine.batch
    for _ in range(2):
        d.step()
    d.finish(sb)  # cancelled: leaves at once, the others go on
    assert len(engine.batch) == 2 and sb not in engine.batch
    d.run()
    assert d.generated(sa) == want["a"] and d.generated(sc) == want["c"]
    assert d.generated(sb) == want["b"][: len(d.generated(sb))]
    assert len(engine.batch) == 0


def test_row_without_feed_keeps_its_kv(engine):
    """A decoding sequence that gets no feed for a step leaves the batch with its KV and rejoins later."""
    a, b = engine.tokenize(PROMPTS[0]), engine.tokenize(PROMPTS[1])
    want = generate(engine, a, 12)
    d = Driver(engine)
    sa, _ = d.add(a, 12), d.add(b, 12)
    d.step()
    d.step()
    d.active.remove(sa)  # paused for two steps
    d.step()
    d.step()
    assert sa not in engine.batch and sa.slot.cache is not None
    d.active.append(sa)
    d.run()
    assert d.generated(sa) == want


# -- prefix cache ----------------------------------------------------------------------------------------
def test_prefix_cache_hit_equals_miss(engine, folder):
    first = chat_tokens(engine, "What does the keeper do?", SYSTEM)
    second = chat_tokens(engine, "Where are the rocks?", SYSTEM)
    shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert shared > 40
    miss = generate(engine, second, 24)

    d = Driver(engine, stop_on_eos=False)
    s1 = d.add(first, 1000)
    while len(d.generated(s1)) < 10:
        d.step()
    handle = d.finish(s1, save=True)
    assert handle.tokens == tuple(s1.tokens[: s1.n_cached]) and len(handle.tokens) == len(first) + 9
    cfg = json.loads((Path(folder) / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert handle.nbytes == per_token * len(handle.tokens)

    s2 = d.add(second, 24, restore=(handle, shared))  # restores a shorter prefix: trimmed
    assert s2.n_cached == shared
    d.run()
    assert d.generated(s2) == miss
    # the entry is intact after a restore: a second hit gives the same again
    s3 = d.add(second, 24, restore=(handle, shared))
    d.run()
    assert d.generated(s3) == miss
    # a full-length hit (the first conversation continued)
    cont = list(s1.tokens) + engine.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
    want = generate(engine, cont, 12)
    s4 = d.add(cont, 12, restore=(handle, len(handle.tokens)))
    d.run()
    assert d.generated(s4) == want
    engine.kv_free(handle)
    assert handle.data is None


def test_kv_save_while_in_batch_and_during_prefill(engine):
    a, b = engine.tokenize(PROMPTS[5]), engine.tokenize(PROMPTS[0])
    d = Driver(engine, chunk=4, stop_on_eos=False)
    sa, _ = d.add(a, 30), d.add(b, 30)
    d.step()
    h_prefill = engine.kv_save(sa)  # mid-prompt: its own cache
    assert h_prefill.tokens == tuple(a[:4])
    while len(d.generated(sa)) < 5:
        d.step()
    h_batch = engine.kv_save(sa)  # a row of the 2-row batch
    assert len(engine.batch) == 2 and len(h_batch.tokens) == sa.n_cached
    d.run()
    want = generate(engine, a, 30)
    d2 = Driver(engine)
    s = d2.add(a, 30, restore=(h_batch, len(a) - 1))
    d2.run()
    assert d2.generated(s) == want


def test_restore_mismatch_raises(engine):
    d = Driver(engine)
    s = d.add(engine.tokenize(PROMPTS[0]), 2)
    d.step()
    handle = engine.kv_save(s)
    other = d.add(engine.tokenize(PROMPTS[1]), 2)
    with pytest.raises(ValueError):
        engine.kv_restore(other, handle, 5)
    d.finish(s)
    d.finish(other)
    assert len(engine.batch) == 0


# -- sampling ----------------------------------------------------------------------------------------
def test_sampling_params_declared():
    assert {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "logit_bias",
    } <= MLXEngine.sampling_params
    assert "grammar" not in MLXEngine.sampling_params and "json_schema" not in MLXEngine.sampling_params


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine):
    p = engine.tokenize(PROMPTS[0])
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=7)
    alone = generate(engine, p, 20, sp)
    assert generate(engine, p, 20, sp) == alone
    assert generate(engine, p, 20, SamplingParams(temperature=1.0, seed=8)) != alone
    d = Driver(engine)
    others = [
        d.add(engine.tokenize(q), 20, SamplingParams(temperature=0.9, seed=i)) for i, q in enumerate(PROMPTS[1:4])
    ]
    s = d.add(p, 20, sp)
    d.run()
    assert d.generated(s) == alone and all(len(d.generated(o)) for o in others)


def test_filters_that_leave_one_token_are_greedy(engine):
    p = engine.tokenize(PROMPTS[1])
    greedy = generate(engine, p, 16)
    for sp in (
        SamplingParams(temperature=1.5, top_k=1, seed=3),
        SamplingParams(temperature=1.5, min_p=1.0, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3),
    ):
        assert generate(engine, p, 16, sp) == greedy, sp


def test_logit_bias_and_repetition_penalty(engine):
    p = engine.tokenize(PROMPTS[2])
    greedy = generate(engine, p, 16)
    forced = engine.tokenize(" harbor")[0]
    assert generate(engine, p, 8, SamplingParams(temperature=0.0, logit_bias={forced: 100.0})) == [forced] * 8
    banned = generate(engine, p, 16, SamplingParams(temperature=0.0, logit_bias={greedy[0]: -100.0}))
    assert banned[0] != greedy[0] and greedy[0] not in banned
    rep = generate(engine, p, 16, SamplingParams(temperature=0.0, repetition_penalty=1.5))
    assert rep != greedy
    assert len(set(rep)) >= len(set(greedy))


def test_bad_sampling_values_are_400(engine):
    for sp in (
        SamplingParams(min_p=2.0),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(logit_bias={10**6: 1.0}),
    ):
        with pytest.raises(InvalidRequest):
            engine.add_sequence(Sequence(1, [1, 2], sp))


# -- threads: the engine thread does not hold the GIL while MLX computes --------------------------------
def test_step_releases_the_gil(engine):
    prompt = engine.tokenize(" ".join(PROMPTS) * 6)
    ticks: list[float] = []
    done = threading.Event()

    def work():
        for _ in range(3):
            generate(engine, prompt, 4)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.002)
    t.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) > 5 and max(gaps) < 0.25, max(gaps)


# -- the real shared scheduler on top ------------------------------------------------------------------
async def test_scheduler_batching_cache_and_cancel(folder):
    from octo.scheduler.admission import GenerationRequest, Scheduler
    from octo.scheduler.prefix_cache import PrefixCache

    e = MLXEngine(EngineConfig(max_batch=4))
    e.load(folder, "tiny")
    cache = PrefixCache(64 << 20, e.kv_free)
    sched = Scheduler(e, max_batch=4, cache=cache)
    sched.start(asyncio.get_running_loop())
    try:
        first = chat_tokens(e, "What does the keeper do?", SYSTEM)
        second = chat_tokens(e, "Where are the rocks?", SYSTEM)
        want = generate(e, second, 12)
        [t1] = sched.submit(GenerationRequest(first, GREEDY, max_tokens=8))
        await t1.result
        [t2] = sched.submit(GenerationRequest(second, GREEDY, max_tokens=12))
        r2 = await t2.result
        assert r2.cached_tokens > 40 and cache.hits == 1
        assert [t for t in r2.token_ids] == [t for t in want if t not in e.info.eos_token_ids][: len(r2.token_ids)]
        # a long request cancelled mid-run leaves while a short one finishes normally
        [long] = sched.submit(GenerationRequest(e.tokenize(PROMPTS[0]), GREEDY, max_tokens=1000, stream=True))
        [short] = sched.submit(GenerationRequest(e.tokenize(PROMPTS[1]), GREEDY, max_tokens=6))
        await asyncio.wait_for(long.deltas().__anext__(), 30)
        sched.abandon(long)
        res = await asyncio.wait_for(long.result, 30)
        assert res.finish_reason == "cancelled" and res.completion_tokens < 1000
        assert (await short.result).completion_tokens <= 6
        for _ in range(50):
            if not sched.stats()["active"]:
                break
            await asyncio.sleep(0.02)
        assert len(e.batch) == 0
    finally:
        sched.stop()
        e.unload()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_kv_cells_bound_preempts_and_every_sequence_finishes(folder, mode):
    from octo.scheduler.admission import GenerationRequest, Scheduler

    e = MLXEngine(EngineConfig(max_batch=4, options={"kv_cells": "96"}))
    e.load(folder, "tiny")
    assert e.info.n_ctx == 96
    sched = Scheduler(e, max_batch=4, preempt=mode)
    sched.start(asyncio.get_running_loop())
    try:
        prompts = [e.tokenize(p)[:12] for p in PROMPTS[:4]]
        tickets = [sched.submit(GenerationRequest(p, GREEDY, max_tokens=40))[0] for p in prompts]
        results = [await asyncio.wait_for(t.result, 120) for t in tickets]
        for r in results:  # 4 x ~52 tokens in 96 cells: each fits alone, together they preempt
            assert r.finish_reason in ("length", "stop") and r.completion_tokens <= 40
            assert r.finish_reason == "stop" or r.completion_tokens == 40
        assert sched.stats()["total_preemptions"] > 0 and e.kv_room() == 96 and len(e.batch) == 0
    finally:
        sched.stop()
        e.unload()


# -- BLAS choice (MLX's BLAS is fixed when MLX is first loaded, so these run in fresh processes) -----------
def _fresh(code: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


_BLAS_CODE = (
    "from octo.engine import EngineConfig\nfrom octo.engines.mlx import MLXEngine\n"
    "from octo.errors import ConfigError\n"
    "e = MLXEngine(EngineConfig(options={{'blas': {blas!r}}}))\ntry:\n    e.load({folder!r}, 't')\n"
    "    print(e.info.extra['blas'])\nexcept ConfigError as exc:\n    print('ConfigError', exc.param, exc)"
)


def test_blas_option_explicit(folder):
    out = _fresh(_BLAS_CODE.format(blas="/nonexistent/libopenblas.so.0", folder=folder))
    assert out.startswith("ConfigError blas") and "/nonexistent/libopenblas.so.0" in out
    assert _fresh(_BLAS_CODE.format(blas="bundled", folder=folder)).startswith("bundled reference BLAS")


def test_blas_auto_preloads_system_openblas(folder):
    from octo.engines.mlx.runtime import find_openblas

    path = find_openblas()
    if path is None:
        pytest.skip("no system OpenBLAS here (apt install libopenblas0) to check that blas=auto preloads it")
    assert _fresh(_BLAS_CODE.format(blas="auto", folder=folder)) == f"OpenBLAS ({path})"


_NEEDS_TORCH = r"""
import sys
from octo.engines.mlx import MLXEngine, runtime
from octo.engine import EngineConfig
from octo.errors import ConfigError
assert runtime.hide_torch() and runtime.torch_hidden()
try:
    import torch  # noqa: F401 - what a tokenizer that needs torch does
except ImportError as exc:
    assert runtime.needs_torch(exc)
assert not runtime.needs_torch(ValueError("x")) and not runtime.needs_torch(ModuleNotFoundError("y", name="yaml"))
import mlx_lm.utils
def load(path, return_config=False):  # a folder whose tokenizer imports torch, through transformers' lazy import
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("Could not import module 'AutoTokenizer'") from exc
mlx_lm.utils.load = load
e = MLXEngine(EngineConfig(own_process=True))
try:
    e.load(sys.argv[1], "tiny")
except ConfigError as exc:
    print(exc.message)
"""


def test_a_tokenizer_that_needs_torch_says_how_to_serve_it(folder):
    """Where torch is hidden and a model's tokenizer imports it after all, the load fails with a ConfigError that says
    so and names the way out (--isolation thread), not with transformers' import error."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NEEDS_TORCH, folder], capture_output=True, text=True, timeout=300,
                         check=True)
    assert "needs torch (its tokenizer imports it)" in out.stdout and "--isolation thread" in out.stdout, out
