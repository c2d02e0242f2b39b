"""Files octo cannot trust, moved aside instead of read: a corrupt prefix-cache entry, a damaged responses store.

A bad file goes into a ``quarantine/`` folder beside it, renamed ``NAME.YYYYmmdd-HHMMSS.bad`` (the rename never
follows a symbolic link: a link is moved, not what it points to), with one log line naming the file, the reason and
where it went. The folder keeps the newest ``keep`` files within ``max_bytes`` (older ones are removed), so a cache
that keeps producing bad files cannot fill the disk. When the rename itself fails (a read-only folder), the file is
removed; when that fails too, the caller still treats it as absent (and says so in the log line).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

FOLDER = "quarantine"
KEEP = 8
MAX_BYTES = 1 << 30


def move_aside(path: Path, why: str, log: logging.Logger, *, keep: int = KEEP, max_bytes: int = MAX_BYTES,
               what: str = "file") -> Path | None:
    """Move ``path`` into ``quarantine/`` beside it and log why; the new path, or None when it could only be removed
    (or not even that)."""
    folder = path.parent / FOLDER
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = folder / f"{path.name}.{stamp}.{os.getpid()}-{time.monotonic_ns() % 10**6}.bad"
    try:
        folder.mkdir(exist_ok=True)
        os.replace(path, dest)
    except OSError as exc:
        try:
            path.unlink(missing_ok=True)
            log.warning("%s %s: %s; removed it (could not move it aside: %s)", what, path, why, exc)
        except OSError as exc2:
            log.warning("%s %s: %s; ignoring it (could neither move nor remove it: %s)", what, path, why, exc2)
        return None
    log.warning("%s %s: %s; moved it to %s", what, path, why, dest)
    prune(folder, keep, max_bytes)
    return dest


def prune(folder: Path, keep: int = KEEP, max_bytes: int = MAX_BYTES) -> None:
    """Keep the newest ``keep`` files of ``folder`` within ``max_bytes`` in all."""
    try:
        files = []
        for entry in os.scandir(folder):
            st = entry.stat(follow_symlinks=False)
            files.append((st.st_mtime, entry.name, st.st_size))
    except OSError:
        return
    files.sort(reverse=True)
    total = 0
    for i, (_, name, size) in enumerate(files):
        total += size
        if i >= keep or total > max_bytes:
            try:
                (folder / name).unlink()
            except OSError:
                pass
