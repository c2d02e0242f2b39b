"""The prefix cache's disk tier (octo.disk_cache, ``--prefix-cache-dir``): entries written atomically and read back
after a restart, keyed by model + engine + options, a foreign, truncated or corrupt file ignored with a log line,
the disk budget kept, an entry that a longer one extends replaced by it; and end to end through a real `octo serve`
on the echo engine (whose KV is its token list, so a restored prefix is checked exactly): a long prompt's prefix is
a hit after a restart."""

from __future__ import annotations

import logging
import time

import pytest
from serverproc import run_octo

from octo.disk_cache import MAGIC, DiskPrefixCache, cache_key

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


def test_foreign_truncated_and_corrupt_files_are_ignored(tmp_path, caplog):
    d = make(tmp_path)
    d.save(tuple(range(60)), b"p" * 1000)
    d.save(tuple(range(1000, 1060)), b"q" * 1000)
    d.flush()
    d.close()
    good, bad = sorted(d.dir.glob("*.kv"))
    data = bad.read_bytes()
    bad.write_bytes(data[:-10])  # truncated (a crash mid-copy, a full disk)
    (d.dir / "junk.kv").write_bytes(b"not a kv file at all")
    (d.dir / "foreign.kv").write_bytes(MAGIC + b"\x0b\x00\x00\x00" + b'{"key":"x"}')
    with caplog.at_level(logging.WARNING, logger="octo.disk_cache"):
        d = make(tmp_path)
    assert d.stats()["entries"] == 1 and d.stats()["ignored"] == 3
    assert "truncated" in caplog.text and "another model" in caplog.text and "not an octo KV file" in caplog.text
    assert not bad.exists() and (d.dir / "junk.kv").exists()  # its own broken entry removed, others' files left
    entry, n = d.lookup(list(range(60)), 60)
    good.write_bytes(good.read_bytes()[:-1])  # damaged after the scan: a miss when read, and dropped
    assert d.load(entry) is None and d.stats()["entries"] == 0


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
