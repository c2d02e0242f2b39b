"""The model registry without a server: keep_alive values, models files, and the core-sharing policy."""

from __future__ import annotations

import asyncio
import os

import pytest

from octo.config import ServerConfig
from octo.errors import ConfigError, InvalidRequest
from octo.runtime.registry import Registry
from octo.runtime.specs import ModelSpec, load_models_file, parse_keep_alive


@pytest.mark.parametrize("value,seconds", [(0, 0.0), (30, 30.0), ("90", 90.0), ("10m", 600.0), ("1h30m", 5400.0),
                                           ("500ms", 0.5), (-1, None), ("-1", None), (None, None)])
def test_keep_alive_values(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "10x", "m", True, [1], {"s": 1}])
def test_bad_keep_alive_names_the_field(value):
    with pytest.raises(InvalidRequest) as e:
        parse_keep_alive(value)
    assert e.value.param == "keep_alive"


def test_models_file(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("models:\n  - demo\n  - {model: ./x.gguf, engine: llamacpp, options: {n_threads: 1}, pinned: true,"
                 " keep_alive: 10m, max_batch: 4}\n")
    a, b = load_models_file(str(f))
    assert a == ModelSpec("demo")
    assert (b.model, b.engine, b.options, b.pinned, b.keep_alive, b.max_batch) == \
        ("./x.gguf", "llamacpp", {"n_threads": "1"}, True, 600.0, 4)
    f.write_text("- {model: demo, colour: blue}\n")
    with pytest.raises(ConfigError, match="colour"):
        load_models_file(str(f))


class _Handle:
    """A loaded model in a worker, as the registry sees it (no process)."""

    isolation = "process"
    state = "ready"

    def __init__(self, name: str) -> None:
        self.name, self.aliases, self.engine_name, self.task = name, (), "llamacpp", "chat"
        self.threads_limit = None
        self.calls: list = []

    async def ensure_ready(self) -> None:
        return None

    async def limit_threads(self, n):
        self.calls.append(n)


async def test_busy_models_in_workers_split_the_cores_and_get_them_back():
    reg = Registry(ServerConfig(share_cores="os"), {})
    a, b = _Handle("a"), _Handle("b")
    reg.adopt(a)
    reg.adopt(b)
    share = max(1, (os.cpu_count() or 1) // 2)
    async with reg.use("a"):
        await asyncio.sleep(0)
        assert a.calls == [] and b.calls == []  # one busy model keeps all its threads
        async with reg.use("b"):
            await asyncio.sleep(0)
            assert a.calls == [share] and b.calls == [share]
        await asyncio.sleep(0)
        assert a.calls == [share, None] and b.calls == [share, None]  # alone again: its own count back
    reg2 = Registry(ServerConfig(share_cores="turns"), {})
    c, d = _Handle("c"), _Handle("d")
    reg2.adopt(c)
    reg2.adopt(d)
    async with reg2.use("c"), reg2.use("d"):
        await asyncio.sleep(0)
    assert c.calls == [] and d.calls == []  # turns: the arbiter shares instead


async def test_the_first_catalog_scan_waits_for_a_lull(monkeypatch):
    """(its imports hold the GIL about 0.3 s: not while requests run; 30 s after the start at the latest)"""
    import time

    from octo.runtime import registry as registry_module

    reg = Registry(ServerConfig(), {})
    slot = reg.adopt(_Handle("a"))
    scans = []
    monkeypatch.setattr(reg, "_scan_catalog", lambda: scans.append(time.monotonic()))
    now = time.monotonic()
    slot.inflight, slot.last_used = 1, now - 10  # a request runs
    reg._scan_in_a_lull(now)
    assert scans == [] and reg._scan_timer is not None
    reg._scan_timer.cancel()
    slot.inflight, slot.last_used = 0, now  # one just ended
    reg._scan_in_a_lull(now)
    assert scans == []
    reg._scan_timer.cancel()
    slot.last_used = now - registry_module.LULL_QUIET_S  # quiet for the whole lull
    reg._scan_in_a_lull(now)
    assert len(scans) == 1
    slot.inflight = 1  # busy, but the start was long ago: scanned anyway
    reg._scan_in_a_lull(now - registry_module.CATALOG_SCAN_LATEST_S)
    assert len(scans) == 2
    slot.inflight = 0
    reg._scan_timer = None
    slot.last_used = time.monotonic() - 0.7  # the timer looks again half a second later
    reg._scan_in_a_lull(time.monotonic())
    assert scans[2:] == []
    await asyncio.sleep(0.6)
    assert len(scans) == 3
