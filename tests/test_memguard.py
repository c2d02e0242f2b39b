"""octo.runtime.memguard: when a model may load beside others (functional side: test_security_functional.py)."""

from __future__ import annotations

import struct

from octo.config import ServerConfig
from octo.runtime.memguard import available, gguf_kv_bytes, meminfo, model_bytes, no_room

GB = 2**30


def test_the_default_stops_at_the_count_and_at_available_memory():
    c = ServerConfig()  # --max-loaded and --memory-budget not given
    assert no_room(c, 3, 1, False, [1, 1]) == ("", True)
    why, possible = no_room(c, 3, 1, False, [1, 1, 1])
    assert "--max-loaded 3" in why and possible
    room = available()
    assert room is not None and meminfo()["MemTotal"] > room[1] >= room[0]
    big = room[0] + 8 * GB  # (8 GB beyond what is available now: other processes come and go meanwhile)
    why, possible = no_room(c, 3, big, False, [])
    assert "available" in why and not possible  # cannot fit even alone
    why, possible = no_room(c, 3, big, False, [16 * GB])
    assert why and possible  # fits once the other model is unloaded
    assert no_room(c, 3, big, True, []) == ("", True)  # a model named at start is the operator's call


def test_explicit_zero_means_no_limit_and_an_explicit_budget_replaces_the_memory_check():
    unlimited = ServerConfig(max_loaded=0, memory_budget_gb=0)
    assert no_room(unlimited, 0, 10**15, False, [GB] * 50) == ("", True)
    budget = ServerConfig(memory_budget_gb=2)
    assert no_room(budget, 0, GB, False, [GB // 2]) == ("", True)
    why, possible = no_room(budget, 0, GB, False, [GB, GB // 2])
    assert "--memory-budget 2 GB" in why and possible
    assert not no_room(budget, 0, 3 * GB, False, [])[1]  # bigger than the budget: never
    assert no_room(budget, 0, 3 * GB, True, []) == ("", True)  # named at start: loads alone


def test_a_gguf_estimate_counts_its_kv_cache(tmp_path):
    from octo.synth.gguf import build_gguf

    path = build_gguf("tiny", ftype="q8_0")
    kv = gguf_kv_bytes(path)
    assert kv > 0 and model_bytes(path) == path.stat().st_size + kv
    assert gguf_kv_bytes(path, n_ctx=10**6) > kv
    data = bytearray(path.read_bytes())
    at = data.index(b"context_length") + len(b"context_length")
    struct.pack_into("<I", data, at + 4, struct.unpack_from("<I", data, at + 4)[0] * 2)
    doubled = tmp_path / "doubled.gguf"
    doubled.write_bytes(bytes(data))
    assert gguf_kv_bytes(doubled) == 2 * kv
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    assert gguf_kv_bytes(tmp_path / "bad.gguf") == 0
