"""A synthetic vision-language model: Gemma 3 (``Gemma3ForConditionalGeneration``: a SigLIP vision tower, Gemma 3's
multi-modal projector, Gemma 3's text model), tiny, with fixed-seed random weights.

The Hugging Face folder is what a real Gemma 3 checkpoint holds: ``config.json``, ``model.safetensors`` written by
transformers (its own tensor names), a SentencePiece ``tokenizer.model`` (BPE with byte fallback, trained here on the
synthetic corpus of :mod:`octo.synth.tokenizer`, with Gemma's special tokens: ``<bos>``, ``<eos>``,
``<start_of_turn>``, ``<end_of_turn>``, ``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``), Gemma 3's
chat template and the processor's configs (``Gemma3ImageProcessor``, ``Gemma3Processor``). The GGUF files are
written by llama.cpp's own converter (:mod:`octo.synth.convert`): the model, and with ``--mmproj`` the projector,
as users download them (``<name>-f16.gguf`` and ``mmproj-<name>-f16.gguf``, side by side in one folder).

Weights come from numpy generators seeded by ``(seed, tensor name)`` (the values do not depend on torch's
initialisation): projections normal(0, 1/sqrt(fan_in)), Gemma's RMS norms 0 (a scale of 1; the final norm scales the
logits to a std of about 4, as :mod:`octo.synth.hf` does; the norms after attention and MLP 0.5), SigLIP's layer
norms 1 and 0. An image's embeddings enter the text model at unit scale, larger than the token embeddings, so greedy
output depends on the image (a random Gemma 3 soon repeats one token, a different one for a different image).
"""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from octo.paths import synth_dir
from octo.synth.folder import COMPLETE, build_folder
from octo.synth.qwen_vl import QwenVLSpec

VERSION = 2  # 2: the vocabulary size at the top of config.json and the image tokens in text_config (mlx-lm, mlx-vlm)
SPECIALS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
VOCAB = 4096
EMBED_STD = 0.02  # x sqrt(hidden_size) (Gemma scales token embeddings): 0.32
POST_NORM = 0.5  # the scale of each layer's normed attention and MLP outputs (Gemma's norms after them)
LOGIT_STD = 4.0

# google/gemma-3-4b-it's chat template
CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)


@dataclass(frozen=True)
class VisionSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # llama.cpp runs Gemma 3 with every 6th layer global, the rest in a sliding window
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    max_position_embeddings: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_layers: int
    vision_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int  # (image_size / patch_size)**2 patches average-pooled to this many


SHAPES: dict[str, VisionSpec | QwenVLSpec] = {s.name: s for s in (
    VisionSpec("demo-vision", 256, 512, 6, 4, 1, 64, 512, 4096, 128, 256, 2, 4, 64, 8, 16),
    # a Qwen2.5-VL (octo.synth.qwen_vl): M-RoPE positions, a ViT of 14-pixel patches merged 2x2 into image tokens
    QwenVLSpec("demo-vision-qwen", 256, 512, 4, 4, 2, (8, 12, 12), 4096, 128, 256, 4, 4, (1, 3)),
    # bench/vision.py's: a ViT large enough that an encode takes a good part of a second on a CPU (not in the catalog)
    QwenVLSpec("vision-bench", 512, 1376, 6, 8, 2, (8, 12, 12), 8192, 512, 1024, 8, 8, (3, 7)),
)}


def get_vision_spec(name: str) -> VisionSpec | QwenVLSpec:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown synthetic vision model {name!r}; known: {', '.join(SHAPES)}") from None


def default_dir(spec: VisionSpec, seed: int = 0) -> Path:
    return synth_dir() / f"{spec.name}-s{seed}" / f"hf-v{VERSION}"


def gguf_paths(spec: VisionSpec | QwenVLSpec | str, seed: int = 0, ftype: str = "f16") -> tuple[Path, Path]:
    """The model GGUF and its projector (``mmproj-*``), side by side in one folder."""
    spec = get_vision_spec(spec) if isinstance(spec, str) else spec
    folder = synth_dir() / f"{spec.name}-s{seed}" / f"gguf-v{VERSION}-{ftype}"
    return folder / f"{spec.name}-{ftype}.gguf", folder / f"mmproj-{spec.name}-{ftype}.gguf"


def build_vision_gguf(name: str = "demo-vision", seed: int = 0, ftype: str = "f16") -> Path:
    """Build (or reuse) the model GGUF and its projector with llama.cpp's converter; returns the model's path (the
    projector is beside it)."""
    from octo.synth.convert import convert

    spec = get_vision_spec(name)
    model, proj = gguf_paths(spec, seed, ftype)
    folder = model.parent
    if (folder / COMPLETE).exists():
        return model
    hf = build_vision_hf(name, seed)

    def write(tmp: Path) -> dict:
        convert(hf, tmp / model.name, ftype, pre="qwen2" if isinstance(spec, QwenVLSpec) else None)
        convert(hf, tmp / proj.name, ftype, mmproj=True)
        from octo.synth.convert import llama_cpp_version

        return {"shape": spec.name, "seed": seed, "ftype": ftype, "converter": f"llama.cpp of llama-cpp-python "
                f"{llama_cpp_version()}"}

    build_folder(folder, write)
    return model


def build_vision_hf(name: str = "demo-vision", seed: int = 0, out: Path | None = None) -> Path:
    """Build (or reuse) the synthetic Hugging Face folder (needs torch, transformers and sentencepiece)."""
    spec = get_vision_spec(name)
    if isinstance(spec, QwenVLSpec):
        from octo.synth.qwen_vl import build_qwen_vl_hf

        return build_qwen_vl_hf(spec, seed, out)
    out = Path(out) if out is not None else default_dir(spec, seed)

    def write(tmp: Path) -> dict:
        (tmp / "tokenizer.model").write_bytes(train_tokenizer(seed))
        _write_model(tmp, spec, seed)
        _write_configs(tmp, spec)
        return {"shape": spec.name, "seed": seed, "spec": asdict(spec)}

    return build_folder(out, write)


def train_tokenizer(seed: int = 0) -> bytes:
    """A SentencePiece BPE model (Gemma's kind: byte fallback, ids 0-3 pad, eos, bos, unk; the special tokens next),
    trained deterministically on the synthetic corpus."""
    import sentencepiece as spm

    from octo.synth.tokenizer import corpus

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed)), model_writer=buf, vocab_size=VOCAB, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=list(SPECIALS), byte_fallback=True, character_coverage=1.0,
        num_threads=1, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, max_sentence_length=100000,
        minloglevel=2)
    return buf.getvalue()


def hf_config(spec: VisionSpec) -> dict:
    n = spec.num_hidden_layers
    ids = {t: 4 + i for i, t in enumerate(SPECIALS)}
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"], "mm_tokens_per_image": spec.mm_tokens_per_image,
        "eos_token_id": [1, ids["<end_of_turn>"]], "initializer_range": 0.02, "tie_word_embeddings": True,
        # mlx-lm and mlx-vlm read these two where they default to Gemma 3's own values (262208 tokens, 256 per image);
        # transformers and llama.cpp read text_config's vocabulary and the top level's image tokens
        "vocab_size": VOCAB,
        "text_config": {
            "model_type": "gemma3_text", "vocab_size": VOCAB, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": n,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim, "query_pre_attn_scalar": spec.head_dim, "sliding_window": spec.sliding_window,
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
            "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6,
            "mm_tokens_per_image": spec.mm_tokens_per_image,
            "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size, "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads, "image_size": spec.image_size, "patch_size": spec.patch_size,
            "layer_norm_eps": 1e-6, "vision_use_head": False, "hidden_act": "gelu_pytorch_tanh",
        },
        "octo_synthetic": {"shape": spec.name},
    }


def weight(name: str, shape: tuple[int, ...], seed: int, hidden: int) -> np.ndarray:
    """Deterministic float32 values of one tensor of ``Gemma3ForConditionalGeneration`` (transformers' names)."""
    if name.endswith("language_model.norm.weight"):  # Gemma's norms scale by 1 + weight
        return np.full(shape, LOGIT_STD / (EMBED_STD * np.sqrt(hidden)) - 1.0, dtype=np.float32)
    if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
        return np.full(shape, POST_NORM - 1.0, dtype=np.float32)
    if "language_model" in name and name.endswith("norm.weight") or name.endswith("mm_soft_emb_norm.weight"):
        return np.zeros(shape, dtype=np.float32)
    if "vision_tower" in name and ("layer_norm" in name or "post_layernorm" in name):
        return (np.ones if name.endswith("weight") else np.zeros)(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("bias") or name.endswith(("embed_tokens.weight", "lm_head.weight", "position_embedding.weight")):
        std = EMBED_STD
    elif name.endswith("mm_input_projection_weight"):  # used as x @ W: its rows are the inputs
        std = 1.0 / np.sqrt(shape[0])
    else:  # a linear layer (out, in) or the patch convolution (out, channels, p, p)
        std = 1.0 / np.sqrt(int(np.prod(shape[1:])))
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


# transformers 5's parameter names -> the names of Gemma 3's published checkpoints (transformers 4.50's layout), which
# llama.cpp's converter maps and transformers still loads
_CHECKPOINT_NAMES = (("model.language_model.", "language_model.model."),
                     ("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector."))


def checkpoint_tensors(spec: VisionSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(transformers' parameter name, the checkpoint's name, shape) of every tensor a checkpoint holds (the tied
    ``lm_head`` is not written, as in Gemma 3's own files)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(**{k: v for k, v in hf_config(spec).items() if k != "octo_synthetic"})
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    out = []
    for name, tensor in model.state_dict().items():
        for new, old in _CHECKPOINT_NAMES:
            if name.startswith(new):
                out.append((name, old + name[len(new):], tuple(tensor.shape)))
                break
    return out


def _write_model(folder: Path, spec: VisionSpec, seed: int) -> None:
    from safetensors.numpy import save_file

    tensors = {ckpt: weight(name, shape, seed, spec.hidden_size) for name, ckpt, shape in checkpoint_tensors(spec)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**hf_config(spec), "dtype": "float32"}, indent=2) + "\n")


def _write_configs(folder: Path, spec: VisionSpec) -> None:
    ids = {t: 4 + i for i, t in enumerate(SPECIALS)}
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
               "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    decoder = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                        "single_word": False}
               for t, i in {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **ids}.items()}
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
            "added_tokens_decoder": decoder, "chat_template": CHAT_TEMPLATE, "model_max_length":
                spec.max_position_embeddings, "spaces_between_special_tokens": False, "clean_up_tokenization_spaces":
                False, "processor_class": "Gemma3Processor", "sp_model_kwargs": {}, **special,
            "extra_special_tokens": {k: special[k] for k in ("boi_token", "eoi_token", "image_token")},
        },
        "special_tokens_map.json": {k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token",
                                                            "boi_token", "eoi_token", "image_token")},
        "preprocessor_config.json": {
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_resize": True, "size": {"height": spec.image_size, "width": spec.image_size}, "resample": 2,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": None, "do_pan_and_scan": None,
            "image_seq_length": spec.mm_tokens_per_image,
        },
        "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": spec.mm_tokens_per_image},
        "chat_template.json": {"chat_template": CHAT_TEMPLATE},
        "generation_config.json": {"bos_token_id": 2, "eos_token_id": [1, ids["<end_of_turn>"]], "pad_token_id": 0,
                                   "do_sample": False},
    }
    for fname, data in files.items():
        (folder / fname).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
