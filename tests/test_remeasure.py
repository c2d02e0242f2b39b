"""Provisional engine measurements taken again while the model is idle (octo.runtime.remeasure), with fake candidates
of known speed and a scripted view of the gateway's activity."""
import asyncio
import json
import time

import pytest
from test_selection import Fast, Slow  # engines of known speed

from octo.runtime import engine_choice, remeasure
from octo.runtime.benchmark import micro_benchmark
from octo.runtime.remeasure import Activity, Pending
from octo.runtime.selection import Candidate, cache_key, cached_result, store_result

MEASURED: list[str] = []


class _Killable:
    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


class FakeCandidate(Candidate):
    """Loads in this process after ``delay`` seconds (a worker's load), measures with the real micro-benchmark,
    reports what the ``verdicts`` script says about disturbance; ``spawned`` stands for its worker."""

    verdicts: list[bool] = []

    def __init__(self, cls, artifact, delay=0.0):
        self.cls, self.artifact, self.delay = cls, artifact, delay
        self.spawned = self.engine = None
        self.discarded = False

    async def open(self, bench):
        self.spawned = _Killable()
        await asyncio.sleep(self.delay)
        MEASURED.append(self.cls.name)
        self.engine = self.cls()
        self.engine.load(self.artifact, "m")
        if bench is None:  # a load to serve (a switch)
            return 0.01, None
        res = micro_benchmark(self.engine, bench[0], beat=bench[1])
        disturbed = FakeCandidate.verdicts.pop(0) if FakeCandidate.verdicts else False
        res["conditions"] = {**res.get("conditions", {}), "budget_s": bench[0], "disturbed": disturbed}
        return 0.01, res

    async def discard(self):
        self.discarded = True


class Script(Activity):
    """The gateway's activity, as a test sets it: ``busy`` and the time the last request ended."""

    def __init__(self):
        self.is_busy, self.ended = False, time.monotonic() - 100.0
        super().__init__(lambda: self.is_busy, lambda: self.ended)


def idle_home(tmp_path, monkeypatch):
    """OCTO_HOME in ``tmp_path``, a short idle time and a quiet host for the measurements; returns an artifact."""
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    monkeypatch.setattr(remeasure, "IDLE_S", 0.2)
    monkeypatch.setattr(remeasure.benchload, "quiet_now", lambda window=0.2: True)
    art = tmp_path / "model.bin"
    art.write_bytes(b"x" * 1000)
    return art


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    MEASURED.clear()
    FakeCandidate.verdicts = []
    return idle_home(tmp_path, monkeypatch)


def _provisional(score: float) -> dict:
    return {"score": score, "prefill_tok_s": 1.0, "decode_tok_s": 1.0, "batch_decode_tok_s": 1.0, "threads": None,
            "seconds": 0.1, "conditions": {"budget_s": 0.2, "disturbed": True}, "provisional": True}


def _pending(home, serving, scores, made, delay=0.0):
    """A selection that left ``scores`` (engine -> provisional score) cached, ``serving`` serving."""
    classes = {"fast": Fast, "slow": Slow}
    keys = {n: cache_key(classes[n], str(home)) for n in scores}
    results = {}
    for n, score in scores.items():
        store_result(keys[n], _provisional(score))
        results[n] = {**_provisional(score), "cached": True}

    def make(n):
        made.append(FakeCandidate(classes[n], str(home), delay))
        return made[-1]

    return Pending("m", serving, 0.2, keys, results, make, {n: str(home) for n in scores}, list(scores))


def test_an_idle_model_measures_its_provisional_results_again_and_the_clear_winner_is_kept(home):
    made, lines = [], []
    # the last start, disturbed, crowned slow (its score looked higher); measured quietly fast wins clearly
    pending = _pending(home, "slow", {"slow": 500.0, "fast": 100.0}, made)
    asyncio.run(asyncio.wait_for(remeasure.run(pending, Script(), lines.append), 30))
    assert sorted(MEASURED) == ["fast", "slow"] and pending.names == []
    assert all(c.discarded for c in made)  # each candidate's worker is stopped once measured
    for n, key in pending.keys.items():
        res = cached_result(key)
        assert not res["conditions"]["disturbed"] and not res.get("provisional") and res["score"] > 0
        assert pending.results[n]["score"] == res["score"]  # /v1/engines sees the new result
    assert pending.results["fast"]["score"] > 1.5 * pending.results["slow"]["score"]
    assert engine_choice.incumbent(pending.keys) == "fast"
    assert len(lines) == 1 and lines[0].startswith("octo: 'm': measured again while idle: the next start serves it "
                                                   "with fast: it scored more than 1.10x slow"), lines


def test_the_engine_chosen_before_stays_unless_the_challenger_wins_by_the_margin(home):
    pending = _pending(home, "fast", {"fast": 100.0, "slow": 100.0}, [])
    engine_choice.keep(pending.keys, "slow", {"score": 100.0, "conditions": {"disturbed": False}})
    quiet = {"conditions": {"disturbed": False}}
    pending.results.update(slow={**quiet, "score": 100.0}, fast={**quiet, "score": 108.0})  # within 10%
    best, line = remeasure.settle(pending)
    assert best == "slow" and engine_choice.incumbent(pending.keys) == "slow"
    assert line == ("octo: 'm': measured again while idle: the next start serves it with slow, as chosen before on "
                    "this host (fast scored 1.08x of it; a switch needs more than 1.10x measured undisturbed)"), line
    pending.results["fast"]["score"] = 115.0  # a clear win
    best, line = remeasure.settle(pending)
    assert best == "fast" and engine_choice.incumbent(pending.keys) == "fast"
    assert line == ("octo: 'm': measured again while idle: fast: it scored more than 1.10x slow, the engine chosen "
                    "before"), line


def test_without_a_switch_the_winner_serves_from_the_next_load(home):
    pending = _pending(home, "slow", {"fast": 100.0, "slow": 100.0}, [])
    quiet = {"conditions": {"disturbed": False}}
    pending.results.update(slow={**quiet, "score": 100.0}, fast={**quiet, "score": 300.0})
    pending.switch = lambda best: None
    best, line = remeasure.settle(pending)  # no serving candidate (in the gateway's process): no switch now
    assert best == "fast" and line == ("octo: 'm': measured again while idle: the next start serves it with fast: it "
                                       "scored more than 1.10x slow, the engine chosen at this start"), line
    pending.serving_candidate = lambda n: object()
    assert remeasure.settle(pending)[1].startswith("octo: 'm': measured again while idle: switching to fast")


def test_a_request_stops_the_measurement_at_once_and_it_runs_again_at_the_next_idle_moment(home):
    made, lines = [], []
    pending = _pending(home, "fast", {"fast": 100.0}, made, delay=0.5)  # a load of half a second
    activity = Script()

    async def go():
        task = asyncio.ensure_future(remeasure.run(pending, activity, lines.append))
        while not made:  # the first measurement has started
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        activity.is_busy = True  # a request arrives
        t0 = time.monotonic()
        while not made[0].spawned.killed:
            await asyncio.sleep(0.005)
        stopped_in = time.monotonic() - t0
        assert stopped_in < 0.2, stopped_in  # its worker is killed within LOOK_S or so
        await asyncio.sleep(0.5)
        assert len(made) == 1 and MEASURED == []  # nothing measured while the request runs
        activity.is_busy, activity.ended = False, time.monotonic()  # it ends: idle again after IDLE_S
        await asyncio.wait_for(task, 30)

    asyncio.run(go())
    assert len(made) == 2 and MEASURED == ["fast"] and not cached_result(pending.keys["fast"]).get("provisional")
    assert len(lines) == 1


def test_a_measurement_disturbed_again_waits_ten_minutes_and_the_schedule_survives_a_restart(home, monkeypatch):
    made, lines = [], []
    pending = _pending(home, "fast", {"fast": 100.0}, made)
    FakeCandidate.verdicts = [True]
    sleeps, real_sleep = [], asyncio.sleep

    async def long_sleeps_stop(seconds):
        if seconds < 30:
            return await real_sleep(seconds)
        sleeps.append(seconds)
        raise asyncio.CancelledError  # stop the run at its first long wait after the measurement

    monkeypatch.setattr(remeasure.asyncio, "sleep", long_sleeps_stop)

    async def go():
        try:
            await remeasure.run(pending, Script(), lines.append)
        except asyncio.CancelledError:
            pass

    asyncio.run(go())
    res = cached_result(pending.keys["fast"])
    assert res["score"] == 100.0 and res["conditions"]["disturbed"]  # the provisional result stays
    assert res["remeasure"]["attempts"] == 1
    assert 590 < res["remeasure"]["next_at"] - time.time() <= 600
    assert sleeps and 59 <= sleeps[0] <= 60  # waits (a minute at a time) for its next try
    assert lines == []
    # a restarted gateway reads the schedule from the cache: not measured again before it is due
    assert remeasure.due_at({**res}) == res["remeasure"]["next_at"]


def test_too_little_memory_for_a_second_copy_postpones_the_measurement(home, monkeypatch):
    import octo.runtime.memguard as memguard

    made, lines = [], []
    pending = _pending(home, "fast", {"fast": 100.0}, made)
    monkeypatch.setattr(memguard, "available", lambda: (10, 10))  # 10 bytes free, the artifact has 1,000
    sleeps = []

    async def no_sleep(seconds):
        sleeps.append(seconds)
        raise asyncio.CancelledError

    monkeypatch.setattr(remeasure.asyncio, "sleep", no_sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(remeasure.run(pending, Script(), lines.append))
    assert MEASURED == [] and sleeps == [remeasure.RETRY_S[0]]


def test_a_selection_with_provisional_results_hands_them_to_the_gateway(home):
    from octo.config import ServerConfig
    from octo.runtime.loader import WorkerCandidate, pending_of

    class C:
        def __init__(self, cls):
            self.cls, self.artifact = cls, str(home)

    cands = {"fast": C(Fast), "slow": C(Slow)}
    results = {"fast": {"score": 2.0, "provisional": True}, "slow": {"score": 1.0}}
    p = pending_of("m", ("alias",), "fast", cands, results, ServerConfig(bench_seconds=0.7), {})
    assert p.names == ["fast"] and p.serving == "fast" and p.seconds == 0.7 and set(p.keys) == {"fast", "slow"}
    cand = p.make("fast")
    assert isinstance(cand, WorkerCandidate) and cand.cls is Fast and cand.worker is None  # nothing spawned yet
    assert cand.spare is False  # its own process: taking the spare would start a replacement while it measures
    assert p.artifacts == {"fast": str(home), "slow": str(home)}
    assert pending_of("m", (), "fast", cands, {"fast": {"score": 2.0}}, ServerConfig(), {}) is None
    # the engine that takes over serves as it would load: in a worker unless --isolation thread says otherwise
    assert isinstance(p.serving_candidate("slow"), WorkerCandidate) and p.serving_candidate("slow").spare
    thread = pending_of("m", (), "fast", cands, results, ServerConfig(isolation="thread"), {})
    assert thread.serving_candidate("slow") is None  # no switch while running: the next load serves with it
    assert json.loads(json.dumps(p.keys))  # cache keys, as selection wrote them


class _Handle:
    def __init__(self, name):
        self.name, self.activated, self.closed = name, False, False

    async def activate(self, config):
        await asyncio.sleep(0.1)  # the worker's answer
        self.activated = True

    async def close(self):
        self.closed = True


class _Slot:
    def __init__(self, handle):
        self.handle, self.inflight, self.spec, self.rows, self.loading, self.last_used = handle, 0, None, [], None, 0.0


class _Registry:
    def __init__(self, slot, lines):
        self.slots, self.say = [slot], lines.append

    def config_for(self, spec):
        return None


def test_a_winner_takes_over_between_two_requests_and_waits_while_traffic_has_no_gap(home, monkeypatch):
    monkeypatch.setattr(remeasure, "SWAP_WAIT_S", 0.2)
    lines, made, handles = [], [], []
    pending = _pending(home, "slow", {"fast": 100.0}, made)
    pending.serving_candidate = lambda n: FakeCandidate(Fast, str(home))

    def handle_of(cand, n, reason):
        handles.append(_Handle(n))
        return handles[-1], ["rows of " + n]

    pending.handle_of = handle_of
    old = _Handle("slow")
    slot = _Slot(old)
    registry = _Registry(slot, lines)
    slot.last_used = time.monotonic() - 100
    slot.inflight = 1  # a request that does not end: no gap to swap in

    async def go():
        task = asyncio.ensure_future(remeasure.switch(pending, registry, slot, "fast", remeasure.watch(registry)))
        await asyncio.sleep(0.05)
        assert not handles  # busy: nothing loaded while a request runs
        slot.inflight, slot.last_used = 0, time.monotonic() - 100  # idle: the challenger loads...
        while not handles:
            await asyncio.sleep(0.01)
        slot.inflight = 1  # ...but a request comes while it activates and holds the slot past SWAP_WAIT_S: the
        # loaded challenger is stopped
        while not handles[0].closed:
            await asyncio.sleep(0.01)
        assert slot.handle is old and not old.closed
        slot.inflight, slot.last_used = 0, time.monotonic() - 100  # a gap: the next try swaps
        await asyncio.wait_for(task, 10)

    asyncio.run(asyncio.wait_for(go(), 20))
    assert len(handles) == 2 and handles[1].activated and slot.handle is handles[1] and old.closed
    assert slot.rows == ["rows of fast"] and pending.serving == "fast"
    assert len(lines) == 1 and lines[0].startswith("octo: 'm' now served by fast (switched from slow in "), lines
