"""The encode thread under supervision (octo.scheduler.media.MediaEncoder.check): a stuck encode costs the requests
that wait for it (and for the encodes queued behind it), never the other streams; requests with images are refused
until it returns, then served again. With the scripted engine of tests/test_media_scheduler.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_media_scheduler import MARK, engine, image, request

from octo.errors import ModelFailed
from octo.scheduler import media
from octo.scheduler.admission import Scheduler


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(media, "FIRST_ENCODE_S", 0.3)
    monkeypatch.setattr(media, "MIN_ENCODE_S", 0.3)


async def test_a_stuck_encode_fails_its_requests_and_the_text_streams_go_on(quick):
    e = engine(encode_s=2.5, token_delay_ms="5")
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        text = s.submit(request(e, " ".join(f"w{i}" for i in range(60)), [], stream=True))[0]
        stuck = s.submit(request(e, f"see {MARK} now", [image(8)]))[0]
        behind = s.submit(request(e, f"and {MARK} this", [image(9)]))[0]  # queued behind it on the encode thread
        t0 = time.perf_counter()
        for t in (stuck, behind):
            with pytest.raises(ModelFailed, match="image encoder has been stuck in an encode") as err:
                await asyncio.wait_for(t.result, 5)
            assert err.value.status == 503 and err.value.code == "encoder_stuck"
        assert time.perf_counter() - t0 < 1.5  # at its limit, not when the encode returns
        assert s.stats()["media"]["encoder"] == "stuck"
        refused = s.submit(request(e, f"new {MARK} one", [image(10)]))[0]
        with pytest.raises(ModelFailed, match="until it returns"):
            await asyncio.wait_for(refused.result, 1)
        plain = await s.submit(request(e, "just text", []))[0].result
        assert plain.text == "just text" and (await text.result).finish_reason == "stop"  # the text went on
        e.encode_s = 0.01
        while s.stats()["media"]["encoder"] != "ok":  # the stuck call returns: images are served again
            assert time.perf_counter() - t0 < 6
            await asyncio.sleep(0.05)
        ok = await s.submit(request(e, f"again {MARK} now", [image(11)]))[0].result
        assert ok.text == f"again img:{image(11).digest[:8]} now"
    finally:
        s.stop()


async def test_an_encode_may_take_20x_the_slowest_time_per_position_seen(quick):
    e = engine(encode_s=0.05)
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        assert s.media.limit(4) == 0.3  # none timed yet: FIRST_ENCODE_S
        await s.submit(request(e, f"x {MARK} y", [image(9)]))[0].result  # 4 positions in about 0.05 s
        per = s.media.limit(1000) / 1000 / media.ENCODE_MARGIN
        assert 0.05 / 4 <= per < 0.5
        assert s.media.limit(1) == 0.3  # never below MIN_ENCODE_S
    finally:
        s.stop()


async def test_the_encodes_compute_in_the_workers_turn():
    """Where models take turns on the cores, the encode thread enters the worker's gate around each encode."""
    calls: list[tuple[str, str]] = []

    class Gate:
        def enter(self):
            calls.append(("enter", threading.current_thread().name))

        def exit(self):
            calls.append(("exit", threading.current_thread().name))

        def idle(self):
            pass

    e = engine(encode_s=0.05)
    s = Scheduler(e, max_batch=2)
    s.gate = Gate()
    s.start()
    try:
        await s.submit(request(e, f"x {MARK} y", [image(8)]))[0].result
        encode = [c for c, thread in calls if thread.startswith("octo-encode")]
        assert e.encoded and encode == ["enter", "exit"]  # around the encode, on its thread
        assert len(calls) > 2 and [c for c, _ in calls].count("enter") == [c for c, _ in calls].count("exit")
    finally:
        s.stop()
