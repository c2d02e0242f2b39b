"""The prefix cache's disk tier (octo.scheduler.disk_cache, ``--prefix-cache-dir``): entries written atomically and
read back
after a restart, keyed by model + engine + options, a foreign, truncated or corrupt file ignored with a log line,
the disk budget kept, an entry that a longer one extends replaced by it; and end to end through a real `octo serve`
on the echo engine (whose KV is its token list, so a restored prefix is checked exactly): a long prompt's prefix is
a hit after a restart."""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import zlib
from pathlib import Path

import pytest
from serverproc import run_octo

from octo.scheduler.disk_cache import MAGIC, DiskPrefixCache, cache_key, checksum

KEY = cache_key("echo", "1", "digest", {"n_ctx": "4096"})


def make(tmp_path, budget=1 << 30, **kw):
    return DiskPrefixCache(tmp_path, KEY, budget, min_tokens=8, min_gain=2, **kw)


def test_write_restart_read(tmp_path):
    d = make(tmp_path)
    tokens = tuple(range(100, 140))
    assert d.wants(tokens, 30)
    d.save(tokens, b"kv-bytes" * 10)
    d.flush()
    assert not d.wants(tokens, 30)  # covered now
    d.close()
    d = make(tmp_path)  # a restart: the index is read back from the files
    entry, n = d.lookup(list(tokens[:25]) + [1, 2, 3], 28)
    assert n == 25 and d.load(entry) == b"kv-bytes" * 10
    assert d.lookup(list(range(7)), 7) == (None, 0)  # shorter than min_tokens
    assert d.stats()["entries"] == 1 and d.stats()["hits"] == 1


def test_keys_keep_models_apart(tmp_path):
    d = make(tmp_path)
    d.save(tuple(range(50)), b"x" * 8)
    d.flush()
    other = DiskPrefixCache(tmp_path, cache_key("echo", "1", "digest", {"n_ctx": "8192"}), 1 << 30, min_tokens=8)
    assert other.lookup(list(range(50)), 50) == (None, 0)
    assert cache_key("llamacpp", "1", "a", {}) != cache_key("llamacpp", "2", "a", {})


def test_foreign_truncated_and_corrupt_files_are_set_aside(tmp_path, caplog):
    d = make(tmp_path)
    d.save(tuple(range(60)), b"p" * 1000)
    d.save(tuple(range(1000, 1060)), b"q" * 1000)
    d.flush()
    d.close()
    good, bad = sorted(d.dir.glob("*.kv"))
    data = bad.read_bytes()
    bad.write_bytes(data[:-10])  # truncated (a crash mid-copy, a full disk)
    (d.dir / "junk.kv").write_bytes(b"not a kv file at all")
    (d.dir / "foreign.kv").write_bytes(_file(key="x"))
    with caplog.at_level(logging.WARNING, logger="octo.scheduler.disk_cache"):
        d = make(tmp_path)
    assert d.stats()["entries"] == 1 and d.stats()["ignored"] == 3
    for why in ("truncated", "another model", "not an octo KV file"):
        assert why in caplog.text
    assert not bad.exists() and not (d.dir / "junk.kv").exists()
    assert len(list((d.dir / "quarantine").iterdir())) == 3  # moved aside, not read again
    entry, n = d.lookup(list(range(60)), 60)
    good.write_bytes(good.read_bytes()[:-1])  # damaged after the scan: a miss when read, and set aside
    assert d.load(entry) is None and d.stats()["entries"] == 0


def _file(key=KEY, n_tokens=40, payload=b"x" * 64, header=None, magic=MAGIC) -> bytes:
    raw = struct.pack(f"<{n_tokens}i", *range(n_tokens)) if n_tokens < 10**6 else b""
    if header is None:
        header = json.dumps({"key": key, "n_tokens": n_tokens, "payload_bytes": len(payload),
                             "tokens_crc": zlib.crc32(raw), "payload_check": checksum(payload)}).encode()
    return magic + struct.pack("<I", len(header)) + header + raw + payload


def hostile_files(folder: Path) -> dict[str, str]:
    """Files that once stopped `octo serve` or were read from outside the folder, by name: what the log says."""
    deep = b"[" * 200_000 + b"]" * 200_000  # 400 kB: json.loads ended the server with RecursionError
    (folder / "deep.kv").write_bytes(MAGIC + struct.pack("<I", len(deep)) + deep)
    nested = b'{"key": {"a": [[[[1]]]]}}'
    (folder / "nested.kv").write_bytes(MAGIC + struct.pack("<I", len(nested)) + nested)
    huge = json.dumps({"key": folder.name, "n_tokens": 2**40, "payload_bytes": 0, "tokens_crc": 0,
                       "payload_check": "crc32:0"}).encode()  # 220 bytes claiming 2^40 tokens: MemoryError
    (folder / "huge.kv").write_bytes(MAGIC + struct.pack("<I", len(huge)) + huge)
    typed = json.dumps({"key": folder.name, "n_tokens": "40", "payload_bytes": 0, "tokens_crc": 0,
                        "payload_check": "crc32:0"}).encode()
    (folder / "typed.kv").write_bytes(MAGIC + struct.pack("<I", len(typed)) + typed)
    outside = folder.parent / "outside-secret.kv"
    outside.write_bytes(_file(key=folder.name))
    (folder / "link.kv").symlink_to(outside)
    os.mkfifo(folder / "fifo.kv")  # a read would block forever
    (folder / "dir.kv").mkdir()
    return {"deep.kv": "bad header length", "nested.kv": "flat JSON", "huge.kv": "1099511627776 tokens",
            "typed.kv": "n_tokens is not an int", "link.kv": "symbolic link", "fifo.kv": "not a regular file",
            "dir.kv": "not a regular file"}


def test_hostile_files_are_each_set_aside_with_a_line_naming_them(tmp_path, caplog):
    d = make(tmp_path)
    d.save(tuple(range(60)), b"p" * 1000)
    d.flush()
    d.close()
    expect = hostile_files(d.dir)
    (d.dir / "old.kv").write_bytes(_file(magic=b"OCTOKV01"))
    with caplog.at_level(logging.INFO, logger="octo.scheduler.disk_cache"):
        d = make(tmp_path)
    assert d.stats()["entries"] == 1 and d.stats()["ignored"] == len(expect) + 1
    lines = caplog.text.splitlines()
    for name, why in expect.items():
        line = [x for x in lines if f"/{name}:" in x]
        assert len(line) == 1 and why in line[0] and "quarantine" in line[0], (name, line)
        assert not os.path.lexists(d.dir / name)
    assert "earlier octo" in caplog.text and not (d.dir / "old.kv").exists()  # old format: a clean miss
    assert (tmp_path / "outside-secret.kv").exists()  # the link was moved, not what it points to


def test_a_payload_over_the_budget_is_never_allocated(tmp_path, caplog):
    """A header may claim any payload size, and a sparse file may even have it: over the cache's budget the file is
    set aside at the scan, before a byte of its payload is read (a read of it would allocate that much)."""
    d = make(tmp_path, budget=1 << 20)
    d.save(tuple(range(60)), b"p" * (2 << 20))  # an entry over the budget is not even written
    d.flush()
    d.close()
    raw = struct.pack("<40i", *range(40))
    for name, claimed in (("sparse.kv", 1 << 40), ("over.kv", 2 << 20)):
        header = json.dumps({"key": KEY, "n_tokens": 40, "payload_bytes": claimed, "tokens_crc": zlib.crc32(raw),
                             "payload_check": "crc32:00000000"}).encode()
        head = MAGIC + struct.pack("<I", len(header)) + header + raw
        with open(d.dir / name, "wb") as f:
            f.write(head)
            f.truncate(len(head) + claimed)  # the size the header says: sparse, no disk used
    with caplog.at_level(logging.WARNING, logger="octo.scheduler.disk_cache"):
        d = make(tmp_path, budget=1 << 20)
    assert d.stats()["entries"] == 0 and d.stats()["ignored"] == 2
    for name, claimed in (("sparse.kv", 1 << 40), ("over.kv", 2 << 20)):
        line = [x for x in caplog.text.splitlines() if f"/{name}:" in x]
        assert len(line) == 1 and f"{claimed} payload bytes" in line[0] and "quarantine" in line[0], line
    assert d.lookup(list(range(60)), 60) == (None, 0)


def test_a_payload_that_does_not_match_its_checksum_is_a_miss(tmp_path, caplog):
    d = make(tmp_path)
    tokens = tuple(range(100, 160))
    d.save(tokens, bytes(range(256)) * 40)
    d.flush()
    (path,) = d.dir.glob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x80  # a flipped sign bit in the stored KV
    path.write_bytes(bytes(raw))
    entry, n = d.lookup(list(tokens), 60)
    assert n == 60
    with caplog.at_level(logging.WARNING, logger="octo.scheduler.disk_cache"):
        assert d.load(entry) is None
    assert "checksum" in caplog.text and str(path) in caplog.text
    assert d.stats()["checksum_errors"] == 1 and d.stats()["entries"] == 0 and not path.exists()
    assert d.lookup(list(tokens), 60) == (None, 0)


def test_an_entry_removed_meanwhile_is_a_quiet_miss(tmp_path, caplog):
    d = make(tmp_path)
    d.save(tuple(range(60)), b"p" * 100)
    d.flush()
    entry, _ = d.lookup(list(range(60)), 60)
    entry.path.unlink()  # another server sharing the folder evicted it
    with caplog.at_level(logging.WARNING, logger="octo.scheduler.disk_cache"):
        assert d.load(entry) is None
    assert d.stats()["entries"] == 0 and not caplog.text


def test_a_key_folder_that_is_a_link_is_not_used(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / KEY).symlink_to(elsewhere)
    d = DiskPrefixCache(tmp_path / "root", KEY, 1 << 30, min_tokens=8)
    assert d.dir.is_dir() and not d.dir.is_symlink() and elsewhere.exists()


def test_checksum_algorithms():
    assert checksum(b"abc").startswith("xxh3_64:") and checksum(b"abc", "crc32") == f"crc32:{zlib.crc32(b'abc'):08x}"
    assert checksum(b"abc") != checksum(b"abd")


def test_budget_and_extension(tmp_path):
    d = make(tmp_path, budget=5000)
    d.save(tuple(range(40)), b"a" * 1000)
    d.save(tuple(range(60)), b"b" * 1000)  # extends the first: it replaces it
    d.flush()
    assert d.stats()["entries"] == 1 and d.lookup(list(range(60)), 60)[1] == 60
    for k in range(6):  # unrelated entries over the budget: the least recently used go
        d.save(tuple(range(1000 * (k + 1), 1000 * (k + 1) + 40)), b"c" * 1000)
        d.flush()
        time.sleep(0.01)
    assert d.stats()["bytes"] <= 5000 and d.stats()["entries"] < 7


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_long_prefix_is_a_hit_after_a_restart(tmp_path, isolation):
    system = " ".join(f"rule{i}" for i in range(400))  # a long shared system prompt
    args = ("test-model", "--engine", "echo", "--isolation", isolation, "--prefix-cache-dir", str(tmp_path))

    def ask(server, question):
        r = server.openai().chat.completions.create(model="test-model", messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    def disk_stats(server):
        return server.get_json("/v1/cache/stats")["models"]["test-model"]["disk"]

    with run_octo(*args) as server:
        assert ask(server, "first question")[0] == 0
        deadline = time.monotonic() + 10
        while disk_stats(server)["writes"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert disk_stats(server)["writes"] == 1
    with run_octo(*args) as server:
        cached, answer = ask(server, "another question")
        assert answer == "another question"
        assert cached >= 400, cached  # the system prompt came from disk
        stats = disk_stats(server)
        assert stats["hits"] == 1 and stats["tokens_reused"] == cached
        assert ask(server, "a third one")[0] >= 400  # and now from memory
        assert disk_stats(server)["hits"] == 1


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_octo_serve_survives_hostile_and_corrupt_cache_files(tmp_path, isolation):
    """Files that once stopped `octo serve` (RecursionError, MemoryError), a link out of the folder and an entry whose
    KV was flipped on disk: the server starts, each file is set aside with a line naming it, the answer is the one
    computed afresh, and the damaged entry never reaches the memory cache."""
    system = " ".join(f"rule{i}" for i in range(300))
    args = ("test-model", "--engine", "echo", "--isolation", isolation, "--prefix-cache-dir", str(tmp_path))

    def ask(server, question):
        r = server.openai().chat.completions.create(model="test-model", temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    with run_octo(*args) as server:
        ask(server, "first question")
        deadline = time.monotonic() + 10
        while server.get_json("/v1/cache/stats")["models"]["test-model"]["disk"]["writes"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (entry,) = folder.glob("*.kv")
    raw = bytearray(entry.read_bytes())
    raw[-3] ^= 0x80  # the stored KV changed on disk: the echo engine would import it (its tokens still match)
    entry.write_bytes(bytes(raw))
    expect = hostile_files(folder)
    with run_octo(*args) as server:
        cached, answer = ask(server, "another question")
        assert answer == "another question" and cached == 0  # a miss: computed afresh
        disk = server.get_json("/v1/cache/stats")["models"]["test-model"]["disk"]
        assert disk["checksum_errors"] == 1 and disk["hits"] == 0
        log = server.log()
    for name, why in expect.items():
        assert len([x for x in log.splitlines() if f"/{name}:" in x and why in x]) == 1, (name, log[-3000:])
    assert f"{entry}: its KV payload does not match its checksum" in log
    assert "Traceback" not in log
