"""The synthetic Whisper checkpoint of :mod:`octo.synth.whisper` in the other speech engines' formats.

One set of random weights (``build_whisper(shape, seed)``), three files, so tests and benchmarks compare the
engines on the same model:

- ``faster-whisper``: a CTranslate2 folder (``model.bin`` + ``config.json`` + ``tokenizer.json``), made by
  ctranslate2's own Transformers converter from the transformers layout (``build_whisper_hf``) plus the
  Whisper tokenizer rebuilt from openai-whisper's tiktoken files;
- ``whispercpp``: a ggml ``.bin`` in whisper.cpp's legacy format (the layout of whisper.cpp's
  ``models/convert-pt-to-ggml.py``: hyper-parameters, mel filters, vocabulary, then every tensor with its
  shape reversed), written here with numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from octo.atomic import build_file
from octo.synth.whisper import synth_root

GGML_MAGIC = 0x67676D6C  # "ggml"
CT2_QUANTS = ("float32", "float16", "int8", "int8_float32", "int8_float16")
GGML_TYPES = ("f16", "f32")
# tensors whisper.cpp keeps in float32 in an f16 file (besides every 1-D tensor)
_GGML_F32 = {"encoder.conv1.bias", "encoder.conv2.bias", "encoder.positional_embedding", "decoder.positional_embedding"}


# -- the Whisper tokenizer as tokenizer.json (what faster-whisper and ct2's converter read) ------------
def whisper_tokenizer(multilingual: bool, out_dir: Path) -> None:
    """Write ``tokenizer.json`` (+ ``tokenizer_config.json``) of openai-whisper's tokenizer into ``out_dir``.

    Built from openai-whisper's own tiktoken file with transformers' TikTokenConverter, the special tokens
    (``<|endoftext|>``, languages, tasks, timestamps) appended in openai-whisper's id order."""
    import whisper
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from whisper.tokenizer import get_encoding

    name = "multilingual" if multilingual else "gpt2"
    enc = get_encoding(name, num_languages=99)
    vocab = os.path.join(os.path.dirname(whisper.__file__), "assets", f"{name}.tiktoken")
    tok = TikTokenConverter(vocab_file=vocab, pattern=enc._pat_str, extra_special_tokens=enc._special_tokens)
    tokenizer = tok.converted()
    for text, ident in enc._special_tokens.items():
        if tokenizer.token_to_id(text) != ident:
            raise RuntimeError(f"tokenizer: special token {text} got id {tokenizer.token_to_id(text)}, not {ident}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1024,
        "additional_special_tokens": [t for t in enc._special_tokens if not t.startswith("<|0") and "." not in t],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _generation_config(dims: dict) -> dict:
    """OpenAI's decoding setup for the transformers folder: suppressed tokens, languages, alignment heads."""
    from whisper.tokenizer import get_tokenizer

    multilingual = dims["n_vocab"] >= 51865
    tok = get_tokenizer(multilingual, num_languages=dims["n_vocab"] - 51765 - int(multilingual))
    lang_to_id = {f"<|{code}|>": tid for code, tid in zip(tok.all_language_codes, tok.all_language_tokens, strict=True)}
    suppress = sorted({*tok.non_speech_tokens, tok.transcribe, tok.translate, tok.sot, tok.sot_prev, tok.sot_lm,
                       tok.no_speech})
    heads = [[layer, head] for layer in range(dims["n_text_layer"] // 2, dims["n_text_layer"])
             for head in range(dims["n_text_head"])]
    return {
        "alignment_heads": heads,
        "begin_suppress_tokens": [220, tok.eot],
        "suppress_tokens": suppress,
        "lang_to_id": lang_to_id if multilingual else {},
        "is_multilingual": multilingual,
        "decoder_start_token_id": tok.sot,
        "eos_token_id": tok.eot,
        "pad_token_id": tok.eot,
        "bos_token_id": tok.eot,
        "no_timestamps_token_id": tok.no_timestamps,
    }


# -- CTranslate2 (faster-whisper) ----------------------------------------------------------------------
def ct2_path(shape: str, seed: int = 0, quantization: str = "float32", steady: bool = False) -> Path:
    return synth_root(shape, seed, steady) / f"ct2-{quantization}"


def build_whisper_ct2(shape: str = "test", seed: int = 0, quantization: str = "float32",
                      out: str | Path | None = None, steady: bool = False) -> Path:
    """The checkpoint of ``build_whisper(shape, seed, steady=steady)`` as a CTranslate2 folder, converted by
    ctranslate2's ``TransformersConverter`` (what ``ct2-transformers-converter`` runs) with ``quantization``."""
    if quantization not in CT2_QUANTS:
        raise ValueError(f"unknown CTranslate2 quantization {quantization!r}; known: {', '.join(CT2_QUANTS)}")
    from octo.synth.whisper import build_whisper_hf

    folder = Path(out) if out is not None else ct2_path(shape, seed, quantization, steady)
    hf = build_whisper_hf(shape, seed, steady=steady)

    def write(tmp: Path) -> None:
        from ctranslate2.converters import TransformersConverter

        stage = Path(str(tmp) + ".hf")
        shutil.copytree(hf, stage)
        try:
            dims = _dims_of(hf)
            gen = json.loads((stage / "generation_config.json").read_text())
            (stage / "generation_config.json").write_text(json.dumps({**gen, **_generation_config(dims)}, indent=1))
            whisper_tokenizer(dims["n_vocab"] >= 51865, stage)
            TransformersConverter(str(stage), copy_files=["tokenizer.json"], low_cpu_mem_usage=True).convert(
                str(tmp), quantization=quantization, force=True)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    return build_file(folder, write, done=lambda p: (p / "model.bin").is_file())


def _dims_of(hf: Path) -> dict:
    from octo.engines.whisper.hf import DIMS_FROM_CONFIG

    config = json.loads((hf / "config.json").read_text())
    return {k: int(config[v]) for k, v in DIMS_FROM_CONFIG.items()}


# -- ggml (whisper.cpp) -------------------------------------------------------------------------------
def ggml_path(shape: str, seed: int = 0, ftype: str = "f16", steady: bool = False) -> Path:
    return synth_root(shape, seed, steady) / f"ggml-{shape}-{ftype}.bin"


def build_whisper_ggml(shape: str = "test", seed: int = 0, ftype: str = "f16", out: str | Path | None = None,
                       steady: bool = False) -> Path:
    """The checkpoint of ``build_whisper(shape, seed, steady=steady)`` as a whisper.cpp ggml file (``f16`` or
    ``f32``)."""
    if ftype not in GGML_TYPES:
        raise ValueError(f"unknown ggml type {ftype!r}; known: {', '.join(GGML_TYPES)}")
    import torch

    from octo.synth.whisper import build_whisper

    path = Path(out) if out is not None else ggml_path(shape, seed, ftype, steady)
    ckpt = build_whisper(shape, seed, steady=steady)

    def write(tmp: Path) -> None:
        data = torch.load(ckpt, map_location="cpu", weights_only=True)
        state = {k: v.float().numpy() for k, v in data["model_state_dict"].items()}
        with open(tmp, "wb") as f:
            write_ggml(f, data["dims"], state, ftype)

    return build_file(path, write)


def write_ggml(f, dims: dict, state: dict, ftype: str = "f16") -> None:
    """Write a Whisper model (openai-whisper names, numpy arrays) in whisper.cpp's ggml layout to ``f``."""
    import numpy as np

    f16 = ftype == "f16"
    keys = ("n_vocab", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer", "n_text_ctx",
            "n_text_state", "n_text_head", "n_text_layer", "n_mels")
    f.write(struct.pack("<i", GGML_MAGIC))
    f.write(struct.pack("<" + "i" * (len(keys) + 1), *(int(dims[k]) for k in keys), int(f16)))
    filters = _mel_filters(int(dims["n_mels"]))
    f.write(struct.pack("<ii", *filters.shape))
    f.write(np.ascontiguousarray(filters, dtype="<f4").tobytes())
    tokens = _vocabulary(int(dims["n_vocab"]) >= 51865)
    f.write(struct.pack("<i", len(tokens)))
    for token in tokens:
        f.write(struct.pack("<i", len(token)))
        f.write(token)
    for name, value in state.items():
        data = np.asarray(value, dtype=np.float32).squeeze()
        if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
            data = data.reshape(data.shape[0], 1)
        half = f16 and data.ndim >= 2 and name not in _GGML_F32
        data = data.astype("<f2" if half else "<f4")
        raw = name.encode("utf-8")
        f.write(struct.pack("<iii", data.ndim, len(raw), 1 if half else 0))
        f.write(struct.pack("<" + "i" * data.ndim, *reversed(data.shape)))
        f.write(raw)
        f.write(np.ascontiguousarray(data).tobytes())


def _mel_filters(n_mels: int):
    import numpy as np
    import whisper

    with np.load(os.path.join(os.path.dirname(whisper.__file__), "assets", "mel_filters.npz")) as f:
        return f[f"mel_{n_mels}"]


def _vocabulary(multilingual: bool) -> list[bytes]:
    """The BPE tokens in rank order, from openai-whisper's tiktoken file (whisper.cpp adds the specials)."""
    import whisper
    from tiktoken.load import load_tiktoken_bpe

    name = "multilingual" if multilingual else "gpt2"
    ranks = load_tiktoken_bpe(os.path.join(os.path.dirname(whisper.__file__), "assets", f"{name}.tiktoken"))
    return [token for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
