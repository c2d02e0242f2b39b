"""The shared scheduler in-process: admission waits, queue timeouts, shutdown and a misbehaving engine step."""

import asyncio
import dataclasses
import re

import pytest
from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig, Feed
from octo.errors import EngineError, Overloaded, QueueTimeout
from octo.scheduler.admission import GenerationRequest, Scheduler


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


# -- KV pressure: preemption and resumption ------------------------------------------------------------------------
WORDS = [" ".join(f"w{i}x{j}" for j in range(40)) for i in range(6)]  # 40-word replies, ~45-token prompts


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_kv_pressure_preempts_and_resumes_without_losing_a_token(mode):
    # six sequences of ~85 tokens each in a 160-cell pool: at most one or two fit at a time
    e = engine(kv_cells="160")
    s = Scheduler(e, max_batch=6, preempt=mode)
    s.start()
    try:
        tickets = [s.submit(request(e, w, stream=True))[0] for w in WORDS]

        async def collect(t):
            return "".join([d async for d in t.deltas()])

        streamed = await asyncio.gather(*(collect(t) for t in tickets))
        results = [await t.result for t in tickets]
        for w, text, r in zip(WORDS, streamed, results, strict=True):
            assert text == w and r.text == w and r.finish_reason == "stop"  # nothing lost, nothing repeated
        stats = s.stats()
        assert stats["total_preemptions"] > 0 and stats["total_resumed"] == stats["total_preemptions"]
        assert stats["active"] == stats["preempted"] == stats["pending"] == 0
        assert e.kv_room() == 160  # every cell came back
    finally:
        s.stop()


async def test_kv_pressure_cancel_while_preempted():
    e = engine(kv_cells="120", token_delay_ms="5")
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        tickets = [s.submit(request(e, w))[0] for w in WORDS[:4]]
        for _ in range(400):
            await asyncio.sleep(0.01)
            if s.stats()["preempted"]:
                break
        victim = s.kv.preempted[0]
        s.abandon(victim)
        done = [await t.result for t in tickets]
        assert victim.finish == "cancelled"
        assert all(r.text == w for r, w, t in zip(done, WORDS[:4], tickets, strict=True) if t is not victim)
        assert e.kv_room() == 120 and s.stats()["preempted"] == 0
    finally:
        s.stop()


# -- faults: a sequence fails alone ---------------------------------------------------------------------------------
class PickyEcho(EchoEngine):
    """Fails the sequences whose prompt holds 'bad' (step returns an exception in their place) and cannot spell
    the word 'boom' (token_bytes raises)."""

    def step(self, feeds):
        out = super().step(feeds)
        return [RuntimeError("bad sequence") if tok is not None and b"bad" in b"".join(
            self.token_bytes(t) for t in f.seq.tokens[:f.seq.n_cached] if self._pieces[t].strip() != "boom")
            else tok for f, tok in zip(feeds, out, strict=True)]

    def token_bytes(self, token):
        if self._pieces[token].strip() == "boom":
            raise UnicodeError("cannot spell boom")
        return super().token_bytes(token)


async def test_engine_failure_of_one_sequence_fails_only_it():
    e = PickyEcho(EngineConfig())
    e.load("x", "m")
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        good = [s.submit(request(e, f"fine words {i} here"))[0] for i in range(2)]
        bad = s.submit(request(e, "a bad one"))[0]
        boom = s.submit(request(e, "x boom y"))[0]
        for t in good:
            assert (await t.result).finish_reason == "stop"
        with pytest.raises(EngineError, match="bad sequence"):
            await bad.result
        with pytest.raises(EngineError, match="cannot spell boom"):
            await boom.result
        assert (await s.submit(request(e, "still serving"))[0].result).text == "still serving"
        assert s.stats()["engine_thread"] == "ok" and s.stats()["active"] == 0
    finally:
        s.stop()


class TokenKindEcho(EchoEngine):
    """Samples the echo token as ``as_token(token)`` makes it: a numpy integer, a float, an id out of range."""

    as_token = staticmethod(int)

    def step(self, feeds):
        return [tok if tok is None else self.as_token(tok) for tok in super().step(feeds)]


@pytest.mark.parametrize("stream", [False, True])
async def test_what_an_engine_samples_is_checked_as_a_token_id_on_every_path(stream):
    import numpy as np

    e = TokenKindEcho(EngineConfig())
    e.load("x", "m")
    n_vocab = 1000  # (the echo engine declares none: its words get ids as they come)
    e.info = dataclasses.replace(e.info, n_vocab=n_vocab)
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        for kind in (int, np.int64, np.uint16):  # plain ids (the inline check) and numpy ones (operator.index)
            e.as_token = kind
            t = s.submit(request(e, "a b c", stream=stream))[0]
            if stream:
                assert [d async for d in t.deltas()] == ["a", " b", " c"]
            assert (await asyncio.wait_for(t.result, 5)).text == "a b c"
        for kind, says in ((lambda tok: n_vocab, f"token id {n_vocab}, which is outside its vocabulary (0..999)."),
                           (lambda tok: -1, "token id -1, which is outside"), (float, "which is not a token id"),
                           (lambda tok: np.int64(n_vocab), f"token id {n_vocab}, which is outside")):
            e.as_token = kind
            t = s.submit(request(e, "a b c", stream=stream))[0]
            with pytest.raises(EngineError, match=re.escape(says)):
                await asyncio.wait_for(t.result, 5)
        e.as_token = int
        assert (await s.submit(request(e, "still serving"))[0].result).text == "still serving"
    finally:
        s.stop()


async def test_a_long_embeddings_request_runs_in_chunks_between_decode_steps():
    from octo.config import ServerConfig
    from octo.runtime.model import ModelHandle, run_call

    e = engine(token_delay_ms="1")
    seen: list[int] = []
    embed = e.embed
    e.embed = lambda texts: (seen.append(h.scheduler.steps), embed(texts))[1]
    h = ModelHandle("m", (), "echo", e, "x")
    h.start(ServerConfig(no_cache=True))
    try:
        gen = h.scheduler.submit(request(e, " ".join(f"w{i}" for i in range(300))))[0]
        while h.scheduler.steps < 2:
            await asyncio.sleep(0.001)
        out = await run_call(h, "embed", [f"text number {i}" for i in range(2048)])
        assert len(out.vectors) == 2048 and out.n_tokens == 3 * 2048
        assert len(seen) == 64 and seen[-1] > seen[0]  # 64 calls of 32, with decode steps between them
        assert (await gen.result).finish_reason == "stop"
    finally:
        h.stop()


def test_pacer_budgets_follow_measured_costs():
    from octo.scheduler.pacer import Pacer

    p = Pacer(stretch=2.0, max_step_s=0.25)
    assert p.budgets(256, decoding=True) == (256, 256)  # nothing measured yet: whole chunks
    p.observe(0.020, n_decode=1, n_prefill=0)  # a decode-only step: 20 ms
    p.observe(0.020 + 64 * 0.005, n_decode=1, n_prefill=64)  # 5 ms per prompt token on top of it
    assert p.decode_s == pytest.approx(0.020) and p.token_s == pytest.approx(0.005)
    assert p.budgets(256, decoding=False) == (256, 50)  # a long prompt: 0.25 s of prompt work per step
    # one prompt and nothing else: chunks of at most 0.6 s (120 tokens here), never fewer than 64 tokens
    assert p.budgets(256, decoding=False, alone=True) == (120, 120)
    assert p.budgets(96, decoding=False, alone=True) == (96, 96)
    p.token_s = 0.05
    assert p.budgets(256, decoding=False, alone=True) == (64, 64)
    # a long prompt alone (a coding agent's): chunks of 1/40 of it, up to the engine's chunk, however slow a token
    assert p.budgets(512, decoding=False, alone=True, prompt=8000) == (200, 200)
    assert p.budgets(512, decoding=False, alone=True, prompt=22000) == (512, 512)
    assert p.budgets(512, decoding=True, alone=False, prompt=22000)[1] < 64  # never beside decoding requests
    p.token_s = 0.005
    assert p.budgets(256, decoding=True) == (256, 4)  # beside decoders: one more decode step's worth (min 4)
    assert p.budgets(32, decoding=False) == (32, 32)  # never more than the engine's chunk
    p.observe(0.100, n_decode=4, n_prefill=0)  # decode steps of 100 ms (EWMA: 36 ms)
    assert p.budgets(256, decoding=True) == (256, 7)  # one more decode step: 36 ms of prompt work
    assert p.budgets(256, decoding=True, urgent=True) == (256, 4)  # a nearly done request: a quarter step (min 4)
    p.observe(0.300, n_decode=4, n_prefill=0)  # EWMA: 88.8 ms
    assert p.budgets(256, decoding=True) == (256, 17)
    assert p.budgets(256, decoding=True, urgent=True) == (256, 4)  # 0.25 x 88.8 ms / 5 ms
    assert p.budgets(256, decoding=False, urgent=True) == (256, 4)  # its prompt's step, before it decodes
    assert Pacer(stretch=0).budgets(256, decoding=True) == (256, 256)  # 0: no pacing


async def test_short_prompts_beside_a_nearly_done_request_go_in_whole_and_a_long_one_is_paced():
    """Streams that arrive just after a first one join it at its next step, each prompt whole, although the first is
    nearly done (before, each was fed a quarter decode step's worth at a time and 8 streams started one by one); a
    prompt of more than one step's work (the pacer's ``short``) is still fed in paced chunks."""
    e = engine(token_delay_ms="10")
    feeds: list[list[tuple[int, int]]] = []
    step = e.step
    e.step = lambda fs: (feeds.append([(f.seq.id, len(f.tokens)) for f in fs]), step(fs))[1]
    s = Scheduler(e, max_batch=9)
    pacer = s.pacer
    pacer.observe = lambda *a, **k: None  # fixed costs: 20 ms decode steps, 5 ms per prompt token
    pacer.decode_s, pacer.token_s = 0.020, 0.005
    assert pacer.short(4096) == 50 and pacer.budgets(4096, decoding=True, urgent=True) == (4096, 4)
    s.start()
    try:
        first = s.submit(request(e, " ".join(f"a{i}" for i in range(40)), max_tokens=10))[0]  # work left < prompts
        while s.steps < 3:
            await asyncio.sleep(0.001)
        words = " ".join(f"w{i}" for i in range(12))
        short = [s.submit(request(e, f"{k} {words}", max_tokens=4))[0] for k in range(7)]
        long = s.submit(request(e, " ".join(f"x{i}" for i in range(120)), max_tokens=2))[0]
        for t in (first, *short, long):
            assert (await t.result).finish_reason in ("length", "stop")
        fed: dict[int, list[int]] = {}
        for step_feeds in feeds:
            for seq_id, n in step_feeds:
                fed.setdefault(seq_id, []).append(n)
        ids = {t.seq.id: t for t in (*short, long)}
        joined = next(i for i, fs in enumerate(feeds) if any(seq_id in ids for seq_id, _ in fs))
        assert (first.seq.id, 1) in feeds[joined]  # the first was decoding, nearly done, when they joined
        for t in short:
            n_prompt = len(t.req.prompt_tokens)
            assert 14 <= n_prompt <= 50 and fed[t.seq.id][0] == n_prompt  # one feed of the whole prompt
        chunks = [n for n in fed[long.seq.id] if n > 1]
        assert sum(chunks) >= len(long.req.prompt_tokens) - 1 and len(chunks) >= 3 and max(chunks[:-1]) <= 50, chunks
        assert len(ids) == 8
    finally:
        s.stop()


def test_pacer_gathers_only_before_a_long_step():
    from octo.scheduler.pacer import Pacer

    p = Pacer(stretch=2.0)
    assert p.gather_s(4000) == 0.0  # nothing measured: no estimate, no wait
    p.token_s = 0.005
    assert p.gather_s(100) == 0.0  # 0.5 s of prompt work (a short chat request): starts at once
    assert p.gather_s(300) == pytest.approx(0.03)  # 1.5 s: 2% of it
    assert p.gather_s(4000) == pytest.approx(0.05)  # 20 s: at most 50 ms
    assert Pacer(stretch=0).gather_s(4000) == 0.0


def test_pacer_gathers_before_a_prompt_step_that_is_long_whatever_its_tokens():
    """Over a long context a prompt step costs what does not grow with its tokens (the agent bench's next turns on
    2,000 restored tokens: 10 tokens 2.1 s, 57 tokens 2.5 s, four times 57 2.6 s): after such a step the next
    57-token prompt of an idle engine waits for the requests sent with it, though its marginal cost says 0.9 s; after
    cheap prompt steps (a chat's) it does not."""
    from octo.scheduler.pacer import Pacer

    p = Pacer(stretch=2.0)
    for _ in range(10):
        p.observe(0.55, 0, 256)  # a cold 2,000-token prompt in chunks
    for _ in range(20):
        p.observe(0.2, 4, 0)
    assert 57 * p.token_s < 1.0 and p.gather_s(57) == 0.0  # the last prompt step: 0.55 s
    p.observe(2.59, 0, 228)  # four next turns, 57 new tokens each, in one step
    assert 57 * p.token_s < 1.0
    assert p.gather_s(57) == pytest.approx(min(0.05, 0.02 * 2.59))  # 2% of the step, at most 50 ms
    p.observe(0.3, 4, 8)  # back to cheap prompt steps (a chat's, 0.1 s beyond its decoding)
    assert p.gather_s(57) == 0.0


async def test_requests_sent_together_join_an_idle_engines_long_first_step():
    """An agent's conversations send their next turns together; they reach the engine a few milliseconds apart. On an
    idle engine whose first step would be long, the ones that arrive during the short wait join that step: every
    prompt whole in the first step (before, the first ran alone and the others were paced in beside its decoding,
    one after another: 2,000-token contexts here gave 3.3, 6.5, 9.8 and 13.8 s to their first tokens)."""
    e = engine(token_delay_ms="5")
    feeds: list[list[tuple[int, int]]] = []
    step = e.step
    e.step = lambda fs: (feeds.append([(f.seq.id, len(f.tokens)) for f in fs]), step(fs))[1]
    s = Scheduler(e, max_batch=8)
    s.pacer.observe = lambda *a, **k: None
    s.pacer.decode_s, s.pacer.token_s = 0.020, 0.05  # a 60-token prompt: 3 s of work, a 50 ms gather
    s.start()
    try:
        prompts = [" ".join(f"p{k}w{i}" for i in range(60)) for k in range(4)]
        first = s.submit(request(e, prompts[0], max_tokens=3))[0]
        await asyncio.sleep(0.004)  # the others come 4 ms later
        rest = [s.submit(request(e, p, max_tokens=3))[0] for p in prompts[1:]]
        for t in (first, *rest):
            assert (await t.result).finish_reason in ("length", "stop")
        firsts = {seq_id: n for seq_id, n in feeds[0]}
        assert set(firsts) == {t.seq.id for t in (first, *rest)}, feeds[:3]
        assert all(firsts[t.seq.id] == len(t.req.prompt_tokens) for t in (first, *rest))
    finally:
        s.stop()


async def test_short_requests_that_arrive_together_start_at_once():
    """Several short prompts admitted together (8 chat streams): each is short, so the first step does not wait for
    more, though together they are more than ``GATHER_MIN_S`` of work."""
    e = engine(token_delay_ms="1")
    s = Scheduler(e, max_batch=16)
    s.pacer.observe = lambda *a, **k: None
    s.pacer.decode_s, s.pacer.token_s = 0.020, 0.01  # each prompt: 0.1-0.2 s; all eight: over 1 s
    waits = []
    gather = s.pacer.gather_s
    s.pacer.gather_s = lambda n: waits.append(gather(n)) or waits[-1]
    s.start()
    try:
        tickets = [s.submit(request(e, " ".join(f"s{k}w{i}" for i in range(12)), max_tokens=2))[0] for k in range(8)]
        for t in tickets:
            await t.result
        assert waits and all(w == 0.0 for w in waits) and len(tickets[0].req.prompt_tokens) * 8 * 0.01 > 1.0
    finally:
        s.stop()


async def test_requests_queued_before_a_sleeping_engine_wakes_join_its_first_step():
    """The first request queued at a sleeping engine thread wakes it ``KICK_LATER`` event-loop iterations later, so
    requests whose handlers run in the next iteration (a server's next clients) join its first step instead of
    waiting for the next one (bench/overhead.py: 1.3 steps a request at concurrency 8 instead of 1.7)."""
    import time

    e = engine()
    feeds: list[set[int]] = []
    step = e.step
    e.step = lambda fs: (feeds.append({f.seq.id for f in fs}), step(fs))[1]
    s = Scheduler(e, max_batch=8)
    s.start()
    try:
        await asyncio.sleep(0.05)  # the engine thread is asleep
        tickets = s.submit(request(e, "a", max_tokens=4))
        await asyncio.sleep(0)  # the next event-loop iteration (the wake-up used to come here)
        time.sleep(0.02)  # the interpreter lock free meanwhile, as while the loop waits for a client's data
        tickets += s.submit(request(e, "b c", max_tokens=4))
        for t in tickets:
            await t.result
        assert feeds[0] == {t.seq.id for t in tickets}, feeds[:3]
    finally:
        s.stop()


async def test_the_models_default_max_tokens_bounds_a_request_that_sets_none():
    """A model's default completion length (the catalog's max_tokens) ends a request that sets none, with
    "length"; a request's own max_tokens wins; the default is no context check (a long prompt is still served)."""
    e = engine(n_ctx="64")
    s = Scheduler(e, max_batch=2, default_max_tokens=3)
    s.start()
    try:
        capped = await s.submit(request(e, "one two three four five six"))[0].result
        assert capped.text == "one two three" and capped.finish_reason == "length"
        own = await s.submit(request(e, "one two three four five six", max_tokens=5))[0].result
        assert own.text == "one two three four five"
        long = await s.submit(request(e, " ".join(["w"] * 50)))[0].result  # 3 more would not fit, and need not
        assert long.completion_tokens <= 3
    finally:
        s.stop()
