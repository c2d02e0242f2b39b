"""Build a synthetic Hugging Face-format model: config, fixed-seed random safetensors weights, tokenizer.

Weights are generated tensor by tensor and streamed into ``model.safetensors``, so peak memory is about one
tensor (the embedding), even for the real shapes. Each tensor has its own generator derived from ``(seed,
name)``, so a tensor's values do not depend on the order in which tensors are written.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from octo.paths import synth_dir
from octo.synth.folder import build_folder
from octo.synth.spec import TOKENIZER_VOCAB, ModelSpec, get_spec
from octo.synth.tokenizer import write_tokenizer_files

DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
INIT_STD = 0.02
EMBED_STD = 0.02
LOGIT_STD = 4.0


def default_dir(spec: ModelSpec | str, seed: int = 0, dtype: str = "float32") -> Path:
    return synth_dir() / f"{get_spec(spec).cache_name}-s{seed}-{dtype}" / "hf"


def tensor_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes, in file order."""
    h, f, kv = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim
    yield "model.embed_tokens.weight", (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        if spec.attention_bias:
            yield p + "self_attn.q_proj.bias", (h,)
            yield p + "self_attn.k_proj.bias", (kv,)
            yield p + "self_attn.v_proj.bias", (kv,)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (f, h)
        yield p + "mlp.up_proj.weight", (f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, h)


def make_tensor(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic float32 values for one tensor.

    Projections are normal(0, 1/sqrt(fan_in)), so every layer adds O(1) to the residual stream (which stays
    far inside float16 range); biases are normal(0, 0.02); layer norm weights are 1. Embedding rows are
    normal(0, 0.02), small next to the layer outputs so that greedy decoding does not just repeat the last
    token (tied lm_head); rows past the tokenizer are zero (logit 0). The final norm weight is set so that
    logits have a std of about LOGIT_STD: peaked enough that the unused rows keep ~1% of the probability
    mass at temperature 1 even with a 151936-row vocab, and greedy top-1 margins are wide enough for
    fp16/quantized engines to agree.
    """
    if name == "model.norm.weight":
        return np.full(shape, LOGIT_STD / (EMBED_STD * np.sqrt(shape[0])), dtype=np.float32)
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("bias"):
        std = INIT_STD
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        a = rng.standard_normal((min(shape[0], TOKENIZER_VOCAB), shape[1]), dtype=np.float32)
        a *= np.float32(EMBED_STD)
        if shape[0] > TOKENIZER_VOCAB:
            a = np.concatenate([a, np.zeros((shape[0] - TOKENIZER_VOCAB, shape[1]), np.float32)])
        return a
    else:
        std = 1.0 / np.sqrt(shape[1])
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= np.float32(std)
    return a


def _cast(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "float32":
        return a.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return a.astype("<f2").tobytes()
    # bfloat16: round-to-nearest-even on the top 16 bits of the float32 pattern (inputs are finite).
    u = a.astype("<f4", copy=False).view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def write_safetensors(path: Path, spec: ModelSpec, seed: int, dtype: str) -> None:
    """Stream the weights into a safetensors file (header first, then one tensor at a time)."""
    itemsize = 4 if dtype == "float32" else 2
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    shapes = list(tensor_shapes(spec))
    for name, shape in shapes:
        n = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in shapes:
            t = make_tensor(name, shape, seed)
            if _quiet(spec, name):
                t *= np.float32(spec.quiet_scale)
            f.write(_cast(t, dtype))


def _quiet(spec: ModelSpec, name: str) -> bool:
    if spec.quiet_from is None or not name.startswith("model.layers."):
        return False
    layer = int(name.split(".")[2])
    return layer >= spec.quiet_from and name.endswith(("o_proj.weight", "down_proj.weight"))


def hf_config(spec: ModelSpec, dtype: str, ids: dict[str, int]) -> dict:
    qwen = spec.arch == "qwen2"
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": dtype,
        "dtype": dtype,
        "octo_synthetic": {"shape": spec.name, "dtype": dtype},
    }
    if qwen:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_hidden_layers)
    else:
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return cfg


def build_hf(spec: ModelSpec | str, seed: int = 0, out: Path | None = None, dtype: str = "float32") -> Path:
    """Build (or reuse) the synthetic HF folder for ``spec``; returns its path.

    Default folder: ``octo.paths.synth_dir() / f"{spec.cache_name}-s{seed}-{dtype}" / "hf"``. A finished build
    holds a ``.complete`` marker; builds go to a temporary sibling folder that is renamed into place when
    done.
    """
    spec = get_spec(spec)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    out = Path(out) if out is not None else default_dir(spec, seed, dtype)

    def write(tmp: Path) -> dict:
        ids = write_tokenizer_files(tmp, spec.max_position_embeddings)
        (tmp / "config.json").write_text(json.dumps(hf_config(spec, dtype, ids), indent=2) + "\n")
        gen = {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": False,
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        write_safetensors(tmp / "model.safetensors", spec, seed, dtype)
        return {"shape": spec.name, "seed": seed, "dtype": dtype}

    return build_folder(out, write)
