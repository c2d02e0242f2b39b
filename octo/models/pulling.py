"""What a pull may fetch, and fetching it within its bounds (``octo pull`` and ``POST /api/pull``).

- **What**: ``POST /api/pull`` pulls catalog names (``octo models``) only. A Hugging Face id (``org/name[:VARIANT]``,
  ``hf://...``) is pulled only when the operator opted in (``--allow-pull-hf``), within ``--max-pull-gb``: the
  repository's file sizes (the hub's metadata) are checked before a byte is downloaded, and the bytes received are
  counted while downloading (a pull that goes over is stopped and what it brought is removed). Anything else (a path,
  an unknown name) is the 404 of an unknown name, decided from the name's text alone. ``octo pull`` (the operator)
  pulls any of them. The hub is asked (with ``HF_TOKEN`` when it is set) only for those pulls.
- **Record**: the files a pull brought into the caches are recorded (:mod:`octo.models.pulled`); only those are ever
  deleted by ``DELETE /api/delete``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octo.errors import ModelNotFound, OctoError
from octo.models.resolve import Artifact, Resolved, is_hf_id, parse_hf, split_variant, uri_kind

GB = 10**9


class PullRefused(OctoError):
    """A pull this server does not do (a Hugging Face id without ``--allow-pull-hf``)."""

    status = 403
    type = "permission_error"
    code = "pull_not_allowed"


class PullTooLarge(OctoError):
    """A pull over ``--max-pull-gb``."""

    status = 413
    type = "invalid_request_error"
    code = "pull_too_large"


def canonical(name: str) -> tuple[str, bool] | None:
    """(the name a pull of ``name`` is recorded under, whether it is a Hugging Face id), decided without the file
    system or the hub: a catalog name as the catalog resolves it (``demo``, ``qwen-2.5-0.5b:4bit``), a Hugging Face
    id as given; None for anything else (a path, an unknown name)."""
    from octo.models.catalog import DEFAULT_ENGINE_FORMATS, load_catalog

    name = name.strip()
    catalog = load_catalog()
    try:
        base, _variant = split_variant(name)
    except ModelNotFound:
        return None
    if catalog.get(base) is not None:
        return catalog.resolve_name(name, DEFAULT_ENGINE_FORMATS).name, False  # (a catalog name: no file system)
    if name.startswith("hf://"):
        try:
            parse_hf(split_variant(name)[0])
        except (ValueError, ModelNotFound):
            return None
        return name, True
    return (name, True) if is_hf_id(name) else None


def on_disk(name: str) -> bool:
    """Whether a catalog name's artifacts (any engine's) are on this machine, however they came (a synthetic one
    counts: it is built here); False for any other name (no file system look-up for it)."""
    from octo.models.catalog import DEFAULT_ENGINE_FORMATS, load_catalog
    from octo.models.download import is_downloaded

    found = canonical(name)
    if found is None or found[1]:
        return False
    resolved = load_catalog().resolve_name(name, DEFAULT_ENGINE_FORMATS)
    for artifact in resolved.artifacts.values():
        try:
            if is_downloaded(artifact):
                return True
        except Exception:  # noqa: BLE001 - a broken cache entry reads as "not downloaded"
            continue
    return False


@dataclass
class Plan:
    name: str  # canonical (recorded under it)
    resolved: Resolved
    artifacts: list[Artifact]  # one per distinct artifact of the engines usable here
    hub_id: bool  # a Hugging Face id, not a catalog name: capped


def plan(name: str, engines: dict[str, Any], allow_hf: bool, unknown: Callable[[str], OctoError]) -> Plan:
    """What ``POST /api/pull NAME`` fetches: a catalog name's artifacts, or with ``allow_hf`` a Hugging Face id's
    (resolved on the hub); :class:`PullRefused` for a Hugging Face id otherwise, ``unknown(name)`` for the rest."""
    from octo.models.catalog import load_catalog

    found = canonical(name)
    if found is None:
        raise unknown(name)
    key, hub_id = found
    if hub_id and not allow_hf:
        raise PullRefused(f"This server pulls catalog models only (`octo models`); pulling the Hugging Face id "
                          f"'{name}' needs the operator's --allow-pull-hf.", param="model")
    formats = {n: c.formats for n, c in engines.items()}
    spec = f"hf://{name}" if hub_id and not name.startswith("hf://") else name  # (org/x.gguf: a repository, no file)
    resolved = load_catalog().resolve(spec, formats, bare_paths=False)
    usable = [e for e in resolved.artifacts if e in engines and engines[e].detect().available]
    if not usable:
        raise ModelNotFound(f"no engine usable here has an artifact for '{resolved.name}'", param="model")
    seen, out = set(), []
    for e in usable:
        art = resolved.artifacts[e]
        if (art.uri, art.allow_patterns, art.subfolder) not in seen:
            seen.add((art.uri, art.allow_patterns, art.subfolder))
            out.append(art)
    return Plan(key, resolved, out, hub_id)


# -- sizes -----------------------------------------------------------------------------------------
def hub_size(artifact: Artifact) -> int:
    """Bytes of the files ``artifact`` downloads from the hub, from the repository's metadata (no file is read)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    from octo.models.download import hub_endpoint

    repo, filename = parse_hf(artifact.uri)
    tree = [f for f in HfApi(endpoint=hub_endpoint()).list_repo_tree(repo, recursive=True)
            if isinstance(getattr(f, "size", None), int)]  # (files: folders have no size)
    if filename is not None:  # (and a GGUF's projector, from the same repository)
        wanted = {filename, parse_hf(artifact.mmproj)[1] if artifact.mmproj else None}
        return sum(int(f.size) for f in tree if f.path in wanted)
    if artifact.subfolder:
        tree = [f for f in tree if f.path.startswith(artifact.subfolder.strip("/") + "/")]
    patterns = list(artifact.allow_patterns) or None
    return sum(int(f.size) for f in filter_repo_objects(tree, allow_patterns=patterns, key=lambda f: f.path))


def check_size(artifacts: list[Artifact], max_bytes: int) -> int:
    """The pull's size from the hub's metadata; :class:`PullTooLarge` before anything is downloaded when it is over
    ``max_bytes`` (0: no cap)."""
    try:
        total = sum(hub_size(a) for a in artifacts if uri_kind(a.uri) == "hf")
    except Exception as exc:  # noqa: BLE001 - the cap cannot be checked: no download (fails closed)
        raise OctoError(f"The repository's file sizes could not be read from the hub ({type(exc).__name__}: {exc}); "
                        "nothing was downloaded.", param="model") from None
    if max_bytes and total > max_bytes:
        raise PullTooLarge(f"Pulling it would download {_amount(total)}, more than this server's "
                           f"--max-pull-gb {max_bytes / GB:g}; nothing was downloaded.", param="model")
    return total


class Budget:
    """Bytes received by one pull, across huggingface_hub's download threads; over ``max_bytes`` the next chunk
    raises :class:`PullTooLarge` in whichever thread receives it, which stops that download."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.received = max_bytes, 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.received += n
            over = self.max_bytes and self.received > self.max_bytes
        if over:
            raise PullTooLarge(f"The download went over this server's --max-pull-gb {self.max_bytes / GB:g} "
                               f"({_amount(self.received)} received, more than the hub's metadata said); it was "
                               "stopped and its files removed.", param="model")


def progress_class(report: Callable[[str, int, int], None] | None, budget: Budget | None = None) -> type:
    """A tqdm class huggingface_hub draws its bars with, reporting (file, total, completed) and counting the bytes
    against ``budget`` instead of drawing."""
    from tqdm.auto import tqdm

    class Progress(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.octo_name = str(kwargs.get("desc") or "model")
            self.octo_total = int(kwargs.get("total") or 0)
            self.octo_done = int(kwargs.get("initial") or 0)
            self.octo_bytes = kwargs.get("unit") == "B"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.octo_report()

        def octo_report(self) -> None:
            if self.octo_bytes and report is not None:
                report(self.octo_name, self.octo_total, self.octo_done)

        def update(self, n: float | None = 1) -> bool | None:
            self.octo_done += int(n or 0)
            if self.octo_bytes and budget is not None:
                budget.add(int(n or 0))
            self.octo_report()
            return None

    return Progress


# -- fetching and recording ------------------------------------------------------------------------
def fetch_recorded(name: str, artifact: Artifact, progress: bool | type = True, refresh: bool = False,
                   max_bytes: int = 0) -> Path:
    """``fetch(artifact)``; the files it brought are recorded under ``name`` (a failed pull removes them, so it
    leaves nothing behind), and with ``max_bytes`` they must fit in it."""
    from octo.models import pulled
    from octo.models.download import downloaded_files, fetch, repo_storage, sweep_partial_blobs

    before = downloaded_files(artifact)
    storage = repo_storage(parse_hf(artifact.uri)[0]) if uri_kind(artifact.uri) == "hf" else None
    fresh = storage is not None and not storage.exists()
    try:
        path = fetch(artifact, progress=progress, refresh=refresh)
        new = sorted(downloaded_files(artifact) - before)
        if max_bytes and sum(_size(f) for f in new) > max_bytes:
            raise PullTooLarge(f"The download went over this server's --max-pull-gb {max_bytes / GB:g}; its files "
                               "were removed.", param="model")
    except BaseException:
        pulled.delete_files(pulled.Pull(name, tuple(sorted(downloaded_files(artifact) - before)), 0.0))
        if storage is not None:
            sweep_partial_blobs(parse_hf(artifact.uri)[0])
            if fresh:  # a repository this pull brought: nothing of it stays
                pulled.drop_if_empty(storage)
        raise
    pulled.add(name, new)
    return path


def _amount(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB // 100 else f"{n / 10**6:.1f} MB" if n >= 10**5 else f"{n} bytes"


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size  # (a snapshot link: its blob's size)
    except OSError:
        return 0

