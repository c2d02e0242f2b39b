"""The disk tier of the prefix cache (``--prefix-cache-dir``): long prompts' KV, saved as files, so that a long shared
prefix (a system prompt, a tool catalog, an agent's conversation) survives a restart.

- **What is written**: when a sequence whose prompt has at least ``min_tokens`` tokens leaves the batch, its KV (the
  engine's ``kv_export`` of the handle the in-memory cache keeps) is written, unless an entry on disk already covers
  its prompt; an entry the new one extends (the previous turn of the same conversation) is removed. Exporting is a
  memory copy on the engine thread; the file is written by one background thread, atomically (``octo.atomic``), so a
  crash leaves a whole entry or none.
- **What is read**: a new sequence whose prompt shares more tokens with an entry on disk than with anything in memory
  (by at least ``min_gain``) is restored from it (``kv_import`` then the engine's ordinary ``kv_restore``), and the
  entry joins the in-memory cache, so the next hit is a memory hit.
- **Keys**: one folder per model digest + engine + engine version + engine options (``cache_key``): a KV computed
  by another model, engine build or configuration is never read. Entries beyond ``budget_bytes`` are removed, least
  recently used first.
- **Trust**: nothing in the folder can stop the server or change an answer. Only regular files are read (opened
  without following symbolic links); each header is bounded (``MAX_HEADER`` bytes, a flat JSON object, sizes checked
  against the file's before anything is allocated) and its token list CRC-checked at the scan; the payload's
  checksum (xxh3-64, or CRC-32 without xxhash) is checked on every read, before the engine sees a byte. Any failure
  concerns that file only: it is a miss (the prompt is computed), and the file is moved to ``quarantine/`` with one
  log line naming it and the reason (:mod:`octo.quarantine`). Files of the previous format (``OCTOKV01``, no payload
  checksum) are removed as clean misses.

File layout: ``MAGIC`` | u32 header length | header JSON (key, n_tokens, payload_bytes, tokens_crc, payload_check
``ALGO:HEX``) | tokens (int32 little endian) | payload (the engine's bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from octo import atomic, quarantine

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

log = logging.getLogger("octo.scheduler.disk_cache")

MAGIC = b"OCTOKV02"  # 02: the payload carries a checksum
OLD_MAGICS = (b"OCTOKV01",)  # earlier formats: a clean miss (the file is removed)
SUFFIX = ".kv"
MAX_HEADER = 4096  # bytes of header JSON: a flat object of five short fields
MAX_TOKENS = 1 << 24  # a prefix longer than any context
MAX_PAYLOAD = 1 << 36  # bytes of KV in one entry, whatever the budget (and never more than the cache's budget)
HEADER_FIELDS = {"key": str, "n_tokens": int, "payload_bytes": int, "tokens_crc": int, "payload_check": str}
QUARANTINE_KEEP = 8


def cache_key(engine_name: str, engine_version: str, artifact_digest: str, options: dict[str, str]) -> str:
    """The folder of a model's entries: whatever changes the KV bytes changes it."""
    spec = json.dumps([engine_name, engine_version, artifact_digest, sorted(options.items())])
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


class BadFile(ValueError):
    """A file that is not a usable entry of this cache (the message says why)."""


class OldFormat(ValueError):
    """An entry written by an earlier octo, in a format without payload checksums."""


def _xxh3() -> Any:
    try:
        import xxhash
    except ImportError:  # a declared dependency; without it, CRC-32 (slower, still a check)
        return None
    return xxhash.xxh3_64_hexdigest


def checksum(data: bytes | memoryview, algo: str | None = None) -> str:
    """``ALGO:HEX`` of ``data``: xxh3-64 where xxhash is installed, else CRC-32 (``algo`` picks one to verify)."""
    xxh3 = _xxh3()
    if algo is None:
        algo = "xxh3_64" if xxh3 is not None else "crc32"
    if algo == "xxh3_64" and xxh3 is not None:
        return f"xxh3_64:{xxh3(data)}"
    if algo == "crc32":
        return f"crc32:{zlib.crc32(data):08x}"
    raise BadFile(f"its payload checksum uses {algo}, which this host cannot compute")


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[IO[bytes]]:
    """``path`` opened for reading when it is a regular file itself (a symbolic link is not followed: a link out of
    the folder is never read; a folder, a FIFO or a device is refused before any read could block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(path):
            raise BadFile("a symbolic link (only regular files in the folder are read)") from None
        raise exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadFile("not a regular file")
    with os.fdopen(fd, "rb") as f:
        yield f


def parse_header(raw: bytes, key: str, max_payload: int = MAX_PAYLOAD) -> dict[str, Any]:
    """The header of an entry, checked: a flat JSON object (no nesting: bounded depth) of the known fields, with
    this cache's key and sizes in range (a payload of at most ``max_payload`` bytes: the cache's budget)."""
    if raw.count(b"{") != 1 or b"[" in raw:
        raise BadFile("its header is not a flat JSON object")
    header = json.loads(raw)
    if not isinstance(header, dict) or set(header) != set(HEADER_FIELDS):
        raise BadFile("its header does not have the expected fields")
    for name, kind in HEADER_FIELDS.items():
        if type(header[name]) is not kind:
            raise BadFile(f"its header's {name} is not a{'n int' if kind is int else ' string'}")
    if header["key"] != key:
        raise BadFile("written for another model, engine or configuration")
    if not 0 < header["n_tokens"] <= MAX_TOKENS or not 0 <= header["payload_bytes"] <= min(max_payload, MAX_PAYLOAD):
        raise BadFile(f"its header claims {header['n_tokens']} tokens and {header['payload_bytes']} payload bytes")
    return header


def read_entry(f: IO[bytes], path: Path, key: str, payload: bool,
               max_payload: int = MAX_PAYLOAD) -> tuple[Entry, bytes | None]:
    """Read and check an entry from ``f``: sizes against the file's and ``max_payload`` (before anything is
    allocated), the token list's CRC, and with ``payload`` the payload's checksum. Raises :class:`BadFile` (or
    :class:`OldFormat`)."""
    import numpy as np
    size = os.fstat(f.fileno()).st_size
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
        if head[:len(MAGIC)] in OLD_MAGICS:
            raise OldFormat("written by an earlier octo without payload checksums")
        raise BadFile("not an octo KV file")
    (n,) = struct.unpack("<I", head[len(MAGIC):])
    if n > MAX_HEADER or len(MAGIC) + 4 + n > size:
        raise BadFile(f"bad header length ({n} bytes)")
    header = parse_header(f.read(n), key, max_payload)
    n_tokens, n_payload = header["n_tokens"], header["payload_bytes"]
    offset = len(MAGIC) + 4 + n + 4 * n_tokens
    if size != offset + n_payload:
        raise BadFile(f"truncated or padded ({size} bytes, its header says {offset + n_payload})")
    raw = f.read(4 * n_tokens)
    if len(raw) != 4 * n_tokens or zlib.crc32(raw) != header["tokens_crc"]:
        raise BadFile("corrupt token list")
    data = None
    if payload:
        data = f.read(n_payload)
        if len(data) != n_payload:
            raise BadFile(f"short read ({len(data)} of {n_payload} payload bytes)")
        algo = header["payload_check"].partition(":")[0]
        if checksum(data, algo) != header["payload_check"]:
            raise BadFile("its KV payload does not match its checksum (corrupt on disk)")
    used = os.fstat(f.fileno()).st_mtime
    return Entry(path, np.frombuffer(raw, dtype="<i4").copy(), offset, n_payload, used), data


@dataclass
class Entry:
    path: Path
    tokens: np.ndarray  # int32
    payload_offset: int
    payload_bytes: int
    used: float  # last use (mtime), for the LRU


def _common(a: np.ndarray, b: np.ndarray) -> int:
    import numpy as np
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class DiskPrefixCache:
    def __init__(self, root: str | os.PathLike, key: str, budget_bytes: int, min_tokens: int = 256,
                 min_gain: int = 64) -> None:
        self.dir = Path(root) / key
        self.key = key
        self.budget = int(budget_bytes)
        self.min_tokens = min_tokens
        self.min_gain = min_gain
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()  # the engine thread reads the index, the writer thread changes it
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="octo-disk-cache")
        self.hits = self.writes = self.ignored = self.write_errors = self.checksum_errors = 0
        self.bytes = 0
        if self.dir.is_symlink() or (self.dir.exists() and not self.dir.is_dir()):  # only a folder of our own
            quarantine.move_aside(self.dir, "not a folder of this cache", log, what="disk prefix cache: ignoring")
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic.sweep(self.dir)
        self._scan()

    # -- index -------------------------------------------------------------------------------------
    def _scan(self) -> None:
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            entry = self._read_header(path)
            if entry is not None:
                self._entries[path.name] = entry
                self.bytes += entry.payload_offset + entry.payload_bytes
        if self._entries:
            log.info("disk prefix cache %s: %d entries, %.1f MB", self.dir, len(self._entries), self.bytes / 2**20)

    def _read_header(self, path: Path) -> Entry | None:
        """The entry of one file, or None (the file set aside with a log line): any failure concerns this file only."""
        try:
            with open_regular(path) as f:
                entry, _ = read_entry(f, path, self.key, payload=False, max_payload=self.budget)
            return entry
        except OldFormat as exc:
            self.ignored += 1
            log.info("disk prefix cache: removing %s: %s", path, exc)
            atomic.remove(path)
        except Exception as exc:  # noqa: BLE001 - a corrupt, hostile or unreadable file is a miss, never a failure
            self._set_aside(path, exc)
        return None

    def _set_aside(self, path: Path, why: BaseException | str) -> None:
        self.ignored += 1
        if isinstance(why, BaseException):
            why = str(why) if isinstance(why, BadFile) else f"unreadable ({type(why).__name__}: {why})"
        quarantine.move_aside(path, why, log, keep=QUARANTINE_KEEP, max_bytes=max(self.budget // 8, 1 << 20),
                              what="disk prefix cache: ignoring")

    def lookup(self, tokens: list[int], max_len: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens[:max_len]``, and that length."""
        import numpy as np
        if not self._entries or max_len < self.min_tokens:
            return None, 0
        want = np.asarray(tokens[:max_len], dtype=np.int32)
        best, best_n = None, 0
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            n = _common(e.tokens, want)
            if n > best_n:
                best, best_n = e, n
        return (best, best_n) if best_n >= self.min_tokens else (None, 0)

    def load(self, entry: Entry) -> bytes | None:
        """The engine bytes of ``entry``, their checksum checked; None (the file set aside, with a log line) when the
        file changed, is short, or its bytes do not match their checksum: a miss, recomputed."""
        import numpy as np
        try:
            with open_regular(entry.path) as f:
                again, data = read_entry(f, entry.path, self.key, payload=True, max_payload=self.budget)
            if again.payload_offset != entry.payload_offset or not np.array_equal(again.tokens, entry.tokens):
                raise BadFile("changed since it was indexed")
            os.utime(entry.path, follow_symlinks=False)
            entry.used = entry.path.lstat().st_mtime
            self.hits += 1
            return data
        except FileNotFoundError:  # removed meanwhile (another server sharing the folder evicted it): a plain miss
            self._forget(entry)
            return None
        except Exception as exc:  # noqa: BLE001 - a bad entry is a miss, never an error
            self._forget(entry)
            if isinstance(exc, BadFile) and "checksum" in str(exc):
                self.checksum_errors += 1
            self._set_aside(entry.path, exc)
            return None

    def drop(self, entry: Entry, why: str) -> None:
        """Forget (and set aside) an entry the engine could not use."""
        self._forget(entry)
        self._set_aside(entry.path, why)

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.pop(entry.path.name, None) is not None:
                self.bytes -= entry.payload_offset + entry.payload_bytes

    # -- writes --------------------------------------------------------------------------------------
    def wants(self, tokens: tuple[int, ...], n_prompt: int) -> bool:
        """Whether a finished sequence of ``n_prompt`` prompt tokens should be written (engine thread)."""
        if n_prompt < self.min_tokens:
            return False
        _, covered = self.lookup(list(tokens[:n_prompt]), n_prompt)
        return covered < n_prompt - self.min_gain

    def save(self, tokens: tuple[int, ...], payload: bytes) -> None:
        """Write an entry in the background (not one over the whole budget: it could never be read back)."""
        import numpy as np
        if len(payload) > self.budget:
            return
        self._writer.submit(self._write, np.asarray(tokens, dtype=np.int32), payload)

    def _write(self, tokens: np.ndarray, payload: bytes) -> None:
        raw = tokens.astype("<i4").tobytes()
        header = json.dumps({"key": self.key, "n_tokens": len(tokens), "payload_bytes": len(payload),
                             "tokens_crc": zlib.crc32(raw), "payload_check": checksum(payload)}).encode()
        name = hashlib.sha256(raw).hexdigest()[:32] + SUFFIX
        path = self.dir / name
        try:
            with atomic.replacing(path) as tmp:
                with open(tmp, "wb") as f:
                    f.write(MAGIC + struct.pack("<I", len(header)) + header)
                    f.write(raw)
                    f.write(payload)
        except OSError as exc:
            self.write_errors += 1
            log.warning("disk prefix cache: writing %s failed: %s", path, exc)
            return
        offset = len(MAGIC) + 4 + len(header) + len(raw)
        entry = Entry(path, tokens, offset, len(payload), path.lstat().st_mtime)
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self.bytes -= old.payload_offset + old.payload_bytes
            self._entries[name] = entry
            self.bytes += offset + len(payload)
            self.writes += 1
            # entries the new one extends (an earlier turn of the same conversation) are covered by it
            covered = {id(e) for e in self._entries.values() if e is not entry and len(e.tokens) <= len(tokens)
                       and _common(e.tokens, tokens) == len(e.tokens)}
            rest = sorted((e for e in self._entries.values() if e is not entry and id(e) not in covered),
                          key=lambda e: e.used)
            victims = [e for e in self._entries.values() if id(e) in covered] + rest
            for e in victims:
                if id(e) not in covered and self.bytes <= self.budget:
                    break
                del self._entries[e.path.name]
                self.bytes -= e.payload_offset + e.payload_bytes
                atomic.remove(e.path)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "entries": len(self._entries), "bytes": self.bytes, "budget_bytes": self.budget,
                "hits": self.hits, "writes": self.writes, "ignored": self.ignored, "write_errors": self.write_errors,
                "checksum_errors": self.checksum_errors}


class DiskTier:
    """The disk tier as a part of the engine loop (engine thread): its :class:`DiskPrefixCache` (``store``) beside the
    in-memory prefix cache (``cache``, whose hit counters count disk hits too), for base-model KV only."""

    def __init__(self, store: DiskPrefixCache, engine: Any, cache: Any) -> None:
        self.store = store
        self.engine = engine
        self.cache = cache
        self.tokens_reused = 0

    def restore(self, seq: Any, handle: Any, n: int) -> tuple[Any, int, Any]:
        """The disk entry sharing more of ``seq``'s prompt than the in-memory hit (``handle``, ``n``) does, imported
        (the handle, its shared length, and the handle again: new, for the in-memory cache); else the in-memory hit."""
        disk = self.store
        entry, m = disk.lookup(seq.tokens, len(seq.tokens) - 1)
        if entry is None or m < n + disk.min_gain:
            return handle, n, None
        data = disk.load(entry)
        imported = None
        if data is not None:
            try:
                imported = self.engine.kv_import(tuple(int(x) for x in entry.tokens), data)
            except Exception as exc:  # noqa: BLE001 - a bad entry is a miss, never an error
                log.warning("disk prefix cache: import failed: %s", exc)
            if imported is None:
                disk.drop(entry, f"the {self.engine.name} engine could not import it")
        if imported is None:
            return handle, n, None
        if handle is not None:  # the memory hit is not used
            self.cache.restore_failed(n)
        else:
            self.cache.misses -= 1
        self.cache.hits += 1
        self.cache.tokens_reused += m
        self.tokens_reused += m
        return imported, m, imported

    def offer(self, handle: Any, n_prompt: int) -> None:
        """A finished sequence's saved KV (``handle``, ``n_prompt`` prompt tokens): written when the store wants it."""
        if not self.store.wants(handle.tokens, n_prompt):
            return
        try:
            data = self.engine.kv_export(handle)
        except Exception:  # noqa: BLE001
            log.exception("KV export failed")
            return
        if data is not None:
            self.store.save(handle.tokens, bytes(data))

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        """The writes queued so far complete."""
        self.store.close()
