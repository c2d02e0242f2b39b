"""The record of what octo pulled (``octo pull``, ``POST /api/pull``), so that ``DELETE /api/delete`` removes only
files octo downloaded, never a file another program (or the operator) put in the Hugging Face cache.

``OCTO_HOME/pulled.json``: one entry per model, keyed by its canonical name (a catalog name as the catalog resolves
it, ``qwen-2.5-0.5b:4bit``, or a Hugging Face id as pulled, ``org/name[:VARIANT]``), with the files that pull brought
into the hub cache or octo's downloads folder (a file already there before is not octo's). Written atomically under
a lock (the CLI and a server may pull at once); read defensively: a file that is not a JSON object of the expected
shape, or larger than ``MAX_BYTES``, is set aside into ``quarantine/`` with one log line and the record starts empty;
an entry of the wrong shape is skipped; a listed file outside the managed folders is never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from octo import atomic, quarantine
from octo.logsafe import quoted
from octo.paths import octo_home

log = logging.getLogger("octo.models.pulled")
MAX_BYTES = 8 << 20  # a record of a few thousand models; anything larger is not ours
VERSION = 1


@dataclass(frozen=True)
class Pull:
    name: str  # canonical name
    files: tuple[str, ...]  # absolute paths octo downloaded (hub-cache snapshot links or files, plain downloads)
    at: float


def record_path() -> Path:
    return octo_home() / "pulled.json"


def managed_roots() -> list[Path]:
    """The folders octo downloads into: only files inside them are ever deleted."""
    from octo.models.download import downloads_dir, hub_cache_dir

    return [Path(os.path.abspath(hub_cache_dir())), Path(os.path.abspath(downloads_dir()))]


def inside(path: str | Path, roots: list[Path]) -> bool:
    """Whether ``path`` (absolute, no ``..``) lies inside one of ``roots`` by its spelling."""
    p = str(path)
    if not os.path.isabs(p) or ".." in Path(p).parts or "\x00" in p:
        return False
    return any(p.startswith(str(r).rstrip(os.sep) + os.sep) for r in roots)


# -- reading ---------------------------------------------------------------------------------------
def load() -> dict[str, Pull]:
    """The record (canonical name lower-cased -> :class:`Pull`); empty when there is none or it cannot be trusted
    (set aside with a log line: :func:`octo.quarantine.read_json`)."""
    path = record_path()
    data = quarantine.read_json(path, log, max_bytes=MAX_BYTES, keep=4, what="record of pulls")
    if data is not None and (not isinstance(data, dict) or not isinstance(data.get("models"), dict)):
        quarantine.move_aside(path, "not a record of pulls; it starts empty", log, keep=4, what="record of pulls")
        return {}
    out: dict[str, Pull] = {}
    for name, item in (data or {}).get("models", {}).items():
        pull = _entry(name, item)
        if pull is not None:
            out[name.lower()] = pull
    return out


def _entry(name: object, item: object) -> Pull | None:
    if not isinstance(name, str) or not name or not isinstance(item, dict):
        return None
    files, at = item.get("files"), item.get("at", 0.0)
    if not isinstance(files, list) or not all(isinstance(f, str) and os.path.isabs(f) for f in files):
        return None
    return Pull(name, tuple(files), float(at) if isinstance(at, (int, float)) else 0.0)


def find(name: str) -> Pull | None:
    return load().get(name.lower())


# -- writing ---------------------------------------------------------------------------------------
def _write(pulls: dict[str, Pull]) -> None:
    data = {"version": VERSION, "models": {p.name: {"files": list(p.files), "at": p.at} for p in pulls.values()}}
    atomic.write_bytes(record_path(), json.dumps(data, indent=1).encode())


def add(name: str, files: Iterable[str | Path]) -> Pull | None:
    """Record that a pull of ``name`` downloaded ``files`` (joined to what an earlier pull of it recorded). Nothing
    is recorded when it downloaded nothing (the files were there: not octo's to delete)."""
    new = [os.path.abspath(f) for f in files]
    if not new:
        return None
    with atomic.file_lock(atomic.lock_path(record_path())):
        pulls = load()
        old = pulls.get(name.lower())
        merged = tuple(dict.fromkeys([*(old.files if old else ()), *new]))
        pulls[name.lower()] = pull = Pull(old.name if old else name, merged, time.time())
        _write(pulls)
    return pull


def forget(name: str, kept: Iterable[str] = ()) -> None:
    """Remove ``name`` from the record (``kept``: files that could not be deleted stay recorded)."""
    kept = tuple(kept)
    with atomic.file_lock(atomic.lock_path(record_path())):
        pulls = load()
        old = pulls.pop(name.lower(), None)
        if old is None:
            return
        if kept:
            pulls[name.lower()] = Pull(old.name, kept, old.at)
        _write(pulls)


# -- deleting --------------------------------------------------------------------------------------
def delete_files(pull: Pull) -> list[str]:
    """Delete the files of ``pull`` (inside the managed folders only): a hub-cache snapshot link and, when no other
    snapshot links to it, its blob; then emptied folders. Returns the files that could not be deleted."""
    roots = managed_roots()
    failed: list[str] = []
    storages: set[Path] = set()
    for name in pull.files:
        path = Path(name)
        if not inside(path, roots):
            log.warning("record of pulls: not deleting %s: outside the folders octo downloads into", quoted(name))
            continue
        try:
            blob = _blob_of(path, roots[0])
            path.unlink(missing_ok=True)
            if blob is not None:
                storages.add(blob.parent.parent)
                if not _linked(blob, blob.parent.parent / "snapshots"):
                    blob.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("deleting %s failed: %s", quoted(name), exc)
            failed.append(name)
            continue
        _prune_empty(path.parent, roots)
    for storage in storages:
        drop_if_empty(storage)
    return failed


def _blob_of(path: Path, hub: Path) -> Path | None:
    """The blob a hub-cache snapshot link points to (None: not a link into this cache's blobs)."""
    if not path.is_symlink():
        return None
    target = Path(os.path.normpath(path.parent / os.readlink(path)))
    return target if inside(target, [hub]) and target.parent.name == "blobs" else None


def _linked(blob: Path, snapshots: Path) -> bool:
    """Whether a snapshot link still points to ``blob``."""
    for root, _dirs, files in os.walk(snapshots):
        for f in files:
            p = Path(root) / f
            if p.is_symlink() and Path(os.path.normpath(p.parent / os.readlink(p))) == blob:
                return True
    return False


def _prune_empty(folder: Path, roots: list[Path]) -> None:
    while inside(folder, roots) and folder.name not in ("snapshots", "blobs"):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return
        folder = folder.parent


def drop_if_empty(storage: Path) -> None:
    """A hub-cache repository folder with no snapshot file and no blob left goes (its refs describe nothing)."""
    snapshots, blobs = storage / "snapshots", storage / "blobs"
    has = any(files for _r, _d, files in os.walk(snapshots)) or any(blobs.iterdir() if blobs.is_dir() else ())
    if not has:
        shutil.rmtree(storage, ignore_errors=True)
