"""What a model spec names, without the catalog: a local path or a Hugging Face id (``hf://org/repo[/file]``)
resolves here (:func:`resolve_direct`); a catalog name needs ``models.yaml`` (:mod:`octo.models.catalog`, whose
schema costs pydantic and yaml imports). :func:`resolve` takes the short way when it can, so that ``octo serve
./model.gguf`` hands the load to its engine worker before the gateway's heavier imports (the start-up's critical
path, bench/startup.py). Standard library and :mod:`octo.models.formats` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from octo.errors import ModelNotFound
from octo.models.formats import EXPECTED, FILE_FORMATS, detect_repo, inspect_path

VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A Hugging Face repository id as the hub allows it (huggingface_hub's validate_repo_id): two parts of letters, digits,
# '_', '.', '-', each starting and ending with a letter, digit or '_', no '--' or '..' anywhere. So '.', '..', 'a/..'
# and 'a/.b' are never ids, and an id never names a folder above another.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
HF_ID = re.compile(rf"^(?!.*(?:--|\.\.)){_PART}/{_PART}$")


def is_hf_id(name: str) -> bool:
    """Whether ``name`` is a Hugging Face id, ``org/name`` or ``org/name:VARIANT`` (decided from the text alone)."""
    head, sep, tail = name.rpartition(":")
    if sep and not VARIANT.match(tail):
        return False
    return len(name) <= 200 and HF_ID.match(head if sep else name) is not None


@dataclass(frozen=True)
class Artifact:
    engine: str  # engine name, e.g. "llamacpp", "mlx", "onnx", "whisper", "echo"
    uri: str  # "hf://org/repo/file.gguf", "hf://org/repo", "synth://demo", "https://...", or a local path
    format: str  # "gguf" | "mlx" | "onnx" | "whisper" | "synth" | "none"
    allow_patterns: tuple[str, ...] = ()
    subfolder: str | None = None  # e.g. onnxruntime-genai repos keep the model in a subfolder
    source: str | None = field(default=None, compare=False)  # the spec it came from (for `octo pull` hints)
    # a GGUF's projector (hf://org/repo/.../mmproj-*.gguf, beside the file in its repository): downloaded with it, so
    # the llama.cpp engine finds it beside the GGUF and the model takes images
    mmproj: str | None = None


@dataclass(frozen=True)
class Resolved:
    name: str  # the model name served and listed in /v1/models
    aliases: tuple[str, ...]  # other names a request's "model" field may use
    task: str  # "chat" | "embeddings" | "transcription"
    context_length: int | None
    variant: str | None
    artifacts: dict[str, Artifact]  # engine name -> artifact (only engines that have one)


# -- URIs ------------------------------------------------------------------------------------------
def uri_kind(uri: str) -> str:
    """``hf``, ``url``, ``synth``, ``none`` or ``path``."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    return {"hf": "hf", "http": "url", "https": "url", "synth": "synth", "none": "none"}.get(scheme, "path")


def parse_hf(uri: str) -> tuple[str, str | None]:
    """``hf://org/repo[/path/in/repo]`` -> (``org/repo``, path or None)."""
    parts = uri[len("hf://") :].strip("/").split("/") if uri.startswith("hf://") else []
    if len(parts) < 2 or not HF_ID.match(f"{parts[0]}/{parts[1]}") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"'{uri}' is not a Hugging Face URI (hf://org/repo or hf://org/repo/path/to/file)")
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:]) or None


def is_file_uri(uri: str) -> bool:
    kind = uri_kind(uri)
    if kind == "hf":
        return parse_hf(uri)[1] is not None
    return kind in ("url", "path") and Path(uri).suffix.lower() in FILE_FORMATS


def check_uri(uri: str) -> None:
    kind = uri_kind(uri)
    if kind == "hf":
        parse_hf(uri)
    elif kind == "synth" and not re.fullmatch(r"synth://[A-Za-z0-9][A-Za-z0-9._-]*", uri):
        raise ValueError(f"'{uri}' is not a synthetic model URI (synth://NAME)")
    elif kind == "url" and not re.match(r"https?://[^/]+/.+[^/]$", uri):
        raise ValueError(f"'{uri}' is not a file URL")
    elif kind == "path" and "://" in uri:
        raise ValueError(f"'{uri}': unknown scheme (use hf://, https://, synth:// or a local path)")


def split_variant(spec: str) -> tuple[str, str | None]:
    head, sep, tail = spec.rpartition(":")
    if not sep or "/" in tail or not head:
        return spec, None
    if not VARIANT.match(tail):
        raise ModelNotFound(f"'{tail}' is not a valid variant name in '{spec}'.", param="model")
    return head, tail


def dedupe(names, exclude: str) -> tuple[str, ...]:
    return tuple(n for n in dict.fromkeys(names) if n and n != exclude)


def for_engines(fmt: str, engine_formats: dict[str, frozenset[str]], **artifact) -> dict[str, Artifact]:
    return {e: Artifact(e, format=fmt, **artifact) for e, fmts in engine_formats.items() if fmt in fmts}


# -- local paths -----------------------------------------------------------------------------------
def expanduser(path: Path) -> Path:
    try:
        return path.expanduser()
    except RuntimeError:  # "~someone" who is not a user here: the name as given (it does not exist)
        return path


def path_exists(path: Path) -> bool:
    """Whether ``path`` exists; a name the OS cannot look up (too long, a component over 255 bytes, a NUL byte) does
    not."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def resolve_path(spec: str, path: Path, engine_formats: dict[str, frozenset[str]]) -> Resolved:
    fmt, task, ctx = inspect_path(path)
    full = str(path.resolve())
    artifacts = for_engines(fmt, engine_formats, uri=full, source=full)
    stem = path.name[: -len(path.suffix)] if path.is_file() and path.suffix else path.name
    return Resolved(spec, dedupe([stem, full], spec), task, ctx, None, artifacts)


# -- Hugging Face ids ------------------------------------------------------------------------------
def resolve_hf(
    spec: str,
    repo: str,
    file: str | None,
    variant: str | None,
    engine_formats: dict[str, frozenset[str]],
    suggest: str = "",
    offline: bool = False,
) -> Resolved:
    if file is not None:
        files = [file]
    else:
        from octo.models.download import ArtifactNotDownloaded, repo_files

        try:
            files = repo_files(repo, offline=True if offline else None)
        except ArtifactNotDownloaded:
            if not offline:
                raise
            why = f"Model '{spec}' is not downloaded here, and requests never start a download."
            raise ArtifactNotDownloaded(f"{why} Download it first with `octo pull {repo}`.", param="model") from None
        except ModelNotFound as exc:
            if suggest and exc.code == ModelNotFound.code:
                raise ModelNotFound(exc.message + suggest, param="model") from None
            raise
    found = detect_repo(repo, files, variant)
    artifacts: dict[str, Artifact] = {}
    for fmt, kw in found.items():
        for engine, artifact in for_engines(fmt, engine_formats, source=spec, **kw).items():
            artifacts.setdefault(engine, artifact)
    low = repo.lower()
    task = (
        "transcription"
        if found.keys() & {"whisper", "ct2", "ggml"}
        else "embeddings"
        if any(k in low for k in ("embed", "bge-", "/e5-", "minilm", "gte-"))
        else "chat"
    )
    return Resolved(spec, dedupe([repo, f"hf://{repo}", repo.split("/")[1]], spec), task, None, variant, artifacts)


def resolve_direct(spec: str, engine_formats: dict[str, frozenset[str]], offline: bool = False) -> Resolved | None:
    """A ``hf://`` URI or a spec that is plainly a path (``/``, ``./``, ``../``, ``~``, or a model file's suffix)
    resolved without the catalog; None for anything else (a catalog name, ``org/name``, a bare folder name)."""
    spec = spec.strip()
    if not spec:
        raise ModelNotFound("No model named: give a catalog name, a local path or a Hugging Face id.", param="model")
    if spec.startswith("hf://"):
        name, variant = split_variant(spec)
        try:
            repo, file = parse_hf(name)
        except ValueError as exc:
            raise ModelNotFound(str(exc), param="model") from None
        return resolve_hf(spec, repo, file, variant, engine_formats, offline=offline)
    path = expanduser(Path(spec))
    if spec.startswith(("/", "./", "../", "~")) or path.suffix.lower() in FILE_FORMATS:
        if not path_exists(path):
            raise ModelNotFound(f"No such file or folder: '{spec}' ({EXPECTED}).", param="model")
        return resolve_path(spec, path, engine_formats)
    return None


def resolve(spec: str, engine_formats: dict[str, frozenset[str]], offline: bool = False,
            bare_paths: bool = True) -> Resolved:
    """``Catalog.resolve`` of the catalog in use (``load_catalog``), which it loads only for a spec that needs it.
    ``bare_paths`` false (a request's model): a name without a path's marks (``org/name``, a bare word) is a catalog
    name or a Hugging Face id, never a file or folder under the working folder."""
    found = resolve_direct(spec, engine_formats, offline)
    if found is not None:
        return found
    from octo.models.catalog import load_catalog

    return load_catalog().resolve_name(spec, engine_formats, offline, bare_paths)
