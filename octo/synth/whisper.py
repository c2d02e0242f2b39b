"""Synthetic Whisper checkpoints in openai-whisper's own ``.pt`` format, random weights from a fixed seed.

The file is what ``whisper.load_model(path)`` reads: ``torch.save({"dims": {...}, "model_state_dict": {...}})``
with ``dims`` a plain dict of :class:`whisper.model.ModelDimensions` fields (as in OpenAI's published
checkpoints, which also store the weights as float16). Shapes:

- ``tiny`` / ``tiny.en``: the real whisper-tiny dimensions (39 M parameters), for benchmarks;
- ``base``: the real whisper-base dimensions (74 M parameters), for the engine comparison;
- ``test`` / ``test.en``: a small model for tests. Whisper fixes some dimensions: 80 mel bins, an audio
  context of 1500 frames (30 s of audio after the stride-2 convolution) and the tokenizer's vocabulary
  (51865 multilingual, 51864 English-only); only widths, heads and layers shrink.

Random weights produce random text; callers bound decoding (the engine's ``max_new_tokens`` option).

The *steady* variant (``steady=True``) keeps the same random encoder but makes the decoder's output depend on the
position only, so every engine decodes the same tokens, confidently, until its token cap (see :func:`steady`).
"""

from __future__ import annotations

from pathlib import Path

from octo.atomic import build_file
from octo.paths import synth_dir

_BASE = dict(n_mels=80, n_audio_ctx=1500, n_text_ctx=448)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        _BASE,
        n_vocab=51865,
        n_audio_state=384,
        n_audio_head=6,
        n_audio_layer=4,
        n_text_state=384,
        n_text_head=6,
        n_text_layer=4,
    ),
    "test": dict(
        _BASE,
        n_vocab=51865,
        n_audio_state=64,
        n_audio_head=2,
        n_audio_layer=2,
        n_text_state=64,
        n_text_head=2,
        n_text_layer=2,
    ),
}
SHAPES["base"] = dict(SHAPES["tiny"], n_audio_state=512, n_audio_head=8, n_audio_layer=6, n_text_state=512,
                      n_text_head=8, n_text_layer=6)
SHAPES["tiny.en"] = dict(SHAPES["tiny"], n_vocab=51864)
# the speech engines' test shape: whisper.cpp takes a 2-layer decoder for a distilled model (no timestamps)
SHAPES["test3"] = dict(SHAPES["test"], n_text_layer=3)
SHAPES["test.en"] = dict(SHAPES["test"], n_vocab=51864)


def synth_root(shape: str, seed: int = 0, steady: bool = False) -> Path:
    """The folder holding every format of one synthetic Whisper."""
    return synth_dir() / f"whisper-{shape}-s{seed}{'-steady' if steady else ''}"


def default_path(shape: str, seed: int = 0, steady: bool = False) -> Path:
    return synth_root(shape, seed, steady) / "whisper" / "model.pt"


def parse_name(name: str) -> tuple[str, bool]:
    """``whisper-SHAPE[-steady]`` (a synthetic model's name) -> (shape, steady)."""
    shape = name.removeprefix("whisper-")
    return (shape.removesuffix("-steady"), True) if shape.endswith("-steady") else (shape, False)


def build_whisper(shape: str = "test", seed: int = 0, out: str | Path | None = None, steady: bool = False) -> Path:
    """Build (or reuse) the checkpoint for ``shape`` and ``seed`` (the steady variant with ``steady``)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown whisper shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    path = Path(out) if out is not None else default_path(shape, seed, steady)
    if path.is_file():
        return path
    return build_file(path, lambda tmp: _write_checkpoint(tmp, shape, seed, steady))


# -- the steady variant ------------------------------------------------------------------------------------
STEADY_GAIN = 4.0  # positional embedding = STEADY_GAIN x the token embedding of the position's token
STEADY_LOGIT_STD = 4.0  # std of a random token's logit (the token embedding is scaled to it)
STEADY_RESIDUAL = 0.01  # the decoder blocks' output projections are scaled by this
STEADY_LENGTH = 200  # tokens a window decodes: <|0.00|> and 199 words, then <|endoftext|>


def steady_tokens(n_vocab: int, n_text_ctx: int, seed: int = 0) -> list[int]:
    """The token the steady decoder emits at each position: ``tokens[p]`` is the argmax of the logits computed at
    position ``p``. After the start-of-transcript prompt (3 tokens; 1 for English-only) come ``<|0.00|>``, then
    ``STEADY_LENGTH - 1`` distinct ordinary words (a space and 3+ ASCII letters, none of OpenAI's suppressed
    tokens, chosen from ``seed``), then ``<|endoftext|>``: a window decodes ``STEADY_LENGTH`` tokens, fewer
    than every engine's cap (224 for openai-whisper and faster-whisper, 220 for whisper.cpp)."""
    import random
    import re

    from whisper.tokenizer import get_tokenizer

    multilingual = n_vocab >= 51865
    tok = get_tokenizer(multilingual, num_languages=n_vocab - 51765 - int(multilingual))
    suppressed = set(tok.non_speech_tokens)
    word = re.compile(r" [a-z]{3,}")
    words = [i for i in range(tok.eot) if i not in suppressed and word.fullmatch(tok.decode([i]))]
    out = random.Random(seed).sample(words, n_text_ctx)
    first = len(tok.sot_sequence) - 1  # the position whose logits give the first sampled token
    out[first] = tok.timestamp_begin
    out[first + STEADY_LENGTH] = tok.eot
    return out


def steady_transcript(n_vocab: int, n_text_ctx: int, seed: int = 0) -> list[int]:
    """The tokens a steady model's first window decodes (without a prompt): ``<|0.00|>`` and the words."""
    first = 2 if n_vocab >= 51865 else 0
    return steady_tokens(n_vocab, n_text_ctx, seed)[first:first + STEADY_LENGTH]


def steady(state: dict, dims: dict, seed: int) -> None:
    """Make the decoder of ``state`` (float tensors, openai names) emit :func:`steady_tokens` with certainty.

    The blocks' output projections (self-attention, cross-attention, MLP) shrink by ``STEADY_RESIDUAL``: they
    still compute (attention over the audio included) but barely move the residual stream, which stays
    ``E[x] + P[p]``. With ``P[p] = g * E[t_p]`` (``g`` = ``STEADY_GAIN``) and the tied output projection, the
    logit of ``t_p`` is about ``sqrt(d) * STEADY_LOGIT_STD`` (31 at d=64, 88 at d=512), a random token's is
    ``N(0, STEADY_LOGIT_STD)`` (seed 0: ``t_p`` leads the next token by >= 4.9 logits at d=64, >= 52 at
    d=512): ``t_p`` wins on every runtime, log-probability ~0 (no fallback, never "no speech"; the words differ,
    so the compression ratio stays ~1.8). The end of text comes at a fixed position
    below every engine's per-window cap: each engine decodes the same ``STEADY_LENGTH`` tokens and ends the window
    the same way (a cap is no common ending: whisper.cpp fails a window that reaches its cap without a timestamp,
    or with ``max_tokens`` closes it with a forced timestamp, where openai-whisper keeps it)."""
    import torch

    d = dims["n_text_state"]
    emb = state["decoder.token_embedding.weight"]
    emb = emb * (STEADY_LOGIT_STD / d**0.5 / emb.float().std())
    state["decoder.token_embedding.weight"] = emb
    t = torch.tensor(steady_tokens(dims["n_vocab"], dims["n_text_ctx"], seed))
    state["decoder.positional_embedding"] = STEADY_GAIN * emb[t]
    for name in list(state):
        if name.startswith("decoder.blocks.") and name.endswith(("attn.out.weight", "attn.out.bias",
                                                                  "mlp.2.weight", "mlp.2.bias")):
            state[name] = state[name] * STEADY_RESIDUAL


def _write_checkpoint(tmp: Path, shape: str, seed: int, steady_variant: bool = False) -> None:
    import torch
    from whisper.model import ModelDimensions, Whisper

    dims = ModelDimensions(**SHAPES[shape])
    gen = torch.Generator().manual_seed(seed)
    model = Whisper(dims)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "encoder.positional_embedding":  # fixed sinusoids, as in the real model
            value = tensor
        elif name.endswith(("ln.weight", "ln_post.weight")):
            value = 1.0 + 0.02 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith(".bias"):
            value = 0.02 * torch.randn(tensor.shape, generator=gen)
        else:  # weights: small normal, scaled by fan-in so activations stay O(1)
            fan_in = tensor[0].numel() if tensor.dim() > 1 else tensor.numel()
            std = 0.02 if "embedding" in name else fan_in**-0.5
            value = std * torch.randn(tensor.shape, generator=gen)
        state[name] = value
    if steady_variant:
        steady(state, dims.__dict__, seed)
    state = {name: value.to(torch.float16).contiguous() for name, value in state.items()}
    with open(tmp, "wb") as f:
        torch.save({"dims": dims.__dict__.copy(), "model_state_dict": state}, f)


# -- speech for tests and benchmarks ---------------------------------------------------------------
AUDIO_CODECS = {  # container -> ffmpeg output arguments
    "wav": [],
    "mp3": ["-c:a", "libmp3lame", "-q:a", "4"],
    "m4a": ["-c:a", "aac", "-b:a", "64k"],  # moov atom at the end: ffmpeg must seek to read it
    "ogg": ["-c:a", "libvorbis"],
    "flac": ["-c:a", "flac"],
    "webm": ["-c:a", "libopus"],
}


def speech(text: str, out: str | Path, voice: str = "en", speed: int = 160) -> Path:
    """A WAV file of ``text`` spoken by espeak-ng (22.05 kHz mono); needs ``espeak-ng`` on PATH."""
    import subprocess

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(out), text], check=True, capture_output=True)
    return out


def encode(src: str | Path, fmt: str, out: str | Path | None = None) -> Path:
    """``src`` re-encoded by ffmpeg into container ``fmt`` (one of :data:`AUDIO_CODECS`)."""
    import subprocess

    src = Path(src)
    out = Path(out) if out is not None else src.with_suffix("." + fmt)
    if out.resolve() == src.resolve():
        raise ValueError(f"encode: {src} is already a .{fmt} file; give another output path")
    subprocess.run(
        ["ffmpeg", "-y", "-nostdin", "-loglevel", "error", "-i", str(src), *AUDIO_CODECS[fmt], str(out)],
        check=True,
        capture_output=True,
    )
    return out


# -- the same weights in Hugging Face transformers layout (openai/whisper-* on the hub) -------------
_TO_HF = [
    ("encoder.positional_embedding", "encoder.embed_positions.weight"),
    ("decoder.positional_embedding", "decoder.embed_positions.weight"),
    ("decoder.token_embedding.", "decoder.embed_tokens."),
    ("encoder.ln_post.", "encoder.layer_norm."),
    ("decoder.ln.", "decoder.layer_norm."),
    (".blocks.", ".layers."),
    (".attn_ln.", ".self_attn_layer_norm."),
    (".cross_attn_ln.", ".encoder_attn_layer_norm."),
    (".attn.", ".self_attn."),
    (".cross_attn.", ".encoder_attn."),
    (".mlp_ln.", ".final_layer_norm."),
    (".mlp.0.", ".fc1."),
    (".mlp.2.", ".fc2."),
    (".query.", ".q_proj."),
    (".key.", ".k_proj."),
    (".value.", ".v_proj."),
    (".out.", ".out_proj."),
]


def hf_name(name: str) -> str:
    for a, b in _TO_HF:
        name = name.replace(a, b)
    return "model." + name


def build_whisper_hf(shape: str = "test", seed: int = 0, out: str | Path | None = None, steady: bool = False) -> Path:
    """The checkpoint of :func:`build_whisper` as a transformers folder (config.json + model.safetensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder = Path(out) if out is not None else synth_root(shape, seed, steady) / "hf"
    if (folder / "model.safetensors").is_file():
        return folder
    ckpt = torch.load(build_whisper(shape, seed, steady=steady), map_location="cpu", weights_only=True)
    d = ckpt["dims"]
    tensors = {hf_name(k): v.contiguous() for k, v in ckpt["model_state_dict"].items()}
    multilingual = d["n_vocab"] >= 51865
    eot = 50257 if multilingual else 50256
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "d_model": d["n_audio_state"],
        "encoder_layers": d["n_audio_layer"],
        "encoder_attention_heads": d["n_audio_head"],
        "decoder_layers": d["n_text_layer"],
        "decoder_attention_heads": d["n_text_head"],
        "encoder_ffn_dim": 4 * d["n_audio_state"],
        "decoder_ffn_dim": 4 * d["n_text_state"],
        "num_mel_bins": d["n_mels"],
        "max_source_positions": d["n_audio_ctx"],
        "max_target_positions": d["n_text_ctx"],
        "vocab_size": d["n_vocab"],
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
        "pad_token_id": eot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "decoder_start_token_id": eot + 1,
    }
    heads = [
        [layer, head] for layer in range(d["n_text_layer"] // 2, d["n_text_layer"]) for head in range(d["n_text_head"])
    ]

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"alignment_heads": heads}, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    build_file(folder, write, done=lambda p: (p / "model.safetensors").is_file())
    return folder


def voiced_clip(out: str | Path, seconds: float = 3.0) -> Path:
    """A WAV file (16 kHz mono, 16-bit) of voiced tones with a syllable rhythm: a stand-in for speech that needs no
    tool (with ``demo-whisper``, any sound gives the same transcript)."""
    import wave

    import numpy as np

    t = np.arange(int(seconds * 16000)) / 16000.0
    voice = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((140.0, 280.0, 420.0, 700.0, 1100.0), 1))
    x = 0.1 * voice * 0.5 * (1 + np.sin(2 * np.pi * 3.0 * t))
    out = Path(out)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return out


def main(argv: list[str]) -> int:
    """``python -m octo.synth.whisper OUT.wav [TEXT]``: a clip to transcribe, TEXT spoken by espeak-ng when it is
    installed, else voiced tones (:func:`voiced_clip`)."""
    import shutil

    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    out, text = argv[0], " ".join(argv[1:]) or "The old lighthouse stood at the edge of the harbor."
    if shutil.which("espeak-ng"):
        speech(text, out)
        print(f"{out}: '{text}' spoken by espeak-ng")
    else:
        voiced_clip(out)
        print(f"{out}: 3 seconds of voiced tones (espeak-ng is not installed to speak '{text}')")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
