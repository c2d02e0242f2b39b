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
