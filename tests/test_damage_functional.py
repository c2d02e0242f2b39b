"""No file on disk stops the server (docs/storage.md, docs/security.md "Files on disk"): a real `octo serve` with
streams running while every file octo keeps is damaged under it: the responses store (the database pages, a garbage
``-wal``, a truncated and immutable ``-shm``), a prefix-cache entry on disk (its KV flipped, a FIFO beside it), both
``quarantine/`` folders (replaced by plain files, so a bad file cannot even be moved), the record of pulls and the
benchmark caches (garbage, a wrong shape, a FIFO that would block a reader for ever). The streams complete, every
request after the damage is answered (one store request may be the 503 that says the store was set aside), each bad
file is named in one log line and set aside, and the process is never killed (no SIGBUS)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from serverproc import REPO, run_octo

openai = pytest.importorskip("openai")
PLUGINS = str(REPO / "tests" / "plugins")
SYSTEM = " ".join(f"rule{i}" for i in range(300))  # a long shared prefix: kept on disk


def timed_catalog(tmp_path: Path) -> str:
    """A catalog model that two test engines can serve: loading it reads and writes the benchmark caches."""
    path = tmp_path / "timed.yaml"
    path.write_text("models:\n  - id: timed-model\n    task: chat\n    default_variant: default\n    variants:\n"
                    "      default:\n        slowone: none://timed\n        fastone: none://timed\n")
    return str(path)


def stream_all(client, words: list[str], out: list) -> None:
    try:
        stream = client.chat.completions.create(model="test-model", stream=True, max_tokens=len(words) + 8,
                                                messages=[{"role": "user", "content": " ".join(words)}])
        out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    except Exception as exc:  # noqa: BLE001 - the test reports it
        out.append(exc)


def immutable(path: Path) -> bool:
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def disk_stats(server) -> dict:
    return server.get_json("/v1/cache/stats")["models"]["test-model"]["disk"]


def test_damaging_every_file_octo_keeps_while_streams_run_stops_nothing(tmp_path):
    home, cache = tmp_path / "octo", tmp_path / "pcache"
    env = {"OCTO_HOME": str(home), "OCTO_CATALOG": timed_catalog(tmp_path), "HF_HUB_OFFLINE": "1"}
    args = ("test-model", "--engine", "echo", "-o", "token_delay_ms=25", "--prefix-cache-dir", str(cache),
            "--plugins-dir", PLUGINS, "--bench-seconds", "0.2")
    shm = home / "responses.sqlite3-shm"
    try:
        with run_octo(*args, env=env) as s:
            client = s.openai(max_retries=0)  # (the long prefix first: the echo engine numbers words as it meets them)
            assert client.chat.completions.create(model="test-model", max_tokens=4, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]).choices
            kept = client.responses.create(model="test-model", input="remember the lighthouse")
            deadline = time.monotonic() + 20
            while disk_stats(s)["writes"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert client.chat.completions.create(model="timed-model", max_tokens=2, messages=[
                {"role": "user", "content": "hi"}]).choices  # its load measured both engines: caches written
            assert s.post_json("/v1/models/timed-model/unload", {})[0] == 200
            (entry,) = cache.glob("*/*.kv")
            bench = sorted((home / "bench").rglob("*.json"))
            assert bench, "the load wrote no benchmark cache"

            words = [f"w{i}" for i in range(240)]  # 6 s of stream each
            outs: list = []
            streams = [threading.Thread(target=stream_all, args=(s.openai(max_retries=0), words, outs))
                       for _ in range(3)]
            for t in streams:
                t.start()
            time.sleep(0.5)
            locked = damage_store_sidecars(home, shm)
            assert client.responses.retrieve(kept.id).output_text == "remember the lighthouse"  # the rows survive
            damage_the_rest(home, entry, bench)
            answers = after_damage(s, client, kept.id)
            for t in streams:
                t.join(60)
            assert outs == [" ".join(words)] * 3, outs  # every stream whole
            assert s.proc.poll() is None
            log = s.log()
        with run_octo(*args, env=env) as s:  # the next start scans the cache folder (the FIFO is named there) ...
            client = s.openai(max_retries=0)
            r = client.chat.completions.create(model="test-model", max_tokens=4, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": "third"}])
            assert r.choices[0].message.content == "third"  # ... and reads the flipped entry: a miss, recomputed
            assert disk_stats(s)["checksum_errors"] == 1 and disk_stats(s)["hits"] == 0
            assert client.responses.retrieve(answers["stored_id"]).output_text == "after the damage"
            log += s.log()
    finally:
        subprocess.run(["chattr", "-i", str(shm)], capture_output=True)
    assert answers["chat"] == "second" and answers["delete"] == 400
    lines = log.splitlines()

    def named(path: Path, why: str) -> bool:
        return any(f"{path}" in ln and why in ln for ln in lines)

    assert named(home / "responses.sqlite3", "not a sound SQLite database") or \
        named(home / "responses.sqlite3", "damaged"), log[-4000:]
    assert named(home / "responses.sqlite3", f"could not move it aside: [Errno 17] File exists: '{home}/quarantine'")
    assert named(entry, "does not match its checksum")  # (removed: then written afresh by the recomputed prompt)
    assert named(entry.parent / "fifo.kv", "not a regular file") and not (entry.parent / "fifo.kv").exists()
    assert named(home / "pulled.json", "not JSON") and not (home / "pulled.json").exists()
    for path in [*bench, home / "bench" / "zz-fifo.json"]:
        assert named(path, "benchmark cache") or named(path, "engine choice cache"), (path, log[-4000:])
    if locked:  # an immutable -shm can be neither moved nor removed: named, and never used
        assert named(shm, "cannot be removed") or named(shm, "could neither move nor remove it")
    assert "Traceback" not in log and "Bus error" not in log


def damage_store_sidecars(home: Path, shm: Path) -> bool:
    (home / "responses.sqlite3-wal").write_bytes(os.urandom(4096))  # SQLite's frame checksums discard it
    shm.write_bytes(b"\0" * 100)  # truncated: a mapped -shm would be a SIGBUS
    return immutable(shm)


def damage_the_rest(home: Path, entry: Path, bench: list[Path]) -> None:
    data = bytearray((home / "responses.sqlite3").read_bytes())
    data[:] = b"\xa5" * len(data)  # every page, the header too
    (home / "responses.sqlite3").write_bytes(bytes(data))
    raw = bytearray(entry.read_bytes())
    raw[-3] ^= 0x80  # the stored KV changed on disk
    entry.write_bytes(bytes(raw))
    os.mkfifo(entry.parent / "fifo.kv")  # (read only at a scan; named at the next start)
    for folder in (home / "quarantine", entry.parent / "quarantine"):  # nowhere to move a bad file to
        if folder.is_dir():
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()
        folder.write_text("not a folder")
    (home / "pulled.json").write_text("{not json")
    for i, path in enumerate(bench):
        path.write_text(["{", json.dumps({"key": {}, "result": [1]}), json.dumps([1, 2])][i % 3])
    os.mkfifo(home / "bench" / "zz-fifo.json")  # a reader without O_NONBLOCK would wait for a writer for ever


def after_damage(s, client, kept_id: str) -> dict:
    """Requests that read each damaged file, while the streams still run."""
    out = {}
    try:  # the first store request after the damage may be the 503 that says the store was set aside
        client.responses.retrieve(kept_id)
    except (openai.InternalServerError, openai.NotFoundError):
        pass
    stored = client.responses.create(model="test-model", input="after the damage")
    out["stored_id"] = stored.id
    out["stored"] = client.responses.retrieve(stored.id).output_text
    r = client.chat.completions.create(model="test-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "second"}])
    out["chat"] = r.choices[0].message.content  # (the long prefix is read from disk at the next start only)
    out["delete"] = _delete(s, "timed-model:latest")[0]  # reads the record of pulls: garbage, set aside
    assert client.chat.completions.create(model="timed-model", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}]).choices  # its load reads the damaged benchmark caches
    return out


def _delete(s, model: str) -> tuple[int, dict]:
    import urllib.request

    req = urllib.request.Request(s.url("/api/delete"), json.dumps({"model": model}).encode(),
                                 {"Content-Type": "application/json"}, method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
