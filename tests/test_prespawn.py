"""The first load's hand-off wakes `octo serve`'s wait for it (octo.runtime.prespawn.Signal, octo.cli.startup)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from octo.cli import startup
from octo.runtime import prespawn


def test_a_signal_is_an_event_that_calls_back_once_from_the_thread_that_sets_it():
    sig = prespawn.Signal()
    seen: list[str] = []
    sig.add_callback(lambda: seen.append(threading.current_thread().name))

    def removed() -> None:
        seen.append("removed")

    sig.add_callback(removed)
    sig.remove_callback(removed)
    t = threading.Thread(target=sig.set, name="setter")
    t.start()
    t.join()
    assert sig.is_set() and sig.wait(0) and seen == ["setter"]
    sig.set()
    assert seen == ["setter"]  # once
    sig.add_callback(lambda: seen.append("late"))  # already set: called at once
    assert seen == ["setter", "late"]


@pytest.fixture
def signal(monkeypatch):
    sig = prespawn.Signal()
    monkeypatch.setattr(prespawn, "LOAD_HANDED_OVER", sig)
    return sig


def test_the_wait_wakes_when_the_load_is_handed_over_from_any_thread(signal):
    async def main():
        starting = asyncio.get_running_loop().create_task(asyncio.sleep(30))
        threading.Timer(0.3, signal.set).start()
        t0 = time.monotonic()
        await startup.until_loading(starting, limit=20.0)
        took = time.monotonic() - t0
        assert not starting.done()
        starting.cancel()
        return took

    took = asyncio.run(main())
    assert 0.25 <= took < 10, took  # woken by the hand-off (generous: a busy host), not by the 20 s limit


def test_a_wait_that_ended_leaves_no_callback_behind(signal):
    async def main():
        await startup.until_loading(asyncio.get_running_loop().create_task(asyncio.sleep(30)), limit=0.1)

    asyncio.run(main())
    signal.set()  # a callback left behind would raise here: its event loop is closed


def test_the_wait_ends_with_the_start_or_at_its_limit(signal):
    async def main():
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        await startup.until_loading(loop.create_task(asyncio.sleep(0.2)), limit=20.0)  # nothing to load
        ended = time.monotonic() - t0
        t0 = time.monotonic()
        slow = loop.create_task(asyncio.sleep(30))
        await startup.until_loading(slow, limit=0.3)
        limited = time.monotonic() - t0
        slow.cancel()
        signal.set()
        t0 = time.monotonic()
        slow = loop.create_task(asyncio.sleep(30))
        await startup.until_loading(slow, limit=20.0)  # already handed over: no wait
        done = time.monotonic() - t0
        slow.cancel()
        return ended, limited, done

    ended, limited, done = asyncio.run(main())
    assert 0.15 <= ended < 10 and 0.25 <= limited < 10 and done < 5, (ended, limited, done)
