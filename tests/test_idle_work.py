"""Engine.idle_work: the engine loop gives an engine's optional work (llama.cpp's layout probes) the idle moments only;
a request that arrives interrupts it at the engine's next check and is served at once."""

import asyncio
import threading
import time

from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig
from octo.scheduler import engine_loop as sched
from octo.scheduler.admission import GenerationRequest, Scheduler


class Prober(EchoEngine):
    """An echo engine with a probe of ``slices`` steps of 20 ms that checks ``interrupted()`` after each."""

    def __init__(self, slices: int) -> None:
        super().__init__(EngineConfig())
        self.slices, self.done, self.runs, self.interruptions = slices, 0, 0, 0
        self.thread: str | None = None

    def idle_work(self, interrupted):
        self.runs += 1
        self.thread = threading.current_thread().name
        while self.done < self.slices:
            time.sleep(0.02)
            self.done += 1
            if interrupted():
                self.interruptions += 1
                self.done = 0  # an interrupted probe starts over
                return 0.2
        return None


def _request(e: EchoEngine, text: str = "a b c") -> GenerationRequest:
    return GenerationRequest(e.tokenize(e.render_chat([{"role": "user", "content": text}]), special=True))


async def test_idle_work_runs_when_idle_and_a_request_interrupts_it(monkeypatch):
    monkeypatch.setattr(sched, "IDLE_WORK_DELAY_S", 0.05)
    e = Prober(slices=10_000)  # about 200 s of work: it cannot finish in this test
    e.load("x", "m")
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        deadline = time.monotonic() + 10
        while e.done < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert e.runs == 1 and e.done >= 5 and e.thread != threading.current_thread().name
        t0 = time.perf_counter()
        ticket = s.submit(_request(e))[0]
        assert (await ticket.result).text == "a b c"
        assert time.perf_counter() - t0 < 2.0, "served at the probe's next check, not after it"
        assert e.interruptions == 1
        while e.runs < 2 and time.monotonic() < deadline:  # idle again: it starts again
            await asyncio.sleep(0.01)
        assert e.runs == 2
    finally:
        s.stop()


async def test_idle_work_that_concludes_is_not_called_again(monkeypatch):
    monkeypatch.setattr(sched, "IDLE_WORK_DELAY_S", 0.05)
    e = Prober(slices=3)
    e.load("x", "m")
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        await asyncio.sleep(0.5)
        assert e.runs == 1 and e.done == 3
        assert (await s.submit(_request(e, "x y"))[0].result).text == "x y"
        await asyncio.sleep(0.3)
        assert e.runs == 1
    finally:
        s.stop()


def test_engines_without_idle_work_sleep_until_kicked():
    e = EchoEngine(EngineConfig())
    e.load("x", "m")
    assert Scheduler(e).idle_delay is None
