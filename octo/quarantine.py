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

from octo.logsafe import quoted

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
    shown = quoted(path, 1000, bare=True)  # (a file's name is anyone's who can write the folder: quoted)
    try:
        folder.mkdir(exist_ok=True)
        os.replace(path, dest)
    except OSError as exc:
        try:
            path.unlink(missing_ok=True)
            log.warning("%s %s: %s; removed it (could not move it aside: %s)", what, shown, why, exc)
        except OSError as exc2:
            log.warning("%s %s: %s; ignoring it (could neither move nor remove it: %s)", what, shown, why, exc2)
        return None
    log.warning("%s %s: %s; moved it to %s", what, shown, why, quoted(dest, 1000, bare=True))
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


def read_json(path: Path, log: logging.Logger, *, max_bytes: int = 1 << 20, what: str = "file",
              keep: int = KEEP) -> object | None:
    """The JSON value in ``path``, read without trusting the file: None when there is none; a regular file only (a
    symbolic link is not followed, and a FIFO or a device is refused before a read could block), at most
    ``max_bytes``. One that fails any of this, or is not JSON, is moved aside (:func:`move_aside`, one log line) and
    None returned, so the caller computes again what the file held."""
    import json
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        if os.path.islink(path):
            move_aside(path, "a symbolic link (only regular files are read)", log, keep=keep, what=what)
        return None  # (unreadable now: not moved, it may be fixed)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
            f"{st.st_size} bytes, more than such a file holds" if st.st_size > max_bytes else None
        raw = f.read(max_bytes + 1) if why is None else b""
    if why is None:
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            why = f"not JSON ({type(exc).__name__})"
    move_aside(path, why, log, keep=keep, what=what)
    return None
