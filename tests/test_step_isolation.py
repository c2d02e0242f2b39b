"""octo.scheduler.step_isolation in-process: an echo engine whose step raises after feeding and sampling everything
when it
holds a poisoned sequence. With rollback, the poisoned request fails alone and
the others give the text they give alone; a sequence that raises only beside others (a transient fault) fails
nobody; a rollback the engine cannot do fails the step as before; an engine without rollback fails the step's
sequences together."""

import asyncio

import pytest
from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig, Feed
from octo.errors import EngineError
from octo.scheduler.admission import GenerationRequest, Scheduler

TEXTS = ["alpha beta gamma delta epsilon", "one two three four five six", "red green blue", "x y z w v u t s"]


class Poisoned(EchoEngine):
    """Raises after the step when a sequence whose prompt holds POISON has generated 2 tokens, or (``crowd``) when
    more than one sequence is in the step with it."""

    crowd = False
    calls = 0

    def step(self, feeds: list[Feed]) -> list[int | None]:
        self.calls += 1
        out = super().step(feeds)
        bad = [f for f in feeds if f.seq.slot["emitted"] > 2 and any(self._pieces[t].strip() == "POISON"
                                                                      for t in f.seq.tokens)]
        if bad and (not self.crowd or len(feeds) > 1):
            raise RuntimeError("poisoned step")
        return out


class NoRollback(Poisoned):
    supports_rollback = False


class BadRollback(Poisoned):
    def kv_rollback(self, seq, n_tokens):
        seq.n_cached = 0  # could not keep the KV


def request(e, text):
    return GenerationRequest(e.tokenize(e.render_chat([{"role": "user", "content": text}]), special=True),
                             max_tokens=20)


async def run(e, texts):
    s = Scheduler(e, max_batch=8)
    s.start()
    try:
        tickets = [s.submit(request(e, t))[0] for t in texts]
        got = await asyncio.gather(*(t.result for t in tickets), return_exceptions=True)
        return got, s.stats()
    finally:
        s.stop()


@pytest.mark.parametrize("n", [2, 4, 8])
async def test_the_poisoned_sequence_fails_alone(n):
    e = Poisoned(EngineConfig(options={"token_delay_ms": "5"}))
    e.load("x", "m")
    texts = [*(TEXTS * 2)[:n - 1], "please POISON this batch now"]
    got, stats = await run(e, texts)
    assert isinstance(got[-1], EngineError) and "poisoned step" in got[-1].message
    assert [r.text for r in got[:-1]] == texts[:-1]  # exactly what each gives alone (echo: its message)
    assert stats["isolated_steps"] == 1 and stats["active"] == 0


async def test_a_fault_that_needs_company_fails_nobody():
    e = Poisoned(EngineConfig(options={"token_delay_ms": "5"}))
    e.crowd = True
    e.load("x", "m")
    texts = [*TEXTS, "please POISON this batch now"]
    got, stats = await run(e, texts)
    assert [r.text for r in got] == texts  # split, every group succeeds (the poisoned one alone each time after)
    assert stats["isolated_steps"] >= 1


@pytest.mark.parametrize("cls", [NoRollback, BadRollback])
async def test_without_a_rollback_the_step_fails_together(cls):
    e = cls(EngineConfig(options={"token_delay_ms": "5"}))
    e.load("x", "m")
    got, stats = await run(e, [*TEXTS, "please POISON this batch now"])
    assert all(isinstance(r, EngineError) for r in got), got  # they were in the poisoned step
    assert stats["isolated_steps"] == 0
