"""The responses store (octo.serving.response_store): checked at open (PRAGMA quick_check and a write), a damaged file
(garbage pages,
truncated, not a database) moved to quarantine/ with its -wal/-shm and recreated, a store that cannot be opened
unavailable (503 store_unavailable) and tried again, damage found while running handled the same way, retention
(expiry and a size cap, oldest first), and durations for --responses-ttl."""

from __future__ import annotations

import logging
import sqlite3
import time

import pytest

from octo.options import parse_duration
from octo.serving import response_store as store_mod
from octo.serving.response_store import ResponseStore, StoreUnavailable


def response(i: int, created: int | None = None, size: int = 10) -> dict:
    return {"id": f"resp_{i}", "created_at": created or int(time.time()), "model": "m", "output_text": "x" * size}


async def filled(path, n=20, **kw) -> ResponseStore:
    s = ResponseStore(path, **kw)
    await s.open()
    for i in range(n):
        await s.put(response(i, size=200), [{"role": "user", "content": f"turn {i}"}])
    return s


def garbage_pages(path):
    data = bytearray(path.read_bytes())
    data[4096:12288] = b"\xa5" * 8192  # pages of garbage in the middle
    path.write_bytes(bytes(data))


def truncated(path):
    path.write_bytes(path.read_bytes()[:5000])


def not_a_database(path):
    path.write_bytes(b"this is not a database " * 100)


@pytest.mark.parametrize("damage", [garbage_pages, truncated, not_a_database])
async def test_a_damaged_store_is_moved_aside_and_recreated(tmp_path, damage, caplog):
    path = tmp_path / "responses.sqlite3"
    s = await filled(path, 60)
    s.close()
    damage(path)
    s = ResponseStore(path)
    with caplog.at_level(logging.WARNING, logger="octo.serving.response_store"):
        await s.open()
    assert s.status == "ok" and s.set_aside == 1, s.health()
    moved = list((tmp_path / "quarantine").iterdir())
    assert any(p.name.startswith("responses.sqlite3.") for p in moved)
    assert str(path) in caplog.text and "a new store is created" in caplog.text
    await s.put(response(1), [])
    assert (await s.get("resp_1"))[0]["id"] == "resp_1"
    s.close()


async def test_the_wal_of_a_damaged_store_is_not_replayed_into_the_new_one(tmp_path):
    path = tmp_path / "responses.sqlite3"
    (tmp_path / "responses.sqlite3-wal").write_bytes(b"stale wal")
    not_a_database(path)
    s = ResponseStore(path)
    await s.open()
    wal = tmp_path / "responses.sqlite3-wal"  # (gone once the store's connection closed: it checkpoints)
    assert s.status == "ok" and (not wal.exists() or not wal.read_bytes().startswith(b"stale"))
    names = sorted(p.name.split(".")[1] for p in (tmp_path / "quarantine").iterdir())
    assert names[0] == "sqlite3"  # (SQLite itself may have dropped the stale -wal when the damaged file was closed)
    s.close()


async def test_a_store_that_cannot_be_opened_is_unavailable_and_tried_again(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "RETRY_S", 0.2)
    path = tmp_path / "responses.sqlite3"
    path.mkdir()  # cannot be opened as a file (as root, a read-only file is still writable)
    s = ResponseStore(path)
    await s.open()
    assert s.status == "unavailable" and s.health()["path"] == str(path) and s.health()["reason"]
    for call in (s.check_writable(), s.get("resp_1"), s.delete("resp_1"), s.put(response(1), [])):
        with pytest.raises(StoreUnavailable) as info:
            await call
        assert info.value.status == 503 and info.value.code == "store_unavailable" and str(path) in info.value.message
    path.rmdir()
    time.sleep(0.25)
    await s.check_writable()  # tried again: it works now
    assert s.status == "ok" and s.health() == {"status": "ok", "path": str(path)}
    s.close()


async def test_damage_found_while_running_is_a_503_then_a_new_store(tmp_path):
    path = tmp_path / "responses.sqlite3"
    s = await filled(path, 60)

    def corrupt(db, *_):
        raise sqlite3.DatabaseError("database disk image is malformed")

    with pytest.raises(StoreUnavailable) as info:
        await s._run(s._op, corrupt)
    assert "moved aside" in info.value.message and str(path) in info.value.message
    assert s.status == "ok" and s.set_aside == 1 and await s.get("resp_1") is None
    s.close()


async def test_expired_responses_are_not_served_and_are_pruned(tmp_path):
    path = tmp_path / "responses.sqlite3"
    s = ResponseStore(path, ttl_s=3600)
    await s.open()
    old = int(time.time()) - 7200
    await s.put(response(1, created=old), [])
    await s.put(response(2), [])
    assert await s.get("resp_1") is None and not await s.delete("resp_1")
    assert (await s.get("resp_2"))[0]["id"] == "resp_2"
    s.close()
    s = ResponseStore(path, ttl_s=3600)
    await s.open()  # pruned at open
    assert s.pruned == 1
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1
    s.close()


async def test_the_size_cap_prunes_the_oldest_first(tmp_path):
    path = tmp_path / "responses.sqlite3"
    s = await filled(path, 40, max_bytes=4000)
    assert s.bytes <= 4000 and s.pruned > 0
    assert await s.get("resp_0") is None and (await s.get("resp_39")) is not None
    kept = [i for i in range(40) if await s.get(f"resp_{i}") is not None]
    assert kept == list(range(kept[0], 40))  # the newest, in a row
    s.close()
    s = ResponseStore(path, max_bytes=4000)
    await s.open()
    assert 0 < s.bytes <= 4000  # the rows' sizes are counted again at open
    s.close()


async def test_a_store_of_an_earlier_octo_gets_its_sizes(tmp_path):
    path = tmp_path / "responses.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, model TEXT NOT NULL, "
               "response TEXT NOT NULL, conversation TEXT NOT NULL)")
    db.execute("INSERT INTO responses VALUES ('resp_old', ?, 'm', '{\"id\": \"resp_old\"}', '[]')", (int(time.time()),))
    db.commit()
    db.close()
    s = ResponseStore(path)
    await s.open()
    assert s.status == "ok" and s.bytes == len('{"id": "resp_old"}') + 2
    assert (await s.get("resp_old"))[0] == {"id": "resp_old"}
    s.close()


def test_durations():
    assert parse_duration("30d") == 30 * 86400 and parse_duration("1d12h") == 1.5 * 86400
    assert parse_duration("90") == 90 and parse_duration("0") == 0
    for bad in ("-1", "soon", "inf", "3w"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# -- the store failing while a response runs (in-process app: the disk fails at the SQLite boundary) ---------------
@pytest.fixture
def failing_disk(monkeypatch):
    def put(self, db, response, conversation):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(ResponseStore, "_put", put)


@pytest.fixture
async def app_client(aiohttp_client, tmp_path, monkeypatch):
    from octo.engines.echo import EchoEngine

    from octo.config import ServerConfig
    from octo.engine import EngineConfig
    from octo.runtime.model import ModelHandle
    from octo.server.app import create_app

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    engine = EchoEngine(EngineConfig())
    engine.load("m", "m")
    return await aiohttp_client(create_app(ServerConfig(model="m"), ModelHandle("m", (), "echo", engine, "x")))


async def test_a_store_that_fails_after_the_check_ends_the_response_clearly(app_client, failing_disk):
    body = {"model": "m", "input": "one two three"}
    r = await app_client.post("/v1/responses", json=body)
    err = (await r.json())["error"]
    assert r.status == 503 and err["code"] == "store_unavailable" and "disk I/O error" in err["message"]
    r = await app_client.post("/v1/responses", json={**body, "stream": True})  # unavailable now: before generating
    assert r.status == 503
    r = await app_client.post("/v1/responses", json={**body, "store": False})
    assert r.status == 200 and (await r.json())["output"][0]["content"][0]["text"] == "one two three"
    health = await (await app_client.get("/health")).json()
    assert health["status"] == "degraded" and health["responses_store"]["status"] == "unavailable"


async def test_a_stream_whose_response_cannot_be_stored_ends_failed(app_client, failing_disk):
    r = await app_client.post("/v1/responses", json={"model": "m", "input": "one two three", "stream": True})
    assert r.status == 200
    text = await r.text()
    assert "response.failed" in text and "store_unavailable" in text and "response.completed" not in text
