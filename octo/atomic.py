"""Crash-safe files: every file octo writes appears whole or not at all, and no lock outlives its holder.

- Writes go to a temporary sibling (same directory, so the rename is atomic) named
  ``.NAME.octo-tmp-PID-RANDOM`` and are renamed over ``NAME`` with ``os.replace`` once complete; a folder is
  built in a temporary sibling folder and renamed into place. A process killed in the middle (``kill -9``, the
  OOM killer) leaves at most a temporary, never a half-written ``NAME``.
- Temporaries a dead process left are swept: ``sweep`` removes those whose PID (in the name) is no longer alive;
  every write of a file, and every build under its lock, sweeps its target's first.
- ``file_lock`` is ``fcntl.flock`` on a lock file: the kernel releases it when its holder dies, however it dies,
  so a lock file left on disk is never a stale lock. On a filesystem without ``flock`` it falls back to an
  exclusive-create lock file holding the owner's PID, which is broken when that PID is not alive.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_MARK = ".octo-tmp-"


# -- processes -------------------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie holds no lock and writes nothing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


# -- temporaries -----------------------------------------------------------------------------------
def temp_path(path: str | os.PathLike) -> Path:
    """A fresh temporary sibling of ``path``: ``.NAME.octo-tmp-PID-RANDOM`` in the same directory."""
    p = Path(path)
    return p.with_name(f".{p.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def is_temp(name: str) -> bool:
    return TMP_MARK in name


def temp_owner(name: str) -> int | None:
    """The PID in a temporary's name (None for a name that is not one)."""
    if TMP_MARK not in name:
        return None
    try:
        return int(name.rsplit(TMP_MARK, 1)[1].split("-", 1)[0])
    except ValueError:
        return None


def remove(path: Path) -> None:
    """Remove a file or a folder, whatever is there (nothing there is fine)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def sweep(directory: str | os.PathLike, target: str | None = None) -> list[Path]:
    """Remove the temporaries that processes which died left in ``directory`` (only ``target``'s, when given);
    returns what was removed. A temporary whose process is alive is being written and stays."""
    d = Path(directory)
    prefix = f".{target}{TMP_MARK}" if target is not None else None
    removed = []
    try:
        entries = list(os.scandir(d))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not is_temp(name) or (prefix is not None and not name.startswith(prefix)):
            continue
        owner = temp_owner(name)
        if owner is None or (owner != os.getpid() and not pid_alive(owner)):
            remove(d / name)
            removed.append(d / name)
    return removed


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, durable: bool = False) -> Iterator[Path]:
    """``with replacing(p) as tmp:`` write the new ``p`` at ``tmp``; it replaces ``p`` when the block ends without
    an exception (removed otherwise). ``tmp`` may be a file or a folder. ``durable`` fsyncs a file first."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(p)
    try:
        yield tmp
        if durable and tmp.is_file():
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, p)
    finally:
        if tmp.exists() or tmp.is_symlink():
            remove(tmp)


def write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> Path:
    """Write ``path`` atomically (a reader sees the old content or the new, never part of it); first removes the
    temporaries of ``path`` that writers which died left."""
    p = Path(path)
    sweep(p.parent, p.name)
    with replacing(p, durable=True) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
    return p


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj: Any, **dumps: Any) -> Path:
    return write_text(path, json.dumps(obj, **dumps))


# -- locks -----------------------------------------------------------------------------------------
def lock_path(target: str | os.PathLike) -> Path:
    """The lock file that guards building ``target``: ``OCTO_HOME/locks/NAME-DIGEST.lock`` (kept out of the cache
    folders themselves, so a finished folder holds only its files)."""
    import hashlib

    from octo.paths import octo_home

    p = Path(target).expanduser().absolute()
    digest = hashlib.sha256(str(p).encode()).hexdigest()[:20]
    return octo_home() / "locks" / f"{p.name[:48]}-{digest}.lock"


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, timeout: float | None = None, poll: float = 0.05) -> Iterator[Path]:
    """Hold an exclusive lock on the lock file ``path`` (created if missing) for the block.

    ``fcntl.flock``: released by the kernel when the holder exits or is killed. ``timeout`` (seconds; None: wait
    for ever) raises TimeoutError. The lock file stays on disk afterwards (unlinking it would race other
    waiters); it holds the last holder's PID, for people reading it.
    """
    import fcntl

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as exc:  # no flock on this filesystem: a PID lock file instead
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.close(fd)
                fd = -1
                with _pid_lock(p.with_name(p.name + ".pid"), deadline, poll):
                    yield p
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"lock {p} is held by another process")
            time.sleep(poll)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield p
    finally:
        if fd >= 0:
            os.close(fd)  # closing the descriptor releases the flock


def is_locked(path: str | os.PathLike) -> bool:
    """Whether some live process holds the lock file ``path`` now (a missing file is not locked)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def _pid_lock(path: Path, deadline: float | None, poll: float) -> Iterator[None]:
    """An exclusive-create lock file with its owner's PID inside; one whose owner is dead is broken."""
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                owner = None
            if owner is not None and not pid_alive(owner):
                with contextlib.suppress(OSError, IndexError):  # its holder died: stale (read again just before,
                    if path.read_text().split()[0] == str(owner):  # so a fresh lock is rarely broken by a racer)
                        path.unlink()
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"lock {path} is held by process {owner}") from None
            time.sleep(poll)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        break
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


# -- build once ------------------------------------------------------------------------------------
def build_file(out: str | os.PathLike, write, done=None) -> Path:
    """Return ``out`` once it is complete, building it if needed: under ``out``'s lock (``lock_path``), sweep the
    temporaries a dead build left, run ``write(tmp)`` and rename ``tmp`` (a file or a folder) into place.

    ``done(out)`` says whether ``out`` is complete (default: it exists). Concurrent callers wait for the one
    building and then use its result.
    """
    p = Path(out)
    done = done or (lambda q: q.exists())
    if done(p):
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path(p)):
        sweep(p.parent, p.name)
        if done(p):
            return p
        with replacing(p) as tmp:
            if p.exists() or p.is_symlink():  # an unfinished result of an older octo: rebuilt
                remove(p)
            write(tmp)
    return p
