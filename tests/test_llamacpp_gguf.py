"""The synthetic GGUF builder (octo.synth.gguf): llama.cpp computes the same function as the HF weights.

A float64 numpy forward pass of the Hugging Face model (RMSNorm, rotate-half RoPE, grouped-query attention,
SwiGLU) is compared with llama.cpp's logits on the converted F32 GGUF, for the qwen2 and llama architectures
(llama needs convert_hf_to_gguf's Q/K permutation; the llama spec here also has an untied LM head). Quantised
files load and keep the metadata; builds are cached.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.synth import ModelSpec, build_hf, get_spec  # noqa: E402
from octo.synth.gguf import build_gguf  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

TINY_LLAMA = ModelSpec("tiny-llama-untied", "llama", 64, 128, 2, 4, 2, 4160, 1024, 10000.0, 1e-5, False)


def reference_logits(spec: ModelSpec, tokens: list[int]) -> np.ndarray:
    from safetensors import safe_open

    st = safe_open(str(build_hf(spec) / "model.safetensors"), framework="np")

    def w(name):
        return st.get_tensor(name).astype(np.float64)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.rms_norm_eps) * g

    n, hd, nh, nkv = len(tokens), spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
    ang = np.arange(n)[:, None] * spec.rope_theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(q):  # HF rotate_half
        return q * cos + np.concatenate([-q[..., hd // 2 :], q[..., : hd // 2]], -1) * sin

    def proj(h, p, name):
        y = h @ w(f"{p}self_attn.{name}_proj.weight").T
        return y + w(f"{p}self_attn.{name}_proj.bias") if spec.attention_bias else y

    x = w("model.embed_tokens.weight")[tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = rope(proj(h, p, "q").reshape(n, nh, hd))
        k = np.repeat(rope(proj(h, p, "k").reshape(n, nkv, hd)), nh // nkv, axis=1)
        v = np.repeat(proj(h, p, "v").reshape(n, nkv, hd), nh // nkv, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", att, v).reshape(n, nh * hd) @ w(p + "self_attn.o_proj.weight").T
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        g = h @ w(p + "mlp.gate_proj.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w(p + "mlp.up_proj.weight").T)) @ w(p + "mlp.down_proj.weight").T
    x = rms(x, w("model.norm.weight"))
    head = w("model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")
    return x[-1] @ head.T


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, flash_attn=False, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[len(tokens) - 1], dtype=np.float64)
    finally:
        llm.close()


@pytest.mark.parametrize("spec", [get_spec("tiny"), TINY_LLAMA], ids=["qwen2", "llama-untied"])
def test_llama_cpp_computes_the_hf_model(spec):
    path = build_gguf(spec, ftype="f32")
    tokens = [12, 700, 33, 1900, 5, 48, 2222, 301, 64, 999, 3000, 7]
    ours, ref = llama_cpp_logits(path, tokens), reference_logits(spec, tokens)
    assert ours.shape == ref.shape == (spec.vocab_size,)
    # f32 weights, f16 KV cache: agreement to a small fraction of the logits' spread
    assert np.abs(ours - ref).max() < 0.02 * ref.std() + 1e-4
    assert np.corrcoef(ours, ref)[0, 1] > 0.9999


def test_metadata_tokenizer_and_template():
    spec = get_spec("tiny")
    r = gguf.GGUFReader(str(build_gguf(spec, ftype="f16")))
    f = r.fields

    def s(key):
        return bytes(f[key].parts[f[key].data[0]]).decode()

    assert s("general.architecture") == "qwen2"
    assert s("tokenizer.ggml.model") == "gpt2" and s("tokenizer.ggml.pre") == "qwen2"
    assert "<|im_start|>" in s("tokenizer.chat_template")
    assert int(f["qwen2.context_length"].parts[-1][0]) == spec.max_position_embeddings
    assert len(f["tokenizer.ggml.tokens"].data) == spec.vocab_size
    names = {t.name for t in r.tensors}
    assert {"token_embd.weight", "blk.1.attn_q.bias", "output_norm.weight"} <= names
    assert "output.weight" not in names  # tied embeddings, as convert_hf_to_gguf writes Qwen2.5-0.5B


@pytest.mark.parametrize("ftype,name", [("q8_0", "Q8_0"), ("q4_k_m", "Q4_K - Medium")])
def test_quantised_files_load(ftype, name):
    path = build_gguf("tiny", ftype=ftype)
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    try:
        assert llama_cpp.llama_ftype_name(llama_cpp.llama_model_ftype(model)).decode() == name
        assert path.stat().st_size < build_gguf("tiny", ftype="f16").stat().st_size
    finally:
        llama_cpp.llama_model_free(model)


def test_builds_are_cached():
    path = build_gguf("tiny", ftype="q8_0")
    mtime = path.stat().st_mtime_ns
    assert build_gguf("tiny", ftype="q8_0") == path and path.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="q3"):
        build_gguf("tiny", ftype="q3")
