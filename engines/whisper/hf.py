"""Load a Hugging Face ``transformers`` Whisper folder (``openai/whisper-*``) as an openai-whisper model.

OpenAI publishes its original ``.pt`` checkpoints only on its own CDN; on the Hugging Face Hub the same
weights live in ``transformers`` layout (``config.json`` + ``model.safetensors``). The layouts differ only
in parameter names, so such folders (``octo serve openai/whisper-base``, fine-tuned models) load by
renaming, with the alignment heads from ``generation_config.json`` (used for word timestamps).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# transformers name (without the "model." prefix) -> openai-whisper name
_PARTS = [
    (r"^encoder\.embed_positions\.weight$", "encoder.positional_embedding"),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"\.layers\.", ".blocks."),
    (r"\.self_attn\.", ".attn."),
    (r"\.encoder_attn\.", ".cross_attn."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.fc1\.", ".mlp.0."),
    (r"\.fc2\.", ".mlp.2."),
    (r"\.q_proj\.", ".query."),
    (r"\.k_proj\.", ".key."),
    (r"\.v_proj\.", ".value."),
    (r"\.out_proj\.", ".out."),
]
_PATTERNS = [(re.compile(a), b) for a, b in _PARTS]

DIMS_FROM_CONFIG = {
    "n_mels": "num_mel_bins",
    "n_audio_ctx": "max_source_positions",
    "n_audio_state": "d_model",
    "n_audio_head": "encoder_attention_heads",
    "n_audio_layer": "encoder_layers",
    "n_vocab": "vocab_size",
    "n_text_ctx": "max_target_positions",
    "n_text_state": "d_model",
    "n_text_head": "decoder_attention_heads",
    "n_text_layer": "decoder_layers",
}


def is_hf_whisper(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "whisper"
    except (OSError, ValueError):
        return False


def rename(name: str) -> str | None:
    """The openai-whisper name of a transformers parameter; None for ``proj_out`` (tied to the embedding)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("proj_out."):
        return None
    for pattern, repl in _PATTERNS:
        name = pattern.sub(repl, name)
    return name


def load_hf_folder(path: Path) -> tuple[dict, dict, list[list[int]] | None]:
    """``(dims, state_dict, alignment_heads)`` of a transformers Whisper folder."""
    import torch

    config = json.loads((path / "config.json").read_text())
    dims = {k: int(config[v]) for k, v in DIMS_FROM_CONFIG.items()}
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        raw = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        raw = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor pytorch_model.bin")
    state = {}
    for name, tensor in raw.items():
        new = rename(name)
        if new is not None:
            state[new] = tensor
    heads = None
    gen = path / "generation_config.json"
    if gen.is_file():
        heads = json.loads(gen.read_text()).get("alignment_heads")
    return dims, state, heads
