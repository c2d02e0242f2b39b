"""Synthetic models (``synth://NAME``) for a server: built in a child process, found again without one.

A build runs ``python -m octo.synth.build NAME ENGINE`` so that the builders' libraries (PyTorch, transformers, MLX,
Triton) never load into the gateway. Starting that child costs about 0.15 s even when the model is already built
(each builder then only finds its files), and ``octo serve demo`` asks for three engines' builds at every start.
So each build's path is recorded in ``synth_dir()/built.json`` under a key made of the model's name, the engine and
a digest of the builders' own source (``octo/synth/*.py``): a later start whose builders are the same finds the
path there, checks that it is still whole (the file, or the folder's completion marker), and starts no child. A
change to any builder changes the key, and the child decides again (the builders name their files by the same
source)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

from octo import atomic, quarantine
from octo.errors import ConfigError
from octo.paths import synth_dir
from octo.synth.folder import COMPLETE

log = logging.getLogger("octo.models.synthetic")
MAX_BYTES = 1 << 20  # a record of a few dozen paths; a larger file is not one
SOURCES = Path(__file__).resolve().parents[1] / "synth"
_digest: str | None = None


def build(name: str, engine: str) -> Path:
    """The synthetic model ``name`` in ``engine``'s format: the recorded build when its path is there, else built
    (or found) by the child process and recorded."""
    key = f"{name}/{engine}/{builders_digest()}"
    index = synth_dir() / "built.json"
    known = _read(index).get(key)
    if known and _finished(Path(known)):
        return Path(known)
    path = _child_build(name, engine)
    _record(index, key, path)
    return path


def builders_digest() -> str:
    """A digest of the builders' source files (read once a process: about 1 ms)."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        for path in sorted(SOURCES.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _digest = h.hexdigest()[:16]
    return _digest


def _finished(path: Path) -> bool:
    """Whether a recorded build is still whole: its file, or its folder with the builders' completion marker."""
    return path.is_file() or (path / COMPLETE).is_file()


def _child_build(name: str, engine: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "octo.synth.build", name, engine], stdout=subprocess.PIPE,
                          text=True)
    try:
        out = json.loads((proc.stdout.strip().splitlines() or ["{}"])[-1])
    except ValueError:
        out = {}
    if proc.returncode != 0 or "path" not in out:
        why = out.get("error") or f"the builder exited with status {proc.returncode}"
        raise ConfigError(f"Synthetic model '{name}' cannot be built for {engine}: {why}")
    return Path(out["path"])


def _read(index: Path) -> dict[str, str]:
    """The record, read as every file of ``OCTO_HOME`` is (:func:`octo.quarantine.read_json`: never a link, a FIFO
    or a huge file; one that is not JSON is set aside with a log line); empty when there is none or it cannot be
    trusted: the builds are found again by the child."""
    data = quarantine.read_json(index, log, max_bytes=MAX_BYTES, keep=4, what="record of synthetic builds")
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _record(index: Path, key: str, path: Path) -> None:
    """Add ``key``'s path, dropping the entries of other builder digests (their files may be gone)."""
    digest = key.rsplit("/", 1)[1]
    entries = {k: v for k, v in _read(index).items() if k.endswith("/" + digest)}
    entries[key] = str(path)
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(index, json.dumps(entries, indent=1, sort_keys=True) + "\n")
    except OSError:  # a read-only OCTO_HOME: the next start asks the child again
        pass
