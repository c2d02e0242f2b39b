"""A synthetic Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2.5-VL's vision tower (a ViT with 2D RoPE,
window attention and full-attention blocks, SwiGLU, RMSNorm), its patch merger (2x2 patches to one image token) and a
Qwen2.5 text model positioned with M-RoPE (an image's tokens take 2D positions: rows and columns of its patch grid),
tiny, with fixed-seed random weights.

The Hugging Face folder holds what Qwen's checkpoints hold, in their tensor layout (``visual.*``, ``model.*``):
``config.json`` (the flat layout of Qwen/Qwen2.5-VL-3B-Instruct: ``rope_scaling`` with ``mrope_section``, a
``vision_config`` with ``fullatt_block_indexes``), ``model.safetensors``, the chat template of Qwen2.5-VL and the
processor's configs (``Qwen2VLImageProcessor``). The tokenizer is the byte-level BPE every synthetic model shares
(:mod:`octo.synth.tokenizer`: Qwen2's pre-tokenizer, trained here) with Qwen2.5-VL's vision tokens added
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ...). llama.cpp's converter recognises a BPE
pre-tokenizer by a hash of the ids it gives a test string, which only the published vocabularies match, so the
conversion is told ``qwen2`` (:func:`octo.synth.convert.convert`'s ``pre``), the label :mod:`octo.synth.gguf` writes
for the same tokenizer.

Weights come from numpy generators seeded by ``(seed, tensor name)``: projections normal(0, 1/sqrt(fan_in)), biases
and token embeddings normal(0, 0.02), RMS norms 1, the final norm scaled so that logits have a std of about 4 (as
:mod:`octo.synth.hf`). The merger's output (an image token's embedding) is at unit scale, larger than the token
embeddings, so greedy output depends on the image.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from octo.paths import synth_dir
from octo.synth.folder import build_folder

VERSION = 1
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
VOCAB = 4160  # the shared tokenizer's 4096 tokens and the vision tokens, padded to a multiple of 64
EMBED_STD = 0.02
LOGIT_STD = 4.0
PATCH, MERGE, TEMPORAL = 14, 2, 2

# Qwen/Qwen2.5-VL-3B-Instruct's chat_template.json
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class QwenVLSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2 (temporal, height, width)
    max_position_embeddings: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_depth: int
    vision_heads: int
    fullatt_block_indexes: tuple[int, ...]  # the others attend within windows of window_size pixels (llama.cpp's
    # converter maps the merger's layers 0 and 2 by block number: 3 blocks at least)
    window_size: int = 112


def default_dir(spec: QwenVLSpec, seed: int = 0) -> Path:
    return synth_dir() / f"{spec.name}-s{seed}" / f"hf-v{VERSION}"


def build_qwen_vl_hf(spec: QwenVLSpec, seed: int = 0, out: Path | None = None) -> Path:
    """Build (or reuse) the synthetic Hugging Face folder (needs torch and transformers, for the tensor names)."""
    out = Path(out) if out is not None else default_dir(spec, seed)

    def write(tmp: Path) -> dict:
        ids = _write_tokenizer(tmp, spec)
        _write_model(tmp, spec, seed, ids)
        return {"shape": spec.name, "seed": seed, "spec": asdict(spec)}

    return build_folder(out, write)


def token_ids() -> dict[str, int]:
    """The special tokens' ids: the shared tokenizer's, then the vision tokens after its vocabulary."""
    from octo.synth.tokenizer import load_tokenizer, special_ids

    base = load_tokenizer().get_vocab_size()
    return {**special_ids(), **{t: base + i for i, t in enumerate(VISION_TOKENS)}}


def hf_config(spec: QwenVLSpec) -> dict:
    ids = token_ids()
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "hidden_act": "silu", "hidden_size": spec.hidden_size,
        "initializer_range": 0.02, "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings, "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads, "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": spec.max_position_embeddings, "tie_word_embeddings": True, "use_cache": True,
        "use_sliding_window": False, "vocab_size": VOCAB,
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
        "vision_config": {
            "depth": spec.vision_depth, "hidden_act": "silu", "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size, "num_heads": spec.vision_heads, "in_chans": 3,
            "out_hidden_size": spec.hidden_size, "patch_size": PATCH, "spatial_merge_size": MERGE,
            "spatial_patch_size": PATCH, "window_size": spec.window_size,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes), "tokens_per_second": 2,
            "temporal_patch_size": TEMPORAL,
        },
        "octo_synthetic": {"shape": spec.name},
    }


def weight(name: str, shape: tuple[int, ...], seed: int, hidden: int) -> np.ndarray:
    """Deterministic float32 values of one tensor (the checkpoint's names)."""
    if name == "model.norm.weight":
        return np.full(shape, LOGIT_STD / (EMBED_STD * np.sqrt(hidden)), dtype=np.float32)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("bias") or name == "model.embed_tokens.weight":
        std = EMBED_STD
    else:  # a linear layer (out, in) or the patch convolution (out, channels, t, p, p)
        std = 1.0 / np.sqrt(int(np.prod(shape[1:])))
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def checkpoint_tensors(spec: QwenVLSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(the checkpoint's name, shape) of every tensor Qwen2.5-VL's files hold, from transformers' own model (its
    names mapped back to the published layout; the tied ``lm_head`` is not written, as in the 3B's files)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**{k: v for k, v in hf_config(spec).items() if k != "octo_synthetic"})
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    out = []
    for name, tensor in model.state_dict().items():
        if name.startswith("model.visual."):
            out.append(("visual." + name[len("model.visual."):], tuple(tensor.shape)))
        elif name.startswith("model.language_model."):
            out.append(("model." + name[len("model.language_model."):], tuple(tensor.shape)))
    return out


def _write_model(folder: Path, spec: QwenVLSpec, seed: int, ids: dict[str, int]) -> None:
    from safetensors.numpy import save_file

    tensors = {name: weight(name, shape, seed, spec.hidden_size) for name, shape in checkpoint_tensors(spec)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**hf_config(spec), "torch_dtype": "float32"}, indent=2) + "\n")
    files = {
        "preprocessor_config.json": {
            "min_pixels": 3136, "max_pixels": 12845056, "patch_size": PATCH, "temporal_patch_size": TEMPORAL,
            "merge_size": MERGE, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        },
        "chat_template.json": {"chat_template": CHAT_TEMPLATE},
        "generation_config.json": {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
                                   "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": False},
    }
    for fname, data in files.items():
        (folder / fname).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_tokenizer(folder: Path, spec: QwenVLSpec) -> dict[str, int]:
    """tokenizer.json (the shared tokenizer with the vision tokens added), tokenizer_config.json (Qwen2.5-VL's)."""
    from tokenizers import AddedToken

    from octo.synth.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok = type(tok).from_str(tok.to_str())  # a copy: the shared one is cached
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    ids = token_ids()
    if any(tok.token_to_id(t) != i for t, i in ids.items()) or max(ids.values()) >= VOCAB:
        raise RuntimeError("the vision tokens did not get the ids expected after the shared tokenizer's")
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for t, i in ids.items()}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS], "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
        "model_max_length": spec.max_position_embeddings, "processor_class": "Qwen2_5_VLProcessor",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return ids
