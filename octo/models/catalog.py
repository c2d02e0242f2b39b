"""The model catalog (``models.yaml``) and model-name resolution.

``Catalog.resolve(spec, engine_formats)`` turns what a user typed (``octo serve SPEC``) or a request
names into a :class:`Resolved`: the served name, its aliases, the task, and one :class:`Artifact` per
engine that can load the model. A spec is one of

- ``ALIAS[:VARIANT]``: a catalog entry (id or alias, case-insensitive); no variant = the default one;
- a local path: a ``.gguf`` file, a whisper ``.pt`` checkpoint, an MLX / Hugging Face folder
  (``config.json`` + ``*.safetensors``) or an onnxruntime-genai folder (``genai_config.json``);
- a Hugging Face id ``org/name[:VARIANT]`` (or ``hf://org/name[/file]``): the format is detected from
  the repository's files; the variant picks a GGUF quantisation (``Q4_K_M``, or ``4bit``/``8bit``/
  ``fp16``), an onnxruntime-genai subfolder, or must appear in the repository name (MLX).

Unknown names, unknown variants and unsupported paths raise :class:`octo.errors.ModelNotFound` (404);
a bad catalog raises :class:`octo.errors.ConfigError` naming the entry and the field.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from octo.errors import ConfigError, ModelNotFound
from octo.models.formats import CT2_PATTERNS, FILE_FORMATS, MLX_PATTERNS, ONNX_PATTERNS
from octo.models.resolve import (  # (Artifact, Resolved, uri_kind: the catalog's API names them too)
    HF_ID,
    VARIANT,
    Artifact,
    Resolved,
    check_uri,
    dedupe,
    expanduser,
    is_file_uri,
    path_exists,
    resolve_direct,
    resolve_hf,
    resolve_path,
    split_variant,
    uri_kind,
)
from octo.models.resolve import parse_hf as parse_hf  # noqa: F401 - re-exported

CATALOG_PATH = Path(__file__).with_name("models.yaml")
# What each built-in engine loads: the fallback when the engine registry is not at hand.
DEFAULT_ENGINE_FORMATS: dict[str, frozenset[str]] = {
    "llamacpp": frozenset({"gguf"}),
    "mlx": frozenset({"mlx"}),
    "onnx": frozenset({"onnx"}),
    "whisper": frozenset({"whisper"}),
    "faster-whisper": frozenset({"ct2"}),
    "whispercpp": frozenset({"ggml"}),
    "echo": frozenset(),
}
_FOLDER_FORMAT = {"mlx": "mlx", "onnx": "onnx", "faster-whisper": "ct2"}  # engines whose artifact is a folder
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")  # no ':' (it separates the variant), no spaces
_ENGINE = re.compile(r"^[a-z][a-z0-9_-]*$")


# -- the catalog schema ----------------------------------------------------------------------------
class ArtifactSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(min_length=1)
    format: Literal["gguf", "mlx", "onnx", "whisper", "ct2", "ggml", "synth", "none"] | None = None
    allow_patterns: tuple[str, ...] = ()
    subfolder: str | None = None
    mmproj: str | None = None  # a GGUF's projector: a file name beside it in its repository (mmproj*.gguf)

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        check_uri(v)
        return v


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    family: str | None = None
    description: str | None = None
    aliases: list[str] = []
    task: Literal["chat", "embeddings", "transcription"]
    context_length: int | None = Field(default=None, gt=0)
    # the completion's length when a request sets none (a Modelfile's num_predict): the synthetic models, whose random
    # weights rarely stop by themselves, answer a front-end that sends no limit within seconds, not a whole context
    max_tokens: int | None = Field(default=None, gt=0)
    default_variant: str
    variants: dict[str, dict[str, ArtifactSpec]] = Field(min_length=1)

    @field_validator("variants", mode="before")
    @classmethod
    def _plain_uris(cls, v):
        if isinstance(v, dict):
            return {
                name: {eng: {"uri": a} if isinstance(a, str) else a for eng, a in engines.items()}
                if isinstance(engines, dict)
                else engines
                for name, engines in v.items()
            }
        return v

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"'{v}' is not a valid model name (letters, digits, '.', '_', '-', '/'; no ':')")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for name in v:
            cls._id(name)
        return v

    @model_validator(mode="after")
    def _check(self) -> ModelEntry:
        if self.default_variant not in self.variants:
            raise ValueError(
                f"default_variant '{self.default_variant}' is not one of the variants ({', '.join(self.variants)})"
            )
        for variant, engines in self.variants.items():
            if not VARIANT.match(variant):
                raise ValueError(f"variants.{variant}: not a valid variant name (letters, digits, '.', '_', '-')")
            if not engines:
                raise ValueError(f"variants.{variant}: names no engine")
            for engine, spec in engines.items():
                where = f"variants.{variant}.{engine}"
                if not _ENGINE.match(engine):
                    raise ValueError(f"{where}: '{engine}' is not a valid engine name")
                _complete_spec(spec, engine, where)
        return self


def _complete_spec(spec: ArtifactSpec, engine: str, where: str) -> None:
    """Infer the format, check it suits the engine and the URI, fill default allow-patterns."""
    kind = uri_kind(spec.uri)
    inferred = (
        "synth" if kind == "synth" else "none" if kind == "none" else FILE_FORMATS.get(Path(spec.uri).suffix.lower())
    )
    if spec.format and inferred and spec.format != inferred:
        raise ValueError(f"{where}: format '{spec.format}' does not match '{spec.uri}' ({inferred})")
    fmt = spec.format or inferred or _FOLDER_FORMAT.get(engine)
    if fmt is None:
        raise ValueError(f"{where}: cannot tell the format of '{spec.uri}'; set `format`")
    known = DEFAULT_ENGINE_FORMATS.get(engine)
    if known is not None and fmt not in ("synth", "none") and fmt not in known:
        raise ValueError(f"{where}: engine '{engine}' loads {'/'.join(sorted(known)) or 'no files'}, not {fmt}")
    is_file = is_file_uri(spec.uri)
    if kind == "url" and not is_file:
        raise ValueError(f"{where}: a URL artifact must be a .gguf, .pt or .bin file, got '{spec.uri}'")
    if fmt in ("gguf", "whisper", "ggml") and not is_file:
        raise ValueError(f"{where}: a {fmt} artifact must be a single file, got '{spec.uri}'")
    if (spec.allow_patterns or spec.subfolder) and (is_file or kind not in ("hf", "path")):
        raise ValueError(f"{where}: allow_patterns/subfolder only apply to a folder artifact")
    if spec.subfolder is not None and (spec.subfolder.startswith("/") or ".." in spec.subfolder.split("/")):
        raise ValueError(f"{where}: subfolder must be a relative path inside the repository")
    if spec.mmproj is not None and not (fmt == "gguf" and kind == "hf" and is_file):
        raise ValueError(f"{where}: mmproj (a projector beside the GGUF) only applies to a hf:// GGUF file")
    if spec.mmproj is not None and not re.fullmatch(r"(?i)mmproj[^/]*\.gguf", spec.mmproj):
        raise ValueError(f"{where}: mmproj must be the file name of a projector beside the GGUF in its repository "
                         f"(mmproj*.gguf, as the llama.cpp engine finds it), got '{spec.mmproj}'")
    spec.format = fmt
    if kind == "hf" and not is_file and not spec.allow_patterns:
        prefix = f"{spec.subfolder.strip('/')}/" if spec.subfolder else ""
        base = {"mlx": MLX_PATTERNS, "onnx": ONNX_PATTERNS, "ct2": CT2_PATTERNS}.get(fmt, ("*",))
        spec.allow_patterns = tuple(prefix + p for p in base)


class CatalogFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    models: list[ModelEntry]

    @model_validator(mode="after")
    def _unique(self) -> CatalogFile:
        seen: dict[str, str] = {}
        for entry in self.models:
            for name in dict.fromkeys([entry.id, *entry.aliases]):
                other = seen.setdefault(name.lower(), entry.id)
                if other != entry.id:
                    raise ValueError(f"name '{name}' of entry '{entry.id}' is already used by entry '{other}'")
        return self


def _config_error(err: ValidationError, raw: dict, path: Path) -> ConfigError:
    lines = []
    for e in err.errors()[:10]:
        loc = e["loc"]
        msg = e["msg"].removeprefix("Value error, ")
        if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
            item = (raw.get("models") or [None] * (loc[1] + 1))[loc[1]]
            name = item.get("id", "?") if isinstance(item, dict) else "?"
            where = f"entry '{name}' (models[{loc[1]}])"
            fld = ".".join(str(p) for p in loc[2:])
            lines.append(f"{where}, field '{fld}': {msg}" if fld else f"{where}: {msg}")
        else:
            lines.append(f"field '{'.'.join(map(str, loc))}': {msg}" if loc else msg)
    return ConfigError(f"Bad model catalog {path}: " + "; ".join(lines))


# -- the catalog -----------------------------------------------------------------------------------
class Catalog:
    def __init__(self, entries: list[ModelEntry], path: Path | None = None) -> None:
        self.entries = entries
        self.path = path
        self._by_name = {n.lower(): e for e in entries for n in (e.id, *e.aliases)}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> Catalog:
        path = Path(path or os.environ.get("OCTO_CATALOG") or CATALOG_PATH).expanduser()
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"Cannot read the model catalog {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"Bad model catalog {path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"Bad model catalog {path}: expected a mapping with a 'models' list")
        try:
            data = CatalogFile.model_validate(raw)
        except ValidationError as exc:
            raise _config_error(exc, raw, path) from None
        base = path.parent
        for entry in data.models:  # local paths in a catalog are relative to the catalog file
            for engines in entry.variants.values():
                for spec in engines.values():
                    if uri_kind(spec.uri) == "path" and not Path(spec.uri).expanduser().is_absolute():
                        spec.uri = str(base / spec.uri)
        return cls(data.models, path)

    def names(self) -> list[str]:
        """Catalog ids, in catalog order."""
        return [e.id for e in self.entries]

    def all_names(self) -> list[str]:
        """Ids and aliases."""
        return [n for e in self.entries for n in (e.id, *e.aliases)]

    def get(self, name: str) -> ModelEntry | None:
        return self._by_name.get(name.lower())

    def artifacts(self, entry: ModelEntry, variant: str, source: str | None = None) -> dict[str, Artifact]:
        """Every engine's artifact for ``entry:variant`` (registered here or not)."""
        return {
            engine: Artifact(
                engine,
                str(Path(s.uri).expanduser()) if uri_kind(s.uri) == "path" else s.uri,
                s.format,
                tuple(s.allow_patterns),
                s.subfolder,
                source or (entry.id if len(entry.variants) == 1 else f"{entry.id}:{variant}"),
                s.mmproj and f"{s.uri.rsplit('/', 1)[0]}/{s.mmproj}",
            )
            for engine, s in entry.variants[variant].items()
        }

    def resolve(self, spec: str, engine_formats: dict[str, frozenset[str]], offline: bool = False,
                bare_paths: bool = True) -> Resolved:
        """``offline``: a Hugging Face id resolves from the local cache only (a request's model never reaches the
        hub; one that is not downloaded is a 404 naming `octo pull`). ``bare_paths`` false: a name without a path's
        marks (``/``, ``./``, ``../``, ``~``, a model file's suffix) is never looked up as a file or folder."""
        found = resolve_direct(spec, engine_formats, offline)
        return found if found is not None else self.resolve_name(spec, engine_formats, offline, bare_paths)

    def resolve_name(self, spec: str, engine_formats: dict[str, frozenset[str]], offline: bool = False,
                     bare_paths: bool = True) -> Resolved:
        """:meth:`resolve` of a spec ``resolve_direct`` left to the catalog (a name, ``org/name``, and with
        ``bare_paths`` a folder relative to the working folder: the operator's ``octo serve models/x``)."""
        spec = spec.strip()
        name, variant = split_variant(spec)
        entry = self.get(name)
        if entry is not None:
            return self._resolve_entry(entry, variant, spec, engine_formats)
        path = expanduser(Path(spec)) if bare_paths else None
        if path is not None and path_exists(path):
            return resolve_path(spec, path, engine_formats)
        if HF_ID.match(name):
            return resolve_hf(spec, name, None, variant, engine_formats, suggest=self._closest(name),
                               offline=offline)
        raise ModelNotFound(
            f"Model '{spec}' not found.{self._closest(name)} Run `octo models` for the "
            "catalog; a local path or a Hugging Face id (org/name) also works.",
            param="model",
        )

    def _closest(self, name: str) -> str:
        names = self.all_names()
        lowered = {n.lower(): n for n in names}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.5)
        return f" Closest names: {', '.join(lowered[c] for c in close)}." if close else ""

    def _resolve_entry(
        self, entry: ModelEntry, variant: str | None, spec: str, engine_formats: dict[str, frozenset[str]]
    ) -> Resolved:
        if variant is None:
            variant = entry.default_variant
        elif variant not in entry.variants:
            folded = {v.lower(): v for v in entry.variants}
            if variant.lower() not in folded:
                raise ModelNotFound(
                    f"Model '{entry.id}' has no variant '{variant}'; known variants: "
                    + ", ".join(f"{v} (the default)" if v == entry.default_variant != "default" else v
                                for v in entry.variants)
                    + ".",
                    param="model",
                )
            variant = folded[variant.lower()]
        name = entry.id if len(entry.variants) == 1 else f"{entry.id}:{variant}"
        artifacts = {
            e: a
            for e, a in self.artifacts(entry, variant, name).items()
            if e in engine_formats and (a.format in ("synth", "none") or a.format in engine_formats[e])
        }
        aliases = [
            spec,
            entry.id,
            f"{entry.id}:{variant}",
            *entry.aliases,
            *(f"{a}:{variant}" for a in entry.aliases),
        ]
        return Resolved(name, dedupe(aliases, name), entry.task, entry.context_length, variant, artifacts)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> Catalog:
    return Catalog.load(path)


def load_catalog(path: str | os.PathLike | None = None) -> Catalog:
    """The catalog at ``path`` (default: ``$OCTO_CATALOG`` or the packaged ``models.yaml``), cached."""
    p = Path(path or os.environ.get("OCTO_CATALOG") or CATALOG_PATH).expanduser().resolve()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return Catalog.load(p)  # raises the ConfigError naming the file
    return _load_cached(str(p), mtime)


