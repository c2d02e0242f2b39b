"""Stored responses (the Responses API's ``store``), in SQLite under ``OCTO_HOME`` so they survive a restart.

One row per response: its id, creation time, model, the response object as served, and the conversation it ends
(the chat messages of its input, its instructions excluded as OpenAI does, followed by its output), which a later
request with ``previous_response_id`` continues. SQLite with write-ahead logging and synchronous commits: a crash at
any point leaves either the whole row or nothing. Every call runs on the store's own thread (one connection), so the
event loop never waits for the disk: ``await store.get(id)``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from octo.paths import octo_home

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    model TEXT NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
)
"""


class ResponseStore:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else octo_home() / "responses.sqlite3"
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="octo-store")
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(SCHEMA)
            self._db = db
        return self._db

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- operations (awaitable) -----------------------------------------------------------------------------------
    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        await self._run(self._put, response, conversation)

    async def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response object, its conversation), or None when no response has that id."""
        return await self._run(self._get, rid)

    async def delete(self, rid: str) -> bool:
        return await self._run(self._delete, rid)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        self._executor.submit(shut).result()
        self._executor.shutdown(wait=True)

    # -- on the store thread --------------------------------------------------------------------------------------
    def _put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._conn().execute(
            "INSERT OR REPLACE INTO responses (id, created_at, model, response, conversation) VALUES (?, ?, ?, ?, ?)",
            (response["id"], int(response.get("created_at") or time.time()), response.get("model") or "",
             json.dumps(response, ensure_ascii=False), json.dumps(conversation, ensure_ascii=False)))

    def _get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        row = self._conn().execute("SELECT response, conversation FROM responses WHERE id = ?", (rid,)).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row else None

    def _delete(self, rid: str) -> bool:
        return self._conn().execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0
