"""Build synthetic GGUF models (llama.cpp's format) from the synthetic Hugging Face build.

The HF folder from :func:`octo.synth.hf.build_hf` is converted the way llama.cpp's ``convert_hf_to_gguf.py``
converts a real Qwen2 / Llama checkpoint: the same GGUF tensor names (through the ``gguf`` package's name map),
Llama's Q/K row permutation for its interleaved RoPE, the byte-level BPE vocabulary with its merges, the
``qwen2`` pre-tokenizer, special-token ids and the chat template. F32 / F16 files are written here; Q8_0 and
Q4_K_M go through llama.cpp's own quantiser (``llama_model_quantize``, needs llama-cpp-python).

Files are cached next to the HF build: ``synth_dir()/<shape>-s<seed>-float32/gguf/<shape>-<ftype>.gguf``, written
to a temporary sibling under the file's lock and renamed into place (``octo.atomic.build_file``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from pathlib import Path

import numpy as np

from octo.atomic import build_file
from octo.synth.hf import build_hf
from octo.synth.spec import ModelSpec, get_spec

VERSION = 1
FTYPES = ("f32", "f16", "q8_0", "q4_k_m")
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3}


def default_path(spec: ModelSpec | str, seed: int = 0, ftype: str = "f16", pooling: str | None = None) -> Path:
    spec = get_spec(spec)
    tag = f"-emb{pooling}" if pooling else ""
    return build_dir(spec, seed) / f"{spec.name}{tag}-{ftype}.gguf"


def build_dir(spec: ModelSpec, seed: int) -> Path:
    from octo.synth.hf import default_dir

    return default_dir(spec, seed, "float32").parent / f"gguf-v{VERSION}"


def build_gguf(
    spec: ModelSpec | str,
    seed: int = 0,
    ftype: str = "f16",
    out: Path | None = None,
    pooling: str | None = None,
    threads: int = 0,
) -> Path:
    """Build (or reuse) a synthetic GGUF; returns its path.

    ``ftype``: ``f32``, ``f16``, ``q8_0`` or ``q4_k_m``. ``pooling`` (``mean``, ``cls``, ``last``) marks the file
    as an embedding model (``<arch>.pooling_type``), like gte-Qwen2 / Qwen3-Embedding GGUFs.
    """
    spec = get_spec(spec)
    ftype = ftype.lower()
    if ftype not in FTYPES:
        raise ValueError(f"unsupported GGUF type {ftype!r}; expected one of {', '.join(FTYPES)}")
    if pooling is not None and pooling not in POOLING:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLING)}")
    out = Path(out) if out is not None else default_path(spec, seed, ftype, pooling)
    if out.exists():
        return out
    if ftype in ("f32", "f16"):
        hf = build_hf(spec, seed, dtype="float32")
        return build_file(out, lambda tmp: convert_hf(hf, spec, tmp, ftype, pooling))
    src = build_gguf(spec, seed, "f16", pooling=pooling)
    return build_file(out, lambda tmp: quantize(src, tmp, ftype, threads))


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF's rotate-half Q/K rows -> llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(hf: Path, vocab_size: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    import gguf

    tok = json.loads((hf / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special[added["content"]] = added["id"]
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # rows past the tokenizer are padding, as convert_hf_to_gguf writes them
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges, special


def quiet_gguf_writer() -> None:
    """The gguf package logs its writer's file list at INFO: a synthetic model's build is not news to a user."""
    logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)


def convert_hf(hf: Path, spec: ModelSpec, out: Path, ftype: str, pooling: str | None = None) -> None:
    import gguf
    from safetensors import safe_open

    cfg = json.loads((hf / "config.json").read_text())
    tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}[spec.arch]
    name_map = gguf.get_tensor_name_map(arch, spec.num_hidden_layers)
    quiet_gguf_writer()
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"octo synthetic {spec.name}{' embedding' if pooling else ''}")
    w.add_type("model")
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_hidden_layers)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_attention_heads)
    w.add_head_count_kv(spec.num_key_value_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if ftype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    if pooling:
        w.add_pooling_type(gguf.PoolingType(POOLING[pooling]))
    tokens, types, merges, special = _vocab(hf, spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the synthetic tokenizer uses Qwen2's pre-tokenizer regex for every arch
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if tok_cfg.get("pad_token") in special:
        w.add_pad_token_id(special[tok_cfg["pad_token"]])
    w.add_add_bos_token(bool(tok_cfg.get("bos_token")) and tok_cfg.get("add_bos_token", False))
    w.add_chat_template(tok_cfg["chat_template"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    st = safe_open(str(hf / "model.safetensors"), framework="np")
    plan = []
    for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {key}")
        shape = tuple(st.get_slice(key).get_shape())
        dtype = np.float16 if ftype == "f16" and len(shape) == 2 else np.float32
        plan.append((key, name, shape, np.dtype(dtype)))
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for key, _name, _shape, dtype in plan:
        t = st.get_tensor(key).astype(np.float32, copy=False)
        if spec.arch == "llama" and key.endswith("q_proj.weight"):
            t = permute(t, spec.num_attention_heads)
        elif spec.arch == "llama" and key.endswith("k_proj.weight"):
            t = permute(t, spec.num_key_value_heads)
        w.write_tensor_data(np.ascontiguousarray(t.astype(dtype)))
    w.close()


def quantize(src: Path, out: Path, ftype: str, threads: int = 0) -> None:
    """Quantise with llama.cpp's own quantiser (``llama_model_quantize``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[ftype]
    params.nthread = threads or (os.cpu_count() or 1)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {ftype}) failed with code {rc}")
