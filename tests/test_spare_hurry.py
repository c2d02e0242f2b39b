"""A load on its way to take the spare worker starts a replacement that still waits out its delay at once
(octo.runtime.process.SpareWorker.hurry): back-to-back model switches find the new spare's imports under way."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest


async def _until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


@contextlib.asynccontextmanager
async def _echo_spare(taken: list, **enable):
    """A SpareWorker that prepares the echo engine, enabled and with its first spare up; it and the workers the test
    took (``taken``) are stopped afterwards."""
    from octo.runtime import process

    spare = process.SpareWorker()
    spare.note("echo", None)
    try:
        await spare.enable(10.0, None, delay=0.0, **enable)
        assert await _until(lambda: spare.worker is not None, 60)
        yield spare
    finally:
        await spare.close()
        for w in taken:
            if w is not None:
                await w.stop()


@pytest.mark.parametrize("hurried", [False, True])
async def test_a_waiting_replacement_starts_at_once_when_hurried(monkeypatch, hurried):
    from octo.runtime import process

    monkeypatch.setattr(process, "REPLACE_DELAY_S", 30.0)  # without hurry(): no replacement for 30 s
    taken: list = []
    async with _echo_spare(taken) as spare:
        taken.append(await spare.take(10.0))
        assert taken[0] is not None and taken[0].alive and spare.worker is None
        if hurried:
            spare.hurry()
        started = await _until(lambda: spare.worker is not None, 20)
        assert started == hurried
        if hurried:
            assert spare.worker.pid != taken[0].pid and spare.worker.alive


async def test_a_take_while_the_replacement_waits_gets_it_and_the_next_one_is_on_its_way(monkeypatch):
    """Back-to-back switches: the second take finds the replacement still waiting out its delay; it starts it and
    takes it, and a replacement for that one is scheduled (it was not: the waiting task was cancelled, and a task
    being cancelled is not done yet, so no new one was made)."""
    from octo.runtime import process

    monkeypatch.setattr(process, "REPLACE_DELAY_S", 30.0)
    taken: list = []
    async with _echo_spare(taken) as spare:
        taken.append(await spare.take(10.0))
        taken.append(await spare.take(10.0))  # the replacement, started now rather than in 30 s
        assert all(w is not None and w.alive for w in taken) and taken[0].pid != taken[1].pid
        spare.hurry()  # the next replacement is scheduled: it starts
        assert await _until(lambda: spare.worker is not None, 20)
        assert spare.worker.pid not in {w.pid for w in taken}


async def test_a_replacement_waits_for_a_lull_in_the_requests(monkeypatch):
    """A taken spare's replacement starts after its delay only in a lull (no request running): its interpreter start
    and imports do not take a core from a stream. ``hurry()`` (a load on its way) starts it in a busy moment too, and
    a gateway that is never idle gets it after ``LULL_WAIT_S``."""
    from octo.runtime import process

    monkeypatch.setattr(process, "REPLACE_DELAY_S", 0.1)
    busy = [True]
    taken: list = []
    async with _echo_spare(taken, lull=lambda: not busy[0]) as spare:  # (no delay: the first spare starts at once)
        taken.append(await spare.take(10.0))
        assert not await _until(lambda: spare.worker is not None, 1.5)  # requests run: it waits
        busy[0] = False  # the lull
        assert await _until(lambda: spare.worker is not None, 20)
        busy[0] = True
        taken.append(await spare.take(10.0))
        assert not await _until(lambda: spare.worker is not None, 1.0)
        spare.hurry()  # a load needs it: busy or not
        assert await _until(lambda: spare.worker is not None, 20)
        monkeypatch.setattr(process, "LULL_WAIT_S", 0.5)
        taken.append(await spare.take(10.0))
        assert await _until(lambda: spare.worker is not None, 20)  # never idle: it starts after LULL_WAIT_S
        assert len({w.pid for w in [*taken, spare.worker]}) == 4


async def test_a_spare_prepared_for_one_engine_alone_serves_only_that_engine():
    """A spare whose preload named one engine (Engine.prepare_own_process: MLX hides torch there) is not given to a
    load of another engine, which starts a worker of its own, and stays the spare; one that prepared several engines
    takes any. The worker itself refuses a load of another engine too."""
    from octo.config import ServerConfig

    taken: list = []
    async with _echo_spare(taken) as spare:
        assert spare.worker.preloaded == ("echo",)
        kept = spare.worker
        assert await spare.take(10.0, "llamacpp") is None and spare.worker is kept  # stays for an echo load
        spec = {"engine": "upper", "artifact": "x", "name": "x", "config": ServerConfig(), "plugins_dir": None,
                "warmup": False}
        with pytest.raises(Exception, match="prepared for echo alone, not upper"):
            await kept.request("load", spec)
        taken.append(await spare.take(10.0, "echo"))
        assert taken[0] is kept
        spare.note("upper", None)  # the next spare prepares both: any engine may take it
        spare.hurry()
        assert await _until(lambda: spare.worker is not None, 60)
        assert spare.worker.preloaded == ("echo", "upper") and spare.worker.may_take("llamacpp")
        taken.append(await spare.take(10.0, "llamacpp"))
        assert taken[-1] is not None
