"""Stored responses (the Responses API's ``store``), in SQLite under ``OCTO_HOME`` so they survive a restart.

One row per response: its id, creation time, model, the response object as served, the conversation it ends (the
chat messages of its input, its instructions excluded as OpenAI does, followed by its output), which a later request
with ``previous_response_id`` continues, and its size. SQLite with write-ahead logging and synchronous commits: a
crash at any point leaves either the whole row or nothing. Every call runs on the store's own thread, so the event
loop never waits for the disk: ``await store.get(id)``.

- **No shared memory**: every connection sets ``locking_mode=EXCLUSIVE`` before it touches the file, so SQLite keeps
  the WAL index in the process's own memory and never maps a ``-shm`` file (a truncated or immutable ``-shm`` left
  by an older octo cannot bring the process down with SIGBUS; one found at start is removed, with a log line). A
  connection lives for one operation: another octo sharing ``OCTO_HOME`` waits for it (``BUSY_S``) instead of
  finding the store locked for as long as a server runs; closing it checkpoints and removes the ``-wal``.

- **Checked at start** (:meth:`open`): ``PRAGMA quick_check``, then a write. A file that is not a database, or a
  damaged one (pages of garbage, truncated), is moved to ``quarantine/`` beside it (with its ``-wal`` and ``-shm``
  files) with one log line, and a new store is created. A store that cannot be opened or written is *unavailable*:
  requests that need it (``store: true``, ``GET``/``DELETE``, ``previous_response_id``) get a 503
  ``store_unavailable`` naming the file, before anything is generated; every other request works, ``/health`` says
  it, and the store is tried again at most every ``RETRY_S`` seconds. Damage found later (a read that fails) is
  handled the same way: the file is set aside and recreated, and that request gets the 503.
- **Retention**, like OpenAI's: a response expires ``ttl_s`` after it was created (30 days by default; 0: never),
  and the rows are kept within ``max_bytes`` (oldest first pruned, down to 90% of it; 0: no cap).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from octo import quarantine
from octo.errors import OctoError
from octo.logsafe import quoted
from octo.paths import octo_home

log = logging.getLogger("octo.serving.response_store")

DEFAULT_TTL_S = 30 * 86400
DEFAULT_MAX_BYTES = 1 << 30
RETRY_S = 5.0  # an unavailable store is tried again at most this often
BUSY_S = 5.0  # another process's operation on the store is waited for this long
PRUNE_S = 60.0  # expired rows are deleted at most this often (reads ignore them at once)

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    model TEXT NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0
)
"""
INDEX = "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)"


class StoreUnavailable(OctoError):
    """The responses store cannot be read or written (damaged, not writable, disk full)."""

    status = 503
    type = "server_error"
    code = "store_unavailable"


class Damaged(Exception):
    """The store's file is not a usable SQLite database (the message says why)."""


def is_damage(exc: sqlite3.Error) -> bool:
    """Whether a SQLite error means the file itself is bad (not a database, corrupt), rather than that it cannot be
    reached now (locked, read-only, disk full, I/O)."""
    return getattr(exc, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or (
        not isinstance(exc, sqlite3.OperationalError) and isinstance(exc, sqlite3.DatabaseError))


class ResponseStore:
    def __init__(self, path: str | Path | None = None, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path) if path is not None else octo_home() / "responses.sqlite3"
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="octo-store")
        self._db: sqlite3.Connection | None = None
        self.status = "unopened"  # ok | unavailable (read from the event loop: plain attributes)
        self.reason: str | None = None
        self.bytes = 0  # the rows' sizes (response + conversation JSON)
        self.pruned = 0  # rows deleted by retention (expired or over the cap)
        self.set_aside = 0  # damaged files moved to quarantine/
        self._tried = 0.0  # monotonic time of the last open
        self._pruned_at = 0.0

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- operations (awaitable) -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Open and check the store on its thread (at server start; requests queue behind it). Never raises: a bad
        store is ``unavailable``."""
        self._executor.submit(self._open)

    async def open(self) -> None:
        """:meth:`start`, awaited."""
        await self._run(self._open)

    async def check_writable(self) -> None:
        """Raise :class:`StoreUnavailable` when a response could not be stored now (before generating it)."""
        if self.status != "ok":
            await self._run(self._usable)
        if self.status != "ok":
            raise self.unavailable()

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        await self._run(self._op, self._put, response, conversation)

    async def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response object, its conversation), or None when no response has that id (or it expired)."""
        return await self._run(self._op, self._get, rid)

    async def delete(self, rid: str) -> bool:
        return await self._run(self._op, self._delete, rid)

    def unavailable(self) -> StoreUnavailable:
        return StoreUnavailable(f"The responses store {self.path} is unavailable: {self.reason}. Requests with "
                                "store: false work; the store is tried again every few seconds.", param="store")

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "path": str(self.path)}
        if self.reason:
            out["reason"] = self.reason
        return out

    def close(self) -> None:
        self._executor.submit(self._close).result()
        self._executor.shutdown(wait=True)

    # -- on the store thread: opening, checking, setting aside ---------------------------------------------------
    def _close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None

    def _open(self) -> None:
        self._close()
        self._tried = time.monotonic()
        try:
            try:
                self._db = self._connect()
            except Damaged as exc:
                self._set_aside(str(exc))
                self._db = self._connect()
            self._prune(force=True)
        except (Damaged, sqlite3.Error, OSError) as exc:
            self._close()
            self.status, self.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            log.warning("responses store %s is unavailable (%s); store: true requests get 503 store_unavailable",
                        quoted(self.path), self.reason)
            return
        self.status, self.reason = "ok", None
        self._close()  # (each operation opens its own: :meth:`_session`)

    def _session(self) -> sqlite3.Connection:
        """A connection for one operation, holding the file exclusively until it closes: no ``-shm`` is ever mapped."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_S)
        try:
            db.execute("PRAGMA locking_mode=EXCLUSIVE")  # before the first access of the file
            db.execute("PRAGMA synchronous=FULL")
        except BaseException:
            db.close()
            raise
        return db

    def _connect(self) -> sqlite3.Connection:
        """A checked, writable connection; :class:`Damaged` when the file is not a sound database."""
        db = None
        try:
            db = self._session()
            row = db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as exc:
            if db is not None:
                db.close()
            if is_damage(exc):
                raise Damaged(f"not a sound SQLite database ({exc})") from None
            raise
        try:
            if row is None or row[0] != "ok":
                raise Damaged(f"PRAGMA quick_check found damage ({row[0] if row else 'no answer'})")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(SCHEMA)
            if "size" not in {r[1] for r in db.execute("PRAGMA table_info(responses)")}:  # a store of an earlier octo
                db.execute("ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
                db.execute("UPDATE responses SET size = length(CAST(response AS BLOB)) + "
                           "length(CAST(conversation AS BLOB))")
            db.execute(INDEX)
            db.execute("PRAGMA user_version = 1")  # a write: a store that cannot be written is found now
            self.bytes = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        except BaseException:
            db.close()
            raise
        self._drop_shm()
        return db

    def _drop_shm(self) -> None:
        """A ``-shm`` beside the store is an older octo's (this one holds the file exclusively and maps none): removed,
        or named in the log when it cannot be (an immutable file); it is never read either way."""
        shm = self.path.with_name(self.path.name + "-shm")
        if not os.path.lexists(shm):
            return
        try:
            shm.unlink()
            log.info("responses store: removed %s, left by an octo that kept shared memory", quoted(shm))
        except OSError as exc:
            log.warning("responses store: %s cannot be removed (%s); it is not used", quoted(shm), exc)

    def _set_aside(self, why: str) -> None:
        self._close()
        self.set_aside += 1
        quarantine.move_aside(self.path, f"{why}; a new store is created", log, keep=4,
                              what="responses store")
        for suffix in ("-wal", "-shm", "-journal"):  # never replayed into the new store
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                quarantine.move_aside(side, "beside a damaged store", log, keep=4, what="responses store file")

    def _usable(self) -> bool:
        if self.status != "ok" and time.monotonic() - self._tried >= RETRY_S:
            self._open()
        return self.status == "ok"

    def _op(self, fn: Any, *args: Any) -> Any:
        """``fn(db, *args)``, with the store's failures as :class:`StoreUnavailable` (a damaged file set aside and
        recreated first)."""
        if not self._usable():
            raise self.unavailable()
        try:
            return self._attempts(fn, *args)
        except sqlite3.Error as exc:
            if is_damage(exc):
                self._set_aside(f"damaged ({exc})")
                self._open()
                raise StoreUnavailable(f"The responses store {self.path} was damaged ({exc}); it was moved aside and "
                                       "a new one created, so stored responses before now are gone.",
                                       param="store") from None
            self.status, self.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            self._tried = time.monotonic()  # (a disk that is full: not tried again by the very next request)
            self._close()
            log.warning("responses store %s: %s", quoted(self.path), self.reason)
            raise self.unavailable() from None
        finally:
            self._close()

    def _attempts(self, fn: Any, *args: Any) -> Any:
        """``fn`` in a session of its own, again while the file stays locked by another process, up to ``BUSY_S``:
        SQLite's busy handler waits for most locks, but an operation that meets another's connection opening or
        closing the file in exclusive mode can get "database is locked" at once (seen once in 2,500 tests: 20 writes
        from two stores). Every operation is a whole transaction, so trying it again is safe."""
        deadline = time.monotonic() + BUSY_S
        while True:
            try:
                self._db = self._session()
                return fn(self._db, *args)
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                self._close()
                time.sleep(0.02)

    # -- on the store thread: rows --------------------------------------------------------------------------------
    def _put(self, db: sqlite3.Connection, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        body, conv = json.dumps(response, ensure_ascii=False), json.dumps(conversation, ensure_ascii=False)
        size = len(body.encode()) + len(conv.encode())
        db.execute("BEGIN IMMEDIATE")
        try:
            old = db.execute("SELECT size FROM responses WHERE id = ?", (response["id"],)).fetchone()
            db.execute("INSERT OR REPLACE INTO responses (id, created_at, model, response, conversation, size) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (response["id"], int(response.get("created_at") or time.time()), response.get("model") or "",
                        body, conv, size))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self.bytes += size - (old[0] if old else 0)
        self._prune()

    def _get(self, db: sqlite3.Connection, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        row = db.execute("SELECT response, conversation FROM responses WHERE id = ? AND created_at >= ?",
                         (rid, self._oldest())).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row else None

    def _delete(self, db: sqlite3.Connection, rid: str) -> bool:
        row = db.execute("SELECT size FROM responses WHERE id = ? AND created_at >= ?",
                         (rid, self._oldest())).fetchone()
        if row is None:
            return False
        db.execute("DELETE FROM responses WHERE id = ?", (rid,))
        self.bytes -= row[0]
        return True

    def _oldest(self) -> int:
        """The creation time of the oldest response not expired."""
        return int(time.time() - self.ttl_s) if self.ttl_s > 0 else -(1 << 62)

    def _prune(self, force: bool = False) -> None:
        """Delete expired rows (at most every ``PRUNE_S``) and, over the size cap, the oldest down to 90% of it."""
        db = self._db
        if db is None:
            return
        now = time.monotonic()
        if self.ttl_s > 0 and (force or now - self._pruned_at >= PRUNE_S):
            self._pruned_at = now
            self._delete_where("created_at < ?", (self._oldest(),))
        if self.max_bytes > 0 and self.bytes > self.max_bytes:
            target, freed, cut = int(self.max_bytes * 0.9), 0, None
            for created, rowid, size in db.execute("SELECT created_at, rowid, size FROM responses "
                                                   "ORDER BY created_at, rowid"):
                freed += size
                cut = (created, rowid)
                if self.bytes - freed <= target:
                    break
            if cut is not None:
                self._delete_where("created_at < ? OR (created_at = ? AND rowid <= ?)", (cut[0], cut[0], cut[1]))

    def _delete_where(self, where: str, args: tuple) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            n, size = db.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses WHERE {where}",
                                 args).fetchone()
            if n:
                db.execute(f"DELETE FROM responses WHERE {where}", args)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        if n:
            self.bytes -= size
            self.pruned += n
            log.info("responses store: %d responses pruned (expired or over the size cap), %.1f MB left", n,
                     self.bytes / 2**20)
