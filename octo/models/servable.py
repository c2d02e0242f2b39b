"""What a request may load: the models the operator made servable, and nothing else.

A request's ``model`` that no loaded or declared model answers to is resolved here before anything reads the disk
or the network for it. By default it may name a catalog model (``octo models``; loaded only if already downloaded),
a Hugging Face id already in the local cache (``octo pull``), or a model file or folder under one of the
``--models-dir`` folders (by its path, absolute or relative to the folder). Anything else (a path outside those
folders, ``~user``, an ``org/name`` that is not downloaded, ``rel/..``) gets the same 404 as a name that does not
exist, decided from the name's text (and the ``--models-dir`` folders) before the file system is asked, so a request
learns nothing about the files and users of the machine. A relative name without a path's marks (``org/name``) is a
catalog name or a Hugging Face id, never a file or folder under the server's working folder. ``--allow-any-path``
restores loading any readable path (relative to the server's working folder). A path becomes its real path (symlinks
and ``.`` resolved) before it names a model, so one file is one model however a request spells it.
"""

from __future__ import annotations

import os
from pathlib import Path

from octo.errors import ModelNotFound
from octo.models.formats import FILE_FORMATS
from octo.models.resolve import is_hf_id, path_exists


def unknown_model(model: str, dirs: tuple[str, ...]) -> ModelNotFound:
    """The 404 of a name this server cannot serve, the same whether or not a file of that name exists."""
    shown = model if len(model) <= 200 else model[:200] + "..."
    where = " or a model under the server's --models-dir folders" if dirs else ""
    return ModelNotFound(f"Model '{shown}' not found.{closest_names(model)} Run `octo models` for the catalog; a "
                         f"request may name a downloaded catalog model, a downloaded Hugging Face id (octo pull)"
                         f"{where}.", param="model")


def closest_names(model: str) -> str:
    """" Closest names: ..." of the catalog's names (ids and aliases) close to a name with a typo, as the CLI
    suggests them; nothing for a path (the answer never depends on the server's files)."""
    if looks_like_path(model) or len(model) > 200:
        return ""
    import difflib

    from octo.models.catalog import load_catalog

    lowered = {n.lower(): n for n in load_catalog().all_names()}
    close = difflib.get_close_matches(model.lower(), list(lowered), n=3, cutoff=0.6)
    return f" Closest names: {', '.join(lowered[c] for c in close)}." if close else ""


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~", "\\")) or Path(model).suffix.lower() in FILE_FORMATS


def request_model(model: str, catalog_names: set[str], dirs: tuple[str, ...], allow_any_path: bool,
                  known_paths: frozenset[str] = frozenset()) -> str:
    """The spelling of ``model`` to resolve for a request: a catalog name or Hugging Face id as given, a path as
    its real path (``known_paths``: real paths of the models named at start, servable however a request spells
    them); raises the 404 of :func:`unknown_model` for anything the request may not load."""
    base = model.rpartition(":")[0] if ":" in model and "/" not in model.rpartition(":")[2] else model
    if model.lower() in catalog_names or base.lower() in catalog_names:
        return model
    if model.startswith("hf://"):
        return model
    if allow_any_path:
        path = os.path.expanduser(model) if model.startswith("~") else model
        return os.path.realpath(path) if path_exists(Path(path)) else model
    found = under_dirs(model, dirs)
    if found is not None:
        return found
    known = known_path(model, known_paths)
    if known is not None:
        return known
    if is_hf_id(model) and not looks_like_path(model):
        return model  # resolved as a Hugging Face id only (bare_paths=False): never a folder of the working folder
    raise unknown_model(model, dirs)


def known_path(model: str, known_paths: frozenset[str]) -> str | None:
    """The real path of ``model`` when it is another spelling of a model named at start; the file system is asked
    only about paths whose file name is one of those models' (an unrelated path costs no look-up)."""
    if not model.startswith("/") or "\x00" in model or len(model) > 4096:
        return None
    if os.path.basename(os.path.normpath(model)) not in {os.path.basename(k) for k in known_paths}:
        return None
    real = os.path.realpath(model)
    return real if real in known_paths else None


def under_dirs(model: str, dirs: tuple[str, ...]) -> str | None:
    """The real path of ``model`` if it names an existing file or folder inside one of ``dirs`` (an absolute path
    inside one, or a path relative to one); never with ``..`` or ``~``, never outside the folders."""
    if not dirs or not model or "\x00" in model or model.startswith("~"):
        return None
    parts = model.replace("\\", "/").split("/")
    if ".." in parts:
        return None
    for folder in dirs:  # (real paths: the CLI resolves them)
        lexical = os.path.normpath(os.path.join(folder, model))
        # inside by its spelling, decided before the file system is asked (a path outside costs no look-up); a
        # symlink the operator put in the folder counts, whatever it points to
        if not _inside(lexical, folder) or not path_exists(Path(lexical)):
            continue
        return os.path.realpath(lexical)
    return None


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
