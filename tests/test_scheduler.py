"""The shared scheduler in-process: admission waits, queue timeouts, shutdown and a misbehaving engine step."""

import asyncio

import pytest
from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig, Feed
from octo.errors import EngineError, Overloaded, QueueTimeout
from octo.scheduler import GenerationRequest, Scheduler


def engine(**opts) -> EchoEngine:
    e = EchoEngine(EngineConfig(options=opts))
    e.load("x", "m")
    return e


def request(e: EchoEngine, text: str = "a b c", stream: bool = False, **kw) -> GenerationRequest:
    return GenerationRequest(e.tokenize(e.render_chat([{"role": "user", "content": text}]), special=True),
                             stream=stream, **kw)


async def test_admission_wait_and_result():
    e = engine()
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        stream = s.submit(request(e, stream=True))[0]
        await s.wait_admitted(stream)
        assert stream.admitted is not None  # created on demand, for the one that waits
        plain = s.submit(request(e, "x y"))[0]
        assert plain.admitted is None  # nobody waits for admission: no future, nothing posted
        assert (await plain.result).text == "x y"
        assert [d async for d in stream.deltas()] == ["a", " b", " c"]
        assert (await stream.result).text == "a b c"
        await s.wait_admitted(plain)  # already admitted: returns at once
    finally:
        s.stop()


async def test_queue_timeout_reaches_waiters_and_late_callers():
    e = engine(token_delay_ms="100")
    s = Scheduler(e, max_batch=1, queue_timeout=0.1)
    s.start()
    try:
        busy = s.submit(request(e, " ".join("w" * 10)))[0]
        waiting = s.submit(request(e, stream=True))[0]
        late = s.submit(request(e))[0]
        with pytest.raises(QueueTimeout):
            await s.wait_admitted(waiting)
        with pytest.raises(QueueTimeout):
            await late.result
        with pytest.raises(QueueTimeout):  # asked after it expired: the same 504, not a hang
            await s.wait_admitted(late)
        assert s.stats()["total_timeouts"] == 2
        assert (await busy.result).finish_reason == "stop"
    finally:
        s.stop()


async def test_shutdown_fails_pending_requests():
    e = engine(token_delay_ms="50")
    s = Scheduler(e, max_batch=1)
    s.start()
    active = s.submit(request(e, "a b c d e f"))[0]
    pending = s.submit(request(e))[0]
    await asyncio.sleep(0.08)
    await asyncio.get_running_loop().run_in_executor(None, s.stop)
    for t in (active, pending):
        with pytest.raises(Overloaded):
            await asyncio.wait_for(t.result, 5)
    with pytest.raises(Overloaded):
        await s.wait_admitted(pending)


class ShortStepEngine(EchoEngine):
    """Returns one token fewer than it was fed: a broken engine must fail its sequences, not the thread."""

    def step(self, feeds: list[Feed]) -> list[int | None]:
        return super().step(feeds)[:-1]


async def test_a_step_with_the_wrong_number_of_tokens_fails_its_sequences():
    e = ShortStepEngine(EngineConfig())
    e.load("x", "m")
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        t = s.submit(request(e))[0]
        with pytest.raises(EngineError, match="returned 0 tokens for 1 feeds"):
            await asyncio.wait_for(t.result, 5)
        s.engine.__class__ = EchoEngine  # the engine thread keeps serving
        assert (await asyncio.wait_for(s.submit(request(e, "ok"))[0].result, 5)).text == "ok"
    finally:
        s.stop()


async def test_run_between_steps_runs_on_the_engine_thread_idle_or_busy():
    import threading

    e = engine(token_delay_ms="20")
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        assert (await asyncio.wrap_future(s.run_between_steps(lambda: threading.current_thread().name))) \
            .startswith("octo-engine")  # idle: it wakes the engine thread
        busy = s.submit(request(e, " ".join("w" * 1 for _ in range(30))))[0]
        await asyncio.sleep(0.1)
        steps = s.steps
        assert await asyncio.wrap_future(s.run_between_steps(lambda: 42)) == 42
        assert s.steps - steps < 5  # done between two steps, not after the request
        assert (await busy.result).finish_reason == "stop"
    finally:
        s.stop()
