"""``octo serve --bench-when-idle``: a model with several candidate engines serves at once, without measuring them
on the start path: with the best engine this host has measured, or the first candidate when none is; the engines not
measured yet are measured while the model is idle (octo.runtime.remeasure), and the fastest then serves."""
import asyncio
import json
import time

import pytest
from test_remeasure import FakeCandidate, Script, idle_home
from test_selection import LOADS, Fast, Slow, Unloadable, after_switch, benchmarks_of, run_select, serve_timed

from octo.runtime import engine_choice, remeasure
from octo.runtime.remeasure import Pending
from octo.runtime.selection import cache_key, cached_result, unmeasured


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    LOADS.clear()
    FakeCandidate.verdicts = []
    return idle_home(tmp_path, monkeypatch)


class Newer(Fast):
    name = "newer"  # an engine installed after the others were measured


def _bench_files(tmp_path):
    return sorted(p.name.split("-")[0] for p in (tmp_path / "bench").glob("*.json"))


def test_a_host_that_measured_nothing_serves_the_first_candidate_at_once(home, tmp_path):
    lines = []
    t0 = time.monotonic()
    name, engine, results, reason = run_select({"slow": (Slow, str(home)), "fast": (Fast, str(home))},
                                               seconds=0.5, say=lines.append, defer=True)
    assert time.monotonic() - t0 < 0.3  # nothing measured: one load
    assert name == "slow" and isinstance(engine, Slow) and LOADS == ["slow"]
    assert all(r["unmeasured"] and r["score"] is None for r in results.values()), results
    assert _bench_files(tmp_path) == []  # nothing cached: a later start is no wiser
    serving = [line for line in lines if line.startswith("octo: serving with")]
    assert serving == ["octo: serving with slow at once, the first candidate: no engine that can serve it is measured "
                       "on this host yet; not measured yet: slow, fast, measured when the model is idle (the fastest "
                       "then serves)"], lines
    assert reason.startswith(serving[0].removeprefix("octo: serving with "))


def test_the_best_engine_measured_here_serves_and_only_a_new_one_waits(home):
    run_select({"slow": (Slow, str(home)), "fast": (Fast, str(home))}, seconds=0.4, say=lambda m: None)
    LOADS.clear()
    lines = []
    cands = {"newer": (Newer, str(home)), "slow": (Slow, str(home)), "fast": (Fast, str(home))}
    name, _, results, _ = run_select(cands, seconds=0.4, say=lines.append, defer=True)
    assert name == "fast" and LOADS == ["fast"]  # measured before, and the best
    assert results["newer"]["unmeasured"] and results["fast"]["cached"] and results["slow"]["score"] > 0
    assert "octo: bench newer     not measured on this host yet: measured when the model is idle" in lines
    line = next(m for m in lines if m.startswith("octo: serving with"))
    assert line.startswith("octo: serving with fast: highest benchmark score (slow scored ") and line.endswith(
        "; not measured yet: newer, measured when the model is idle (the fastest then serves)"), line


def test_a_candidate_that_cannot_load_is_cached_as_failed_and_the_next_one_serves(home, tmp_path):
    cands = {"unloadable": (Unloadable, str(home)), "fast": (Fast, str(home))}
    lines = []
    name, _, results, _ = run_select(cands, seconds=0.4, say=lines.append, defer=True)
    assert name == "fast" and results["unloadable"]["error"].startswith("load failed") and results["fast"]["unmeasured"]
    assert "octo: bench unloadable FAILED: load failed: corrupt file" in lines
    assert not any(m.startswith("octo: bench unloadable not measured") for m in lines), lines
    assert _bench_files(tmp_path) == ["unloadable"]  # a failed load stands, as in a measurement
    LOADS.clear()
    name, _, results, _ = run_select(cands, seconds=0.4, say=lines.append, defer=True)
    assert name == "fast" and LOADS == ["fast"] and results["unloadable"]["cached"]  # not tried again


def test_no_candidate_that_loads_is_an_error_naming_each(home):
    with pytest.raises(RuntimeError, match="no candidate engine could be loaded .unloadable: load failed"):
        run_select({"unloadable": (Unloadable, str(home))}, seconds=0.4, say=lambda m: None, defer=True)


def test_with_every_engine_measured_a_gateway_start_is_the_cached_one(home):
    cands = {"slow": (Slow, str(home)), "fast": (Fast, str(home))}
    run_select(cands, seconds=0.4, say=lambda m: None)
    LOADS.clear()
    name, _, results, _ = run_select(cands, seconds=0.4, say=lambda m: None, defer=True)
    assert name == "fast" and LOADS == ["fast"] and all(r["cached"] for r in results.values())


def _pending_unmeasured(home, serving, made, first_serving=True):
    """What a start that served ``serving`` at once left: both engines unmeasured."""
    classes = {"fast": Fast, "slow": Slow}
    keys = {n: cache_key(c, str(home)) for n, c in classes.items()}

    def make(n):
        made.append(FakeCandidate(classes[n], str(home)))
        return made[-1]

    names = sorted(classes, key=lambda n: n != serving)
    return Pending("m", serving, 0.2, keys, {n: unmeasured() for n in classes}, make,
                   {n: str(home) for n in classes}, names, first=True, unchosen=first_serving)


def test_engines_never_measured_are_measured_while_idle_and_the_fastest_wins_without_a_margin(home):
    made, lines = [], []
    pending = _pending_unmeasured(home, "slow", made)
    rows = dict(pending.results)  # the /v1/engines rows hold these dicts
    asyncio.run(asyncio.wait_for(remeasure.run(pending, Script(), lines.append), 30))
    assert [c.cls.name for c in made] == ["slow", "fast"] and pending.names == []  # the serving one first: the leader
    for n, key in pending.keys.items():
        assert cached_result(key)["score"] > 0 and not rows[n].get("unmeasured") and rows[n]["score"] > 0
    assert engine_choice.incumbent(pending.keys) == "fast"
    assert lines == [f"octo: 'm': measured while idle: the next start serves it with fast: highest benchmark score "
                     f"(slow scored {rows['slow']['score'] / rows['fast']['score']:.2f}x of it)"], lines


def test_a_serving_engine_that_was_not_chosen_has_no_lead_but_a_chosen_one_keeps_it(home):
    quiet = {"conditions": {"disturbed": False}}
    for unchosen, best in ((True, "fast"), (False, "slow")):
        pending = _pending_unmeasured(home, "slow", [], first_serving=unchosen)
        pending.results.update(slow={**quiet, "score": 100.0}, fast={**quiet, "score": 105.0})  # within 10%
        assert remeasure.settle(pending)[0] == best
        engine_choice.winner_file(pending.keys).unlink()


def test_a_first_measurement_that_is_disturbed_stands_provisionally_and_is_retried_later(home, monkeypatch):
    pending = _pending_unmeasured(home, "slow", [])
    FakeCandidate.verdicts = [True]  # slow's measurement: disturbed

    async def stop_at_the_retry(seconds):  # the retry waits 10 minutes: end the run there
        if seconds > 1:
            raise asyncio.CancelledError
    monkeypatch.setattr(remeasure.asyncio, "sleep", stop_at_the_retry)
    try:
        asyncio.run(remeasure.run(pending, Script(), lambda m: None))
    except asyncio.CancelledError:
        pass
    cached = cached_result(pending.keys["slow"])
    assert cached["score"] > 0 and cached["conditions"]["disturbed"] and not cached.get("unmeasured"), cached
    assert cached["remeasure"]["attempts"] == 1 and cached["remeasure"]["next_at"] > time.time() + 500
    assert pending.results["slow"]["provisional"] and not pending.results["slow"].get("unmeasured")
    assert "slow" in pending.names


def test_a_gateway_serves_at_once_and_switches_to_the_fastest_once_it_measured_them_idle(tmp_path):
    t0 = time.monotonic()
    with serve_timed(tmp_path, ("slowone", "fastone"), when_idle=True) as server:
        ready = time.monotonic() - t0
        active, bench = benchmarks_of(server)
        assert active == "slowone" and all(r["unmeasured"] and r["score"] is None for r in bench.values()), bench
        engines = server.get_json("/v1/engines")
        assert engines["selection"]["reason"].startswith("slowone at once, the first candidate"), engines
        log = server.log()
        assert "loading and measuring" not in log, log  # nothing measured before serving
        # idle: both are measured; fastone wins and takes over
        log, active, bench, engines, (status, body) = after_switch(server, "fastone", wait=120)
    assert "'timed-model': measured while idle: switching to fastone: highest benchmark score" in log, log[-3000:]
    assert "'timed-model' now served by fastone (switched from slowone in" in log, log[-3000:]
    assert active == "fastone" and bench["fastone"]["score"] > 1.5 * bench["slowone"]["score"], bench
    assert engines["selection"]["reason"].startswith("fastone: measured while idle, switched from slowone")
    assert status == 200 and body["choices"][0]["message"]["content"] == "after", body
    choice = list((tmp_path / "octo" / "bench" / "choice").glob("*.json"))
    assert len(choice) == 1 and json.loads(choice[0].read_text())["engine"] == "fastone"
    assert ready < 60  # (the start's own time is measured by bench/startup.py; here: it did not wait for a bench)
    with serve_timed(tmp_path, ("slowone", "fastone"), when_idle=True) as server:  # the next start knows
        active, bench = benchmarks_of(server)
        assert active == "fastone" and all(r["cached"] for r in bench.values()), bench
