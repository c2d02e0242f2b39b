"""Synthetic model base: shapes, tokenizer, and the Hugging Face-format build."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from octo.synth import SHAPES, ModelSpec, build_hf, get_spec
from octo.synth.hf import tensor_shapes
from octo.synth.spec import TOKENIZER_VOCAB
from octo.synth.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, load_tokenizer, train

TEXTS = [
    "Hello, world! The engine serves tokens.",
    "Café naïve Zürich — Привет, мир. 你好，世界。 こんにちは 🙂🚀👍🏽",
    "line one\nline two\r\n\n\n  indented\ttab   trailing  ",
    "it's I'M we'll they've 1234567 3.14159 $19.99 ...!!?",
    "def f(x):\n    return {'a': [x, x * 2]}\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("octo-home")
        mp.setenv("OCTO_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny(home) -> Path:
    return build_hf("tiny")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_shapes():
    assert {"tiny", "demo", "qwen2.5-0.5b", "llama-3.2-1b"} <= set(SHAPES)
    qwen, llama = get_spec("qwen2.5-0.5b"), get_spec("llama-3.2-1b")
    # Same parameter counts as the real checkpoints.
    assert qwen.num_parameters() == 494_032_768 and qwen.head_dim == 64
    assert llama.num_parameters() == 1_235_814_400 and llama.head_dim == 64
    assert get_spec(qwen) is qwen
    with pytest.raises(ValueError, match="known shapes: tiny, demo"):
        get_spec("nope")
    with pytest.raises(ValueError):
        ModelSpec("bad", "gpt2", 64, 128, 1, 4, 2, TOKENIZER_VOCAB, 128, 1e4, 1e-6, True)


def test_config(tiny):
    spec = get_spec("tiny")
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert cfg[field] == getattr(spec, field), field
    ids = {t: load_tokenizer().token_to_id(t) for t in SPECIAL_TOKENS}
    assert ids == {"<|endoftext|>": 4093, "<|im_start|>": 4094, "<|im_end|>": 4095}
    assert cfg["eos_token_id"] == ids["<|im_end|>"] and cfg["torch_dtype"] == "float32"
    tcfg = json.loads((tiny / "tokenizer_config.json").read_text())
    assert (
        tcfg["bos_token"] is None
        and tcfg["eos_token"] == "<|im_end|>"
        and tcfg["pad_token"] == "<|endoftext|>"
    )
    assert tcfg["tokenizer_class"] == "Qwen2Tokenizer" and tcfg["chat_template"] == CHAT_TEMPLATE
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert (tiny / "special_tokens_map.json").exists() and (tiny / ".complete").exists()


def test_tensors(tiny):
    spec = get_spec("tiny")
    expected = dict(tensor_shapes(spec))
    with safe_open(str(tiny / "model.safetensors"), "np") as f:
        assert set(f.keys()) == set(expected)
        assert f.metadata() == {"format": "pt"}
        t = {k: f.get_tensor(k) for k in f.keys()}
    for k, shape in expected.items():
        assert t[k].shape == shape and t[k].dtype == np.float32 and np.isfinite(t[k]).all(), k
    assert "lm_head.weight" not in t  # tied
    assert t["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert t["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert (t["model.layers.0.input_layernorm.weight"] == 1).all()
    assert 0.015 < t["model.embed_tokens.weight"].std() < 0.025
    # Different tensors get different values (per-name generators).
    assert not np.array_equal(
        t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.up_proj.weight"]
    )


def test_determinism_and_seed(home, tiny, tmp_path):
    again = build_hf("tiny", out=tmp_path / "again")
    assert again == tmp_path / "again"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(again / name) == sha256(tiny / name), name
    other = build_hf("tiny", seed=1)
    assert other == home / "synth" / "tiny-s1-float32" / "hf"
    assert sha256(other / "model.safetensors") != sha256(tiny / "model.safetensors")


def test_cache_reuse_and_interrupted_build(tiny):
    model = tiny / "model.safetensors"
    before = model.stat().st_mtime_ns
    assert build_hf("tiny") == tiny
    assert model.stat().st_mtime_ns == before
    (tiny / ".complete").unlink()  # as if a build had been interrupted
    model.write_bytes(b"garbage")
    assert build_hf("tiny") == tiny
    assert (tiny / ".complete").exists() and model.stat().st_size > 1000
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_half_dtypes(home, tiny):
    with safe_open(str(tiny / "model.safetensors"), "np") as f:
        ref = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    f16 = build_hf("tiny", dtype="float16")
    with safe_open(str(f16 / "model.safetensors"), "np") as f:
        assert np.array_equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"), ref.astype(np.float16))
    bf16 = build_hf("tiny", dtype="bfloat16")
    header_len = int.from_bytes((bf16 / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((bf16 / "model.safetensors").read_bytes()[8 : 8 + header_len])
    entry = header["model.layers.0.mlp.down_proj.weight"]
    assert entry["dtype"] == "BF16"
    start, end = entry["data_offsets"]
    raw = (bf16 / "model.safetensors").read_bytes()[8 + header_len + start : 8 + header_len + end]
    back = (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").reshape(ref.shape)
    np.testing.assert_allclose(back, ref, rtol=2**-8)
    with pytest.raises(ValueError, match="unsupported dtype"):
        build_hf("tiny", dtype="int8")


def test_padded_vocab_rows_are_zero(home, tmp_path):
    spec = ModelSpec("padded", "llama", 64, 128, 1, 4, 2, TOKENIZER_VOCAB + 64, 256, 5e5, 1e-5, False)
    out = build_hf(spec, out=tmp_path / "padded")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == TOKENIZER_VOCAB + 64
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert "model.layers.0.self_attn.q_proj.bias" not in f.keys()
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = f.get_tensor(name)
            assert (w[TOKENIZER_VOCAB:] == 0).all() and (w[:TOKENIZER_VOCAB] != 0).any()


def test_tokenizer_roundtrip_and_determinism(home):
    tok = load_tokenizer()
    assert tok.get_vocab_size() == TOKENIZER_VOCAB
    for s in TEXTS:
        ids = tok.encode(s).ids
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.encode("<|im_start|>user").ids[0] == tok.token_to_id("<|im_start|>")
    assert len(tok.encode("The engine serves tokens in the morning.").ids) < 14  # real merges were learned
    assert train().to_str() == tok.to_str()


def render_chat(messages, add_generation_prompt=True):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


def test_chat_template():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render_chat(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(msgs[1:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_transformers_tokenizer_matches(tiny):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    ours = load_tokenizer()
    for s in TEXTS:
        assert hf.encode(s) == ours.encode(s).ids, s
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    msgs = [{"role": "user", "content": "Hello 🚀\nthere"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == render_chat(msgs)
    assert hf.encode(text) == ours.encode(text).ids


def test_transformers_model_loads(tiny):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        assert torch.equal(
            model.model.layers[1].mlp.down_proj.weight, f.get_tensor("model.layers.1.mlp.down_proj.weight")
        )
        assert torch.equal(model.lm_head.weight, f.get_tensor("model.embed_tokens.weight"))
    ids = torch.tensor([load_tokenizer().encode(render_chat([{"role": "user", "content": "Hi"}])).ids])
    with torch.no_grad():
        logits = model(ids).logits
        half = model.half()(ids).logits
    assert torch.isfinite(logits).all() and torch.isfinite(half).all()
    assert 2.0 < logits.std().item() < 8.0
    out = model.float().generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(set(out)) > 1  # greedy decoding does not collapse onto one token
