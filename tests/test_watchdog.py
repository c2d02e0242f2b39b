"""The watchdog through its scheduler's owner interface (``stopping``, ``on_loop``, ``fail_everything``,
``restart_loop``): an engine loop that dies fails what the model held, and in the gateway it runs again."""

import asyncio

from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig
from octo.errors import ModelFailed
from octo.scheduler.admission import GenerationRequest, Scheduler
from octo.scheduler.watchdog import MAX_RESTARTS


class BreaksOnce(EchoEngine):
    """kv_room raises on its first ``fails`` calls: the loop fails outside any step until it gives up (dies)."""

    def __init__(self, fails: int) -> None:
        super().__init__(EngineConfig())
        self.fails = fails

    def kv_room(self):
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError("kv_room is broken")
        return super().kv_room()


def request(e: EchoEngine, text: str, stream: bool = False) -> GenerationRequest:
    return GenerationRequest(e.tokenize(e.render_chat([{"role": "user", "content": text}]), special=True),
                             stream=stream)


async def test_a_dead_engine_loop_fails_what_it_held_and_runs_again():
    e = BreaksOnce(fails=100)
    e.load("x", "m")
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        t = s.submit(request(e, "a b c", stream=True))[0]
        while s.watchdog.restarts == 0:  # the loop died; the watchdog failed everything and restarted it
            await asyncio.sleep(0.01)
        e.fails = 0
        try:  # it was still queued (the loop died admitting it): its admission and result fail, nothing streams
            await s.wait_admitted(t)
            raise AssertionError("admitted")
        except ModelFailed as exc:
            assert "engine thread died" in exc.message and "kv_room is broken" in exc.message
        assert t.state == "failed" and isinstance(t.result.exception(), ModelFailed) and t.events.empty()
        assert s.watchdog.state == "ok" and 1 <= s.watchdog.restarts <= MAX_RESTARTS and not s.stopping
        after = s.submit(request(e, "x y"))[0]
        assert (await asyncio.wait_for(after.result, 10)).text == "x y"  # the restarted loop serves
    finally:
        s.stop()


class Owner:
    """A WatchdogOwner that records what it was told to fail."""

    stopping = False

    def __init__(self) -> None:
        self.failed: list = []

    def on_loop(self, fn, *args) -> None:
        fn(*args)

    def fail_everything(self, err) -> None:
        self.failed.append(err)

    def restart_loop(self) -> None:
        raise AssertionError("not dead")


def test_each_engine_call_gets_the_limit_of_its_kind(monkeypatch):
    from octo.scheduler import watchdog

    clock = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])

    def wedged_after(start, what) -> tuple[float, str]:
        """A fresh watchdog that timed one step of 10 tokens in 1 s, then ``start``-s a call: when it is wedged."""
        wd = watchdog.Watchdog(Owner())
        clock[0] = 100.0
        wd.busy(10)
        clock[0] = 101.0
        wd.idle(between=True)  # 0.1 s a token, the slowest step 1 s; the calls between steps are watched now
        start(wd)
        t0 = clock[0]
        for waited in range(1, 700):
            clock[0] = t0 + waited
            wd.check()
            if wd.state != "ok":
                assert len(wd.owner.failed) == 1 and what in wd.reason, wd.reason
                return waited, wd.reason
        raise AssertionError("never wedged")

    assert wedged_after(lambda wd: None, "an engine call between steps")[0] == 21  # 20 x the slowest step
    assert wedged_after(lambda wd: wd.busy(200), "in a step for 401")[0] == 401  # 20 x 0.1 s x 200 tokens
    assert wedged_after(lambda wd: wd.busy(1), "in a step")[0] == 6  # never under MIN_STEP_S
    assert wedged_after(lambda wd: wd.busy(None), "in a call")[0] == 601  # embeddings, audio
    wd = watchdog.Watchdog(Owner())
    wd.busy(0)  # before any step was timed: the first prompt chunk of a big model may be slow
    clock[0] += watchdog.FIRST_STEP_S - 1
    wd.check()
    assert wd.state == "ok"
    clock[0] += 2
    wd.check()
    assert wd.state == "wedged" and "an engine call for" in wd.reason
    wd.idle()  # it returned after all: responsive again
    wd.check()
    assert wd.state == "ok" and wd.reason is None
