"""LoRA adapters (issue 22, point 2): the synthetic adapters, llama.cpp's per-sequence adapters, prefix-cache keying,
the models file / --lora plumbing and ``base:adapter`` routing.

The decisive check: the logits of the base GGUF with a synthetic GGUF LoRA applied equal those of a merged model built
independently (``W + alpha / rank * B @ A`` in numpy on the Hugging Face weights, converted to its own GGUF), in
float32, within 1e-3 (logits have a std of ~4; base and merged differ by more than 1). In a step that mixes sequences
of different adapters (one llama_decode per adapter) each sequence still gets its own model's logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from octo.engine import EngineConfig, Feed, KVHandle, SamplingParams, Sequence
from octo.errors import ConfigError, InvalidRequest, ModelNotFound
from octo.scheduler.prefix_cache import PrefixCache
from octo.synth.lora import LoraSpec, build_gguf_lora, build_merged_gguf, build_mlx_lora, lora_weights

SHAPE = "tiny"
LORA_X = LoraSpec(seed=1)
LORA_Y = LoraSpec(seed=2, rank=4, alpha=4.0, targets=("k_proj", "gate_proj", "down_proj"), strength=0.8)
PROMPTS = ["The old lighthouse stood at the edge of the harbor, and", "def add(a, b):", "Numbers can be written"]
ATOL = 1e-3


def test_lora_spec_and_weights_are_deterministic():
    a = lora_weights(SHAPE, LORA_X)
    b = lora_weights(SHAPE, LORA_X)
    assert a.keys() == b.keys() and len(a) == 2 * len(LORA_X.targets)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert a[k][0].shape == (8, 64) and a[k][1].shape == (64, 8)
    assert np.array_equal(a[k][0], b[k][0])
    assert not np.array_equal(a[k][0], lora_weights(SHAPE, LORA_Y).get(k, (np.zeros(1),))[0])
    with pytest.raises(ValueError):
        LoraSpec(targets=("nope",))


def test_gguf_lora_layout():
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(build_gguf_lora(SHAPE, 0, LORA_X))
    fields = {f.name: f for f in r.fields.values()}
    assert bytes(fields["general.type"].parts[-1]).decode() == "adapter"
    assert bytes(fields["adapter.type"].parts[-1]).decode() == "lora"
    assert float(fields["adapter.lora.alpha"].parts[-1][0]) == LORA_X.alpha
    names = {t.name: t for t in r.tensors}
    a, b = names["blk.1.attn_q.weight.lora_a"], names["blk.1.attn_q.weight.lora_b"]
    assert list(a.shape) == [64, 8] and list(b.shape) == [8, 64]  # ggml order (ne0 first): A (in, r), B (r, out)
    assert "blk.0.ffn_up.weight.lora_a" in names and "blk.0.attn_k.weight.lora_a" not in names


def test_mlx_adapter_layout():
    from safetensors.numpy import load_file

    folder = build_mlx_lora(SHAPE, 0, LORA_X)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["lora_parameters"]["rank"] == 8
    assert cfg["lora_parameters"]["scale"] == LORA_X.scale and "self_attn.q_proj" in cfg["lora_parameters"]["keys"]
    t = load_file(str(folder / "adapters.safetensors"))
    a, b = lora_weights(SHAPE, LORA_X)["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(t["model.layers.0.mlp.up_proj.lora_a"], a.T)
    assert np.array_equal(t["model.layers.0.mlp.up_proj.lora_b"], b.T)


# -- prefix cache: KV of one adapter never serves another ----------------------------------------------------------
def test_prefix_cache_keys_by_adapter():
    freed = []
    cache = PrefixCache(1 << 20, freed.append)
    toks = list(range(100, 140))
    h = KVHandle(tuple(toks), 100)
    cache.insert(h, "x")
    assert cache.lookup(toks, len(toks) - 1) == (None, 0)  # the base model: a miss
    assert cache.lookup(toks, len(toks) - 1, "y") == (None, 0)  # another adapter: a miss
    assert cache.lookup(toks, len(toks) - 1, "x") == (h, len(toks) - 1)
    base = KVHandle(tuple(toks), 100)
    cache.insert(base)  # the same tokens without adapter: an entry of its own, the adapter's stays
    assert cache.lookup(toks, 30) == (base, 30) and cache.lookup(toks, 30, "x") == (h, 30)
    assert cache.stats()["entries"] == 2 and not freed
    cache.clear()
    assert len(freed) == 2


def test_sharing_never_follows_another_adapter():
    from octo.scheduler.sharing import PrefixSharing

    class T:
        def __init__(self, tokens, adapter):
            self.seq = Sequence(0, tokens, SamplingParams(adapter=adapter))
            self.lead = None

    active: list = []
    s = PrefixSharing(None, active, dedup=True)
    prompt = list(range(200))
    other, same, t = T(prompt + [1], "x"), T(prompt + [2], None), T(prompt + [3], None)
    active[:] = [other, t]
    s.find_lead(t)
    assert t.lead is None  # the only running sequence with that prefix uses adapter x
    active[:] = [other, same, t]
    s.find_lead(t)
    assert t.lead is same


# -- llama.cpp ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    from octo.synth.gguf import build_gguf

    return {"base": build_gguf(SHAPE, 0, "f32"), "x": build_gguf_lora(SHAPE, 0, LORA_X),
            "y": build_gguf_lora(SHAPE, 0, LORA_Y), "merged_x": build_merged_gguf(SHAPE, 0, LORA_X),
            "merged_y": build_merged_gguf(SHAPE, 0, LORA_Y)}


def _engine(path, max_batch=4, **opts):
    from octo.engines.llamacpp import LlamaCppEngine

    e = LlamaCppEngine(EngineConfig(max_batch=max_batch, options={"n_ctx": "256", "n_threads": "2", **opts}))
    e.load(str(path), "m")
    return e


def _run(e, prompts, adapters, steps=6):
    """Greedy decode every prompt at once (one step for all, however the adapters mix); per sequence: the top-20
    logprobs of each sampled position and the tokens."""
    seqs = [Sequence(i, e.tokenize(p), SamplingParams(temperature=0.0, adapter=a))
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    for s in seqs:
        e.add_sequence(s)
    tops: list[list] = [[] for _ in seqs]
    feeds = [Feed(s, list(s.tokens), True, logprobs=20) for s in seqs]
    for _ in range(steps):
        out = e.step(feeds)
        for i, (f, tok) in enumerate(zip(feeds, out, strict=True)):
            tops[i].append(f.logprob)
            f.seq.tokens.append(tok)
        feeds = [Feed(s, s.tokens[-1:], True, logprobs=20) for s in seqs]
    for s in seqs:
        e.remove_sequence(s)
    return [s.tokens for s in seqs], tops


def _close(a, b):
    """Two runs' per-position (logprob, top-20) entries: same tokens, logprobs within ATOL."""
    for (lp_a, top_a), (lp_b, top_b) in zip(a, b, strict=True):
        assert abs(lp_a - lp_b) < ATOL
        assert [t for t, _ in top_a[:5]] == [t for t, _ in top_b[:5]]
        assert np.allclose([v for _, v in top_a], [v for _, v in top_b], atol=ATOL)


def test_adapter_logits_equal_the_merged_model(files):
    from octo.engines.llamacpp.logits import logits_row

    def logits(path, adapter=None, **opts):
        e = _engine(path, **opts)
        try:
            toks = e.tokenize(PROMPTS[0])
            s = Sequence(1, toks, SamplingParams(temperature=0.0, adapter=adapter))
            e.add_sequence(s)
            e.step([Feed(s, toks, True)])
            return logits_row(e.lib, e.ctx, len(toks) - 1, e.n_vocab).astype(np.float64)
        finally:
            e.unload()

    base = logits(files["base"])
    merged = logits(files["merged_x"])
    lora = logits(files["base"], "x", lora=json.dumps({"x": str(files["x"])}))
    assert np.abs(base - merged).max() > 1.0  # the adapter changes the model
    assert np.abs(lora - merged).max() < ATOL, np.abs(lora - merged).max()


def test_mixed_adapters_in_one_step_match_their_own_models(files):
    e = _engine(files["base"], lora=f"x={files['x']};y={files['y']}")
    try:
        assert e.info.extra["lora"]["x"]["alpha"] == "16.000000" or float(e.info.extra["lora"]["x"]["alpha"]) == 16
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
        adapters = [None, "x", "y", "x"]
        toks, tops = _run(e, prompts, adapters)
        assert e.adapters.switches >= 2
    finally:
        e.unload()
    refs = {None: files["base"], "x": files["merged_x"], "y": files["merged_y"]}
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        ref = _engine(refs[a])
        try:
            ref_toks, ref_tops = _run(ref, [p], [None])
        finally:
            ref.unload()
        assert toks[i] == ref_toks[0], (i, a)
        _close(tops[i], ref_tops[0])
    assert toks[0] != toks[1]  # same prompt, base vs adapter x


def test_unknown_adapter_and_bad_options(files):
    e = _engine(files["base"], lora=json.dumps({"x": str(files["x"])}))
    try:
        with pytest.raises(InvalidRequest, match="no LoRA adapter 'z'") as err:
            e.add_sequence(Sequence(1, [1, 2, 3], SamplingParams(adapter="z")))
        assert err.value.param == "model"
    finally:
        e.unload()
    plain = _engine(files["base"])
    try:
        with pytest.raises(InvalidRequest, match="has no LoRA adapters"):
            plain.add_sequence(Sequence(1, [1, 2, 3], SamplingParams(adapter="x")))
    finally:
        plain.unload()
    from octo.engines.llamacpp import LlamaCppEngine

    with pytest.raises(ConfigError, match="NAME=PATH"):
        LlamaCppEngine(EngineConfig(options={"lora": "justaname"}))
    e = LlamaCppEngine(EngineConfig(options={"lora": "x=/nonexistent/a.gguf"}))
    with pytest.raises(ConfigError, match="file not found"):
        e.load(str(files["base"]), "m")
    e = LlamaCppEngine(EngineConfig(options={"lora": f"x={files['merged_x']}"}))  # a model, not an adapter
    with pytest.raises(ConfigError, match="could not be loaded"):
        e.load(str(files["base"]), "m")


def test_engines_without_lora_refuse_the_option():
    from octo.engines.onnx import OnnxEngine

    with pytest.raises(ConfigError, match="onnx"):
        OnnxEngine(EngineConfig(options={"lora": "x=/a"}))


# -- models file, --lora and routing ---------------------------------------------------------------------------------
def test_models_file_lora(tmp_path):
    from octo.runtime.specs import load_models_file

    f = tmp_path / "models.yaml"
    f.write_text("models:\n  - model: demo\n    engine: llamacpp\n    lora: {x: /a/x.gguf, y: /a/y.gguf}\n  - tiny\n")
    specs = load_models_file(str(f))
    assert specs[0].lora == {"x": "/a/x.gguf", "y": "/a/y.gguf"} and specs[1].lora == {}
    f.write_text("- model: demo\n  lora: {'a:b': /x}\n")
    with pytest.raises(ConfigError, match="without ':'"):
        load_models_file(str(f))
    f.write_text("- model: demo\n  lora: [x]\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_models_file(str(f))


async def test_registry_routes_base_colon_adapter():
    from octo.config import ServerConfig
    from octo.runtime.registry import Registry
    from octo.runtime.specs import ModelSpec

    reg = Registry(ServerConfig(), {})

    class H:
        name, aliases, engine_name, task = "base", ("base-alias",), "llamacpp", "chat"

    slot = reg.adopt(H(), spec=ModelSpec("base", "llamacpp", lora={"x": "/x.gguf"}))
    assert reg.find("base:x") is slot and reg.find("base-alias:x") is slot
    assert reg.find("base:y") is None
    with pytest.raises(ModelNotFound, match="no LoRA adapter 'y'.*base:x"):
        await reg.route("base:y")
    opts = reg.config_for(slot.spec).options
    assert json.loads(opts["lora"]) == {"x": "/x.gguf"}


def test_serving_picks_the_adapter_from_the_model_name():
    from octo.serving.openai import lora_adapter

    class E:
        adapters = {"x": object()}

    class H:
        engine = E()

    assert lora_adapter(H(), "base:x") == "x"
    assert lora_adapter(H(), "base:4bit") is None and lora_adapter(H(), "base") is None
    H.engine = object()
    assert lora_adapter(H(), "base:x") is None


# -- MLX (mlx-lm adapter folders) ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlx_files():
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")
    from octo.engines.mlx import MLXEngine

    from octo.synth.lora import build_merged_hf
    from octo.synth.mlx import build_mlx

    if not MLXEngine.detect().available:
        pytest.skip(f"MLX cannot run here: {MLXEngine.detect().reason}")
    return {"base": build_mlx(SHAPE), "x": build_mlx_lora(SHAPE, 0, LORA_X), "y": build_mlx_lora(SHAPE, 0, LORA_Y),
            "merged_x": build_merged_hf(SHAPE, 0, LORA_X), "merged_y": build_merged_hf(SHAPE, 0, LORA_Y)}


def _mlx(path, **opts):
    from octo.engines.mlx import MLXEngine

    e = MLXEngine(EngineConfig(max_batch=4, options=opts))
    e.load(str(path), "m")
    return e


def test_mlx_adapter_equals_the_merged_model_in_a_mixed_batch(mlx_files):
    """Every row of one batched forward pass uses its own adapter (or none): each sequence's tokens and top-20
    logprobs (log-softmax of the logits) equal its own model's run alone, the merged models built independently."""
    e = _mlx(mlx_files["base"], lora=json.dumps({"x": str(mlx_files["x"]), "y": str(mlx_files["y"])}))
    try:
        assert e.info.extra["lora"]["x"]["rank"] == 8 and e.info.extra["lora"]["y"]["keys"] == [
            "mlp.down_proj", "mlp.gate_proj", "self_attn.k_proj"]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
        adapters = [None, "x", "y", "x"]
        toks, tops = _run(e, prompts, adapters)
        with pytest.raises(InvalidRequest, match="no LoRA adapter 'z'"):
            e.add_sequence(Sequence(9, [1, 2, 3], SamplingParams(adapter="z")))
    finally:
        e.unload()
    refs = {None: mlx_files["base"], "x": mlx_files["merged_x"], "y": mlx_files["merged_y"]}
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        ref = _mlx(refs[a])
        try:
            ref_toks, ref_tops = _run(ref, [p], [None])
        finally:
            ref.unload()
        assert toks[i] == ref_toks[0], (i, a)
        _close(tops[i], ref_tops[0])
    assert toks[0] != toks[1]


def test_mlx_lora_option_errors(mlx_files, tmp_path):
    from octo.engines.mlx import MLXEngine

    with pytest.raises(ConfigError, match="adapter names"):
        MLXEngine(EngineConfig(options={"lora": "a:b=/x"}))
    e = MLXEngine(EngineConfig(options={"lora": f"x={tmp_path}"}))
    with pytest.raises(ConfigError, match="not an mlx-lm adapter folder"):
        e.load(str(mlx_files["base"]), "m")


def test_kv_full_in_a_later_adapter_group_takes_back_the_earlier_groups(files):
    """A mixed step is one llama_decode per adapter; when a later one finds the shared pool full (KVCacheFull:
    "nothing was consumed"), the tokens the earlier groups added leave the KV again, so the scheduler's preemption and
    retry see the state it had before the step."""
    from octo.errors import KVCacheFull

    e = _engine(files["base"], max_batch=2, n_ctx="256", kv_cells="256", cache_seqs="0", lora=f"x={files['x']}")
    try:
        a = Sequence(1, e.tokenize(PROMPTS[0] * 20)[:200], SamplingParams(temperature=0.0, adapter="x"))
        b = Sequence(2, e.tokenize(PROMPTS[1] * 20)[:60], SamplingParams(temperature=0.0))
        e.add_sequence(a)
        e.add_sequence(b)  # admitted while the pool is empty
        first = e.step([Feed(a, list(a.tokens), True)])[0]
        a.tokens.append(first)
        assert e.kv_cells == 256 and e.kv_room() == 256 - 200
        with pytest.raises(KVCacheFull):
            e.step([Feed(a, [first], True), Feed(b, list(b.tokens), True)])
        assert a.n_cached == 200 and b.n_cached == 0 and e.kv_room() == 256 - 200
        alone = e.step([Feed(a, [first], True)])[0]  # the retry (after b was preempted) goes on where a was
        ref = _engine(files["merged_x"], max_batch=1, n_ctx="256")
        try:
            r = Sequence(1, a.tokens[:200], SamplingParams(temperature=0.0))
            ref.add_sequence(r)
            assert ref.step([Feed(r, list(r.tokens), True)])[0] == first
            r.tokens.append(first)
            assert ref.step([Feed(r, [first], True)])[0] == alone
        finally:
            ref.unload()
    finally:
        e.unload()
