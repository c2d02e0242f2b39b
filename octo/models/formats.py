"""Model file formats: what a local path or a hub repository's file list holds, and for which variant.

Formats: ``gguf`` (llama.cpp), ``mlx`` (a Hugging Face format folder, config.json + *.safetensors, which
mlx-lm loads), ``onnx`` (an onnxruntime-genai folder with genai_config.json), ``whisper`` (an
openai-whisper .pt checkpoint), ``ct2`` (a CTranslate2 Whisper folder: model.bin + config.json, for faster-whisper),
``ggml`` (a whisper.cpp model file).
"""

from __future__ import annotations

import json
import posixpath
import re
import struct
from pathlib import Path

from octo.errors import ModelNotFound

# Files mlx-lm needs from a Hugging Face format folder (the patterns mlx-lm's own loader downloads).
MLX_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
ONNX_PATTERNS = (
    "*.json",
    "*.onnx",
    "*.onnx.data",
    "*.onnx_data",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
)
FILE_FORMATS = {".gguf": "gguf", ".pt": "whisper", ".bin": "ggml"}
GGML_MAGIC = b"lmgg"  # whisper.cpp's 0x67676d6c, little-endian
CT2_PATTERNS = ("*.json", "model.bin", "vocabulary*")
# Our variant names -> GGUF quantisation tags, in order of preference.
_GGUF_TAGS = {
    "4bit": ("q4_k_m", "q4_0", "q4_k_s", "iq4_xs", "q4_1"),
    "8bit": ("q8_0",),
    "fp16": ("f16", "fp16"),
    "bf16": ("bf16",),
    "fp32": ("f32",),
}
_GGUF_DEFAULT = ("q4_k_m", "q4_0", "q8_0")
_ONNX_TAGS = {"4bit": "int4", "8bit": "int8"}
_EMBED_ARCHS = {
    "bert",
    "nomic-bert",
    "nomic-bert-moe",
    "jina-bert-v2",
    "jina-bert-v3",
    "modern-bert",
    "t5encoder",
    "neo-bert",
}
EXPECTED = (
    "expected a .gguf file, a whisper .pt checkpoint or whisper.cpp ggml .bin, a CTranslate2 Whisper folder, "
    "an MLX / Hugging Face folder (config.json + "
    "*.safetensors) or an onnxruntime-genai folder (genai_config.json)"
)


def inspect_path(path: Path) -> tuple[str, str, int | None]:
    """(format, task, context length) of a local model file or folder; ModelNotFound if unsupported."""
    if path.is_file():
        try:
            with path.open("rb") as f:
                head = f.read(4)
        except OSError as exc:  # unreadable (permissions, /proc/self/mem): not a model this server can load
            raise ModelNotFound(f"'{path}' cannot be read: {exc.strerror or exc}.", param="model") from None
        if head == b"GGUF":
            meta = gguf_metadata(path)
            arch = meta.get("general.architecture")
            embed = arch in _EMBED_ARCHS or f"{arch}.pooling_type" in meta
            return "gguf", "embeddings" if embed else "chat", meta.get(f"{arch}.context_length")
        if path.suffix.lower() == ".pt" and (head == b"PK\x03\x04" or head[:1] == b"\x80"):
            return "whisper", "transcription", None
        if head == GGML_MAGIC:
            return "ggml", "transcription", None
        named = {".gguf": "GGUF file (it does not start with GGUF's magic bytes)",
                 ".pt": "whisper .pt checkpoint (not a PyTorch file)",
                 ".bin": "whisper.cpp ggml file (it does not start with ggml's magic bytes)"}.get(path.suffix.lower())
        if named:
            raise ModelNotFound(f"'{path}' is named {path.suffix} but is not a {named}: a damaged or partial "
                                "download, or another kind of file.", param="model")
        raise ModelNotFound(f"'{path}' is not a supported model file: {EXPECTED}.", param="model")
    if (path / "genai_config.json").is_file():
        cfg = _read_json(path / "genai_config.json")
        return "onnx", "chat", _int((cfg.get("model") or {}).get("context_length"))
    if (path / "model.bin").is_file() and "suppress_ids_begin" in _read_json(path / "config.json"):
        return "ct2", "transcription", None  # a CTranslate2 Whisper folder (faster-whisper)
    if (path / "config.json").is_file() and _read_json(path / "config.json").get("model_type") == "whisper":
        return "whisper", "transcription", None  # a transformers Whisper folder
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        cfg = _read_json(path / "config.json")
        ctx = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
        return "mlx", "chat", _int(ctx)
    nested = sorted(  # onnxruntime-genai repositories keep builds 1-3 levels down (cpu_and_mobile/cpu-int4-.../)
        str(p.parent.relative_to(path)) for depth in (1, 2, 3) for p in path.glob("*/" * depth + "genai_config.json")
    )
    if nested:
        raise ModelNotFound(
            f"'{path}' holds onnxruntime-genai models in subfolders; pass one of: "
            f"{', '.join(str(path / n) for n in nested)}.",
            param="model",
        )
    raise ModelNotFound(f"'{path}' is not a supported model folder: {EXPECTED}.", param="model")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def gguf_metadata(path: Path, max_keys: int = 64) -> dict:
    """The scalar and string key/values at the start of a GGUF header (arrays skipped); {} if unreadable.

    Stops at the tokenizer keys, so the big vocabulary arrays are not read.
    """
    meta: dict = {}
    try:
        with path.open("rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version < 2:
                return meta
            _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

            def string() -> str:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 1 << 20:  # no header string is that long: a corrupt or hostile file
                    raise ValueError(f"GGUF string of {n} bytes")
                return f.read(n).decode("utf-8", "replace")

            def skip(kind: int) -> None:
                if kind == 8:
                    f.seek(struct.unpack("<Q", f.read(8))[0], 1)
                elif kind == 9:
                    sub, count = struct.unpack("<IQ", f.read(12))
                    if sub in _GGUF_SCALARS:
                        f.seek(struct.calcsize(_GGUF_SCALARS[sub]) * count, 1)
                    else:
                        for _ in range(count):
                            skip(sub)
                else:
                    f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)

            for _ in range(min(n_kv, max_keys)):
                key = string()
                if key.startswith("tokenizer.") and "general.architecture" in meta:
                    break  # the architecture block is done; the tokenizer arrays are big
                (kind,) = struct.unpack("<I", f.read(4))
                if kind == 8:
                    meta[key] = string()
                elif kind in _GGUF_SCALARS:
                    size = struct.calcsize(_GGUF_SCALARS[kind])
                    meta[key] = struct.unpack(_GGUF_SCALARS[kind], f.read(size))[0]
                else:
                    skip(kind)
    except (OSError, struct.error, KeyError, UnicodeDecodeError, ValueError, OverflowError, MemoryError):
        pass
    return meta


def gguf_tag(filename: str) -> str | None:
    """The quantisation tag of a GGUF file name (``Llama-3.2-1B-Instruct-Q4_K_M.gguf`` -> ``Q4_K_M``)."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", posixpath.basename(filename)[: -len(".gguf")])
    last = re.split(r"[-.]", stem)[-1]
    return last if re.fullmatch(r"(?i)(i?q\d\w*|b?f16|f32|fp16|tq\d_\d)", last) else None


def detect_repo(repo: str, files: list[str], variant: str | None) -> dict[str, dict]:
    """Artifacts (format -> Artifact fields) a repository's file list offers for ``variant``."""
    found: dict[str, dict] = {}
    known: list[str] = []  # the variants the repository offers, for the error
    want = variant.lower() if variant else None
    ggufs = _gguf_repo(repo, files, want, found, known)
    onnx_dirs = _onnx_repo(repo, files, want, found, known)
    if "config.json" in files and any("/" not in f and f.endswith(".safetensors") for f in files):
        if not want or want in repo.lower():
            found["mlx"] = {"uri": f"hf://{repo}", "allow_patterns": MLX_PATTERNS}
    pts = _whisper_repo(repo, files, want, found, known)
    speech = _speech_repo(repo, files, want)
    found.update(speech)
    if not found:
        if not (ggufs or onnx_dirs or pts or "config.json" in files):
            raise ModelNotFound(
                f"Hugging Face repository '{repo}' has no supported model files: {EXPECTED}.", param="model"
            )
        raise ModelNotFound(
            f"Repository '{repo}' has no variant '{variant}'"
            + (f"; known variants: {', '.join(known)}." if known else "."),
            param="model",
        )
    return found


def _gguf_repo(repo: str, files: list[str], want: str | None, found: dict[str, dict], known: list[str]) -> list[str]:
    """The repository's GGUF file for ``want`` into ``found`` (its quantisation tags into ``known``); its GGUF files.
    Several files and no variant, several matching files or a split model: an error that says so."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in posixpath.basename(f).lower()]
    if not ggufs:
        return ggufs
    tags = {f: (gguf_tag(f) or "").lower() for f in ggufs}
    known += sorted({gguf_tag(f) for f in ggufs if gguf_tag(f)}, key=str.lower)
    order = _GGUF_TAGS.get(want, (want,)) if want else _GGUF_DEFAULT
    picked = next(([f for f in ggufs if tags[f] == t] for t in order if any(tags[f] == t for f in ggufs)), [])
    if not picked and not want and len(ggufs) == 1:
        picked = ggufs
    if not picked and not want:
        raise ModelNotFound(
            f"Repository '{repo}' holds several GGUF files; choose one with '{repo}:VARIANT'. "
            f"Known variants: {', '.join(known) or ', '.join(ggufs)}.",
            param="model",
        )
    if len(picked) > 1:
        shards = all(re.search(r"-\d{5}-of-\d{5}\.gguf$", f) for f in picked)
        raise ModelNotFound(
            f"Repository '{repo}': "
            + (
                "split GGUF files are not supported (merge them with llama-gguf-split --merge): "
                if shards
                else "several files match: "
            )
            + ", ".join(picked),
            param="model",
        )
    if picked:
        found["gguf"] = {"uri": f"hf://{repo}/{picked[0]}"}
        projector = best_mmproj(files, picked[0])
        if projector is not None:
            found["gguf"]["mmproj"] = f"hf://{repo}/{projector}"
    return ggufs


def best_mmproj(files: list[str], model: str) -> str | None:
    """The projector (``mmproj*.gguf``) beside ``model`` in its repository that llama-server's ``-hf`` picks: in the
    same folder, the quantisation closest in bits to the model's (``Q4_K_M`` takes a ``Q8_0`` projector before an
    ``f16`` one); None when there is none."""
    folder = posixpath.dirname(model)
    found = [f for f in files if f.lower().endswith(".gguf") and "mmproj" in posixpath.basename(f).lower()
             and posixpath.dirname(f) == folder]
    bits = _quant_bits(model)
    return min(found, key=lambda f: abs(_quant_bits(f) - bits), default=None)


def _quant_bits(filename: str) -> int:
    """The bits of a GGUF file name's quantisation (llama.cpp's ``extract_quant_bits``: the first number of its tag,
    ``Q4_K_M`` 4, ``f16`` 16; 0 without one)."""
    m = re.search(r"\d+", gguf_tag(filename) or "")
    return int(m.group()) if m else 0


def _onnx_repo(repo: str, files: list[str], want: str | None, found: dict[str, dict], known: list[str]) -> list[str]:
    """The repository's ONNX Runtime GenAI folder for ``want`` (a CPU one first) into ``found``; its folders."""
    onnx_dirs = sorted({posixpath.dirname(f) for f in files if posixpath.basename(f) == "genai_config.json"})
    if onnx_dirs:
        known += [d for d in onnx_dirs if d]
        token = _ONNX_TAGS.get(want, want) if want else None
        dirs = sorted(
            (d for d in onnx_dirs if not want or token in d.lower() or token in repo.lower()),
            key=lambda d: ("cpu" not in d.lower(), d),
        )
        if dirs:
            sub = dirs[0]
            patterns = (f"{sub}/*",) if sub else ONNX_PATTERNS
            found["onnx"] = {"uri": f"hf://{repo}", "subfolder": sub or None, "allow_patterns": patterns}
    return onnx_dirs


def _whisper_repo(repo: str, files: list[str], want: str | None, found: dict[str, dict], known: list[str]
                  ) -> list[str]:
    """The repository's whisper checkpoint (``.pt``) for ``want`` into ``found``; its checkpoints."""
    pts = [  # whisper checkpoints, not any pickled tensor file (optimizer.pt, training_args.pt, ...)
        f
        for f in files
        if "/" not in f
        and f.lower().endswith(".pt")
        and ("whisper" in repo.lower() or re.match(r"(?i)(tiny|base|small|medium|large|turbo)\b", f))
    ]
    if pts:
        picked = [f for f in pts if want in f.lower()] if want else pts
        if len(picked) == 1:
            found["whisper"] = {"uri": f"hf://{repo}/{picked[0]}"}
        elif len(picked) > 1:
            known += pts
    return pts


def _speech_repo(repo: str, files: list[str], want: str | None) -> dict[str, dict]:
    """A CTranslate2 Whisper repository (Systran/faster-whisper-*) and whisper.cpp ggml files."""
    found: dict[str, dict] = {}
    if "model.bin" in files and "config.json" in files and "whisper" in repo.lower():
        found["ct2"] = {"uri": f"hf://{repo}", "allow_patterns": CT2_PATTERNS}
    ggml = [f for f in files if "/" not in f and re.fullmatch(r"(?i)ggml-.+\.bin", f) and "encoder" not in f]
    if ggml:
        picked = [f for f in ggml if want and f.lower().removesuffix(".bin").endswith(want)] if want else ggml
        if len(picked) == 1:
            found["ggml"] = {"uri": f"hf://{repo}/{picked[0]}"}
    return found
