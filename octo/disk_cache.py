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
  by another model, engine build or configuration is never read. Each file starts with a header naming its key and
  sizes; a foreign, truncated or corrupt file is ignored with a log line (and removed when it carries this key, so
  it is not tried again). Entries beyond ``budget_bytes`` are removed, least recently used first.

File layout: ``MAGIC`` | u32 header length | header JSON (key, n_tokens, payload_bytes, tokens_crc) | tokens (int32
little endian) | payload (the engine's bytes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from octo import atomic

log = logging.getLogger("octo.disk_cache")

MAGIC = b"OCTOKV01"
SUFFIX = ".kv"


def cache_key(engine_name: str, engine_version: str, artifact_digest: str, options: dict[str, str]) -> str:
    """The folder of a model's entries: whatever changes the KV bytes changes it."""
    spec = json.dumps([engine_name, engine_version, artifact_digest, sorted(options.items())])
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


@dataclass
class Entry:
    path: Path
    tokens: np.ndarray  # int32
    payload_offset: int
    payload_bytes: int
    used: float  # last use (mtime), for the LRU


def _common(a: np.ndarray, b: np.ndarray) -> int:
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
        self.hits = self.writes = self.ignored = self.write_errors = 0
        self.bytes = 0
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
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
                    return self._ignore(path, "not an octo KV file", remove=False)
                (n,) = struct.unpack("<I", head[len(MAGIC):])
                if n > 1 << 20:
                    return self._ignore(path, "bad header length", remove=True)
                header = json.loads(f.read(n))
                if header.get("key") != self.key:
                    return self._ignore(path, "written for another model, engine or configuration", remove=False)
                n_tokens, payload = int(header["n_tokens"]), int(header["payload_bytes"])
                raw = f.read(4 * n_tokens)
                if len(raw) != 4 * n_tokens or zlib.crc32(raw) != int(header["tokens_crc"]):
                    return self._ignore(path, "corrupt token list", remove=True)
                offset = len(MAGIC) + 4 + n + 4 * n_tokens
                size = path.stat().st_size
                if size != offset + payload:
                    return self._ignore(path, f"truncated ({size} bytes, expected {offset + payload})", remove=True)
                return Entry(path, np.frombuffer(raw, dtype="<i4").copy(), offset, payload, path.stat().st_mtime)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._ignore(path, f"unreadable ({exc})", remove=True)

    def _ignore(self, path: Path, why: str, remove: bool) -> None:
        self.ignored += 1
        log.warning("disk prefix cache: ignoring %s: %s", path, why)
        if remove:
            atomic.remove(path)
        return None

    def lookup(self, tokens: list[int], max_len: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens[:max_len]``, and that length."""
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
        """The engine bytes of ``entry`` (None, and the entry dropped, when the file is gone or short)."""
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.payload_offset)
                data = f.read(entry.payload_bytes)
            if len(data) != entry.payload_bytes:
                raise OSError(f"read {len(data)} of {entry.payload_bytes} bytes")
            os.utime(entry.path)
            entry.used = entry.path.stat().st_mtime
            self.hits += 1
            return data
        except OSError as exc:
            self.drop(entry, f"unreadable ({exc})")
            return None

    def drop(self, entry: Entry, why: str) -> None:
        """Forget (and remove) an entry the engine could not use."""
        log.warning("disk prefix cache: dropping %s: %s", entry.path, why)
        self.ignored += 1
        with self._lock:
            if self._entries.pop(entry.path.name, None) is not None:
                self.bytes -= entry.payload_offset + entry.payload_bytes
        atomic.remove(entry.path)

    # -- writes --------------------------------------------------------------------------------------
    def wants(self, tokens: tuple[int, ...], n_prompt: int) -> bool:
        """Whether a finished sequence of ``n_prompt`` prompt tokens should be written (engine thread)."""
        if n_prompt < self.min_tokens:
            return False
        _, covered = self.lookup(list(tokens[:n_prompt]), n_prompt)
        return covered < n_prompt - self.min_gain

    def save(self, tokens: tuple[int, ...], payload: bytes) -> None:
        """Write an entry in the background."""
        self._writer.submit(self._write, np.asarray(tokens, dtype=np.int32), payload)

    def _write(self, tokens: np.ndarray, payload: bytes) -> None:
        raw = tokens.astype("<i4").tobytes()
        header = json.dumps({"key": self.key, "n_tokens": len(tokens), "payload_bytes": len(payload),
                             "tokens_crc": zlib.crc32(raw)}).encode()
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
        entry = Entry(path, tokens, offset, len(payload), path.stat().st_mtime)
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
                "hits": self.hits, "writes": self.writes, "ignored": self.ignored, "write_errors": self.write_errors}


class DiskTier:
    """Methods of the engine loop (engine thread) that use its ``disk`` (a :class:`DiskPrefixCache`) beside its
    in-memory prefix cache."""

    def _from_disk(self, seq: Any, handle: Any, n: int) -> tuple[Any, int, Any]:
        """The disk entry sharing more of ``seq``'s prompt than the in-memory hit (``handle``, ``n``) does, imported
        (the handle, its shared length, and the handle again: new, for the in-memory cache); else the in-memory hit."""
        disk = self.disk
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
        self.disk_tokens_reused += m
        return imported, m, imported

    def _to_disk(self, handle: Any, n_prompt: int) -> None:
        if not self.disk.wants(handle.tokens, n_prompt):
            return
        try:
            data = self.engine.kv_export(handle)
        except Exception:  # noqa: BLE001
            log.exception("KV export failed")
            return
        if data is not None:
            self.disk.save(handle.tokens, bytes(data))
