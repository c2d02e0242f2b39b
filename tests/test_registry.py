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
