"""The responses store's files (octo.serving.response_store, docs/storage.md): SQLite's WAL without shared memory
(``locking_mode=EXCLUSIVE`` before the first access), so no ``-shm`` file is ever mapped: a truncated, garbage,
immutable (``chattr +i``) or read-only ``-shm`` beside the store, left by an older octo or put there while the store
is in use, cannot bring the process down with SIGBUS (the control below shows that it does to a plain WAL
connection), and one found at start is removed with a log line. Another process sharing the store waits for an
operation instead of finding it locked for as long as a server runs."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from octo.serving.response_store import ResponseStore


def response(i: int) -> dict:
    return {"id": f"resp_{i}", "created_at": 1_900_000_000 + i, "model": "m", "output_text": f"answer {i}"}


def immutable(path) -> bool:
    """Make ``path`` immutable (``chattr +i``) where the file system and the user allow it."""
    try:
        return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    except OSError:
        return False


def mutable(path) -> None:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)


async def test_no_shm_file_is_ever_made(tmp_path):
    path = tmp_path / "responses.sqlite3"
    s = ResponseStore(path)
    await s.open()
    for i in range(20):
        await s.put(response(i), [{"role": "user", "content": str(i)}])
        assert not (tmp_path / "responses.sqlite3-shm").exists()
        assert (await s.get(f"resp_{i}"))[0]["output_text"] == f"answer {i}"
    s.close()
    assert not (tmp_path / "responses.sqlite3-shm").exists()
    db = sqlite3.connect(path)
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # write-ahead logging, without shared memory
    db.close()


@pytest.mark.parametrize("leftover", ["empty", "truncated", "garbage", "immutable", "read_only"])
async def test_a_leftover_shm_is_never_mapped(tmp_path, leftover, caplog):
    path = tmp_path / "responses.sqlite3"
    s = ResponseStore(path)
    await s.open()
    await s.put(response(1), [])
    s.close()
    shm = tmp_path / "responses.sqlite3-shm"
    shm.write_bytes({"empty": b"", "truncated": b"\x00" * 100, "garbage": os.urandom(32768)}.get(leftover, b"x" * 7))
    if leftover == "immutable" and not immutable(shm):
        pytest.skip("chattr +i is not available here")
    if leftover == "read_only":
        shm.chmod(0o444)
        tmp_path.chmod(0o555)  # (as root only an immutable file cannot be removed; the folder keeps it otherwise)
    try:
        s = ResponseStore(path)
        with caplog.at_level(logging.INFO, logger="octo.serving.response_store"):
            await s.open()
        assert s.status == "ok", s.health()
        assert (await s.get("resp_1"))[0]["output_text"] == "answer 1"
        if leftover != "read_only" or os.geteuid() != 0:
            await s.put(response(2), [])
            assert (await s.get("resp_2")) is not None
        assert str(shm) in caplog.text  # one line names it: removed, or (immutable) left and not used
        assert shm.exists() == (leftover == "immutable" or (leftover == "read_only" and os.geteuid() != 0))
        s.close()
    finally:
        tmp_path.chmod(0o755)
        mutable(shm)


SCRIPT = textwrap.dedent("""
    import asyncio, os, sqlite3, subprocess, sys
    path = sys.argv[1]
    shm = path + "-shm"

    def damage():
        open(shm, "wb").close() if not os.path.exists(shm) else os.truncate(shm, 0)
        subprocess.run(["chattr", "+i", shm], capture_output=True)

    if sys.argv[2] == "plain":  # a WAL connection with shared memory, as octo opened the store before
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS t (x)")
        db.execute("INSERT INTO t VALUES (1)")
        damage()
        for i in range(50):
            db.execute("INSERT INTO t VALUES (?)", (i,))
        print("survived")
    else:
        from octo.serving.response_store import ResponseStore

        async def main():
            s = ResponseStore(path)
            await s.open()
            await s.put({"id": "resp_0", "created_at": 1_900_000_000, "model": "m"}, [])
            damage()
            for i in range(50):
                await s.put({"id": f"resp_{i}", "created_at": 1_900_000_000 + i, "model": "m"}, [])
                assert (await s.get(f"resp_{i}")) is not None
            s.close()
            print("survived")

        asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["plain", "octo"])
def test_a_shm_truncated_while_the_store_is_in_use_cannot_kill_the_process(tmp_path, how):
    path = tmp_path / f"{how}.sqlite3"
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), how], capture_output=True, text=True,
                             timeout=120)
    finally:
        mutable(f"{path}-shm")
    if how == "plain":  # the control: SQLite's shared memory, truncated under it, is a SIGBUS
        assert out.returncode == -7, (out.returncode, out.stdout, out.stderr)
    else:
        assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stderr[-2000:])


async def test_two_processes_share_the_store_one_operation_at_a_time(tmp_path):
    path = tmp_path / "responses.sqlite3"
    a, b = ResponseStore(path), ResponseStore(path)
    await a.open()
    await b.open()
    await asyncio.gather(*(a.put(response(i), []) for i in range(10)), *(b.put(response(100 + i), [])
                                                                       for i in range(10)))
    assert (await a.get("resp_105")) is not None and (await b.get("resp_5")) is not None
    assert a.status == b.status == "ok"
    a.close()
    b.close()
