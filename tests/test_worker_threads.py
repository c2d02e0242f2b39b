"""A worker shares the cores between busy models with ``set_threads`` while it serves (``op_threads``), unless its
engine says a switch is a reload (``threads_switch_while_serving = False``: faster-whisper), which only the
start-up benchmark does."""

from __future__ import annotations

import asyncio

import pytest
from octo.engines.echo import EchoEngine

from octo.config import ServerConfig
from octo.engine import EngineConfig
from octo.runtime.worker import Worker


class Sender:
    def send(self, msg) -> None:
        pass


class Tunable(EchoEngine):
    def __init__(self) -> None:
        super().__init__(EngineConfig())
        self.threads, self.switches = 4, []

    def thread_counts(self) -> list[int]:
        return [self.threads] + [n for n in (4, 1) if n != self.threads]

    def set_threads(self, n: int) -> None:
        self.switches.append(n)
        self.threads = n


class Reloading(Tunable):
    threads_switch_while_serving = False


@pytest.mark.parametrize("cls", [Tunable, Reloading])
def test_threads_are_shared_while_serving_only_where_a_switch_is_cheap(cls):
    async def go():
        worker = Worker(Sender(), asyncio.get_running_loop())
        worker.engine = cls()
        worker.engine.load("", "m")
        worker.spec = {"name": "m", "artifact": ""}
        worker.op_serve(ServerConfig())
        try:
            return worker.engine, await worker.op_threads(2), await worker.op_threads(None)
        finally:
            await worker.handle.close()

    engine, limited, back = asyncio.run(go())
    if cls is Tunable:
        assert (limited, back, engine.switches) == (2, 4, [2, 4])
    else:
        assert (limited, back, engine.switches) == (None, None, [])
