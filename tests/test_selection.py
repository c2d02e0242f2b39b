"""Start-up engine selection with fake engines of known speed (registered like any plugin engine)."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from octo.config import ServerConfig
from octo.engine import Engine, Feed, ModelInfo, Task
from octo.runtime.benchmark import (
    BATCH,
    MIN_BATCH_STEPS,
    MIN_DECODE_STEPS,
    MIN_PREFILL_TOKENS,
    micro_benchmark,
    score,
    upper_bound,
)
from octo.runtime.loader import LocalCandidate
from octo.runtime.selection import artifact_digest, distrust, host_fingerprint, provisional, select

LOADS: list[str] = []
UNLOADS: list[str] = []


class _Fake(Engine):
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    formats = frozenset({"fake"})
    step_seconds = 0.001

    def load(self, artifact, name):
        LOADS.append(self.name)
        self.info = ModelInfo(name=name, n_ctx=4096, eos_token_ids=frozenset({0}), n_vocab=100)
        self.threads = 2
        return self.info

    def unload(self):
        UNLOADS.append(self.name)
        self.info = None

    def tokenize(self, text, special=True):
        return [1 + (ord(c) % 90) for c in text]

    def step(self, feeds: list[Feed]):
        # cost grows with tokens processed, and is cheaper per token in a batch (like a real engine)
        self.spend(self.step_seconds * (1 + 0.25 * (sum(len(f.tokens) for f in feeds) - 1) / 8))
        for f in feeds:
            f.seq.n_cached += len(f.tokens)
        return [7 if f.sample else None for f in feeds]

    def spend(self, seconds: float) -> None:
        time.sleep(seconds)

    def thread_counts(self):
        return [2, 1]

    def set_threads(self, n):
        self.threads = n


class Fast(_Fake):
    name = "fast"
    step_seconds = 0.001


class Slow(_Fake):
    name = "slow"
    step_seconds = 0.004


class Broken(_Fake):
    name = "broken"
    step_seconds = 0.0001

    def step(self, feeds):
        raise RuntimeError("kaboom")


class Unloadable(_Fake):
    name = "unloadable"

    def load(self, artifact, name):
        raise RuntimeError("corrupt file")


def _load(cls, artifact):
    e = cls()
    e.load(artifact, "m")
    return e


class _Cand(LocalCandidate):
    """An in-process candidate that loads through ``_load`` (which records loads)."""

    def __init__(self, cls, artifact):
        super().__init__(cls, artifact, "m", ServerConfig())

    async def open(self, bench):
        self.engine = _load(self.cls, self.artifact)
        if bench is None:
            return 0.0, None
        self.wait_prepare()
        return 0.0, micro_benchmark(self.engine, *bench)


def run_select(cands, **kw):
    """select() over in-process candidates; returns the winner's engine in place of its candidate."""
    name, cand, results, reason = asyncio.run(select({n: _Cand(c, a) for n, (c, a) in cands.items()}, **kw))
    return name, cand.engine, results, reason


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    LOADS.clear()
    UNLOADS.clear()
    art = tmp_path / "model.bin"
    art.write_bytes(b"x" * 1000)
    return art


def test_micro_benchmark_measures_everything(home):
    r = micro_benchmark(_load(Fast, str(home)), seconds=0.6)
    assert r["error"] is None and r["threads"] in (1, 2)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["batch_decode_tok_s"] > r["decode_tok_s"]
    assert r["score"] == score(r) > 0 and r["seconds"] < 2.0


def test_picks_fastest_never_a_failed_one_and_unloads_losers(home):
    cands = {n: (c, str(home)) for n, c in
             [("slow", Slow), ("broken", Broken), ("fast", Fast), ("unloadable", Unloadable)]}
    name, engine, results, reason = run_select(cands, seconds=0.5, say=lambda m: None)
    assert name == "fast" and engine.info is not None and isinstance(engine, Fast)
    assert results["broken"]["error"].startswith("RuntimeError: kaboom") and results["broken"]["score"] == 0
    assert results["unloadable"]["error"].startswith("load failed") and results["unloadable"]["score"] == 0
    assert results["fast"]["score"] > results["slow"]["score"] > 0
    assert LOADS.count("fast") == 1  # the winner is not loaded twice
    assert "slow" in UNLOADS and "broken" in UNLOADS and "fast" not in UNLOADS
    assert "fast" in reason


def test_second_start_uses_cache_and_rebench_forces_a_run(home):
    cands = {"slow": (Slow, str(home)), "fast": (Fast, str(home))}
    run_select(cands, seconds=0.4, say=lambda m: None)
    LOADS.clear()
    t0 = time.monotonic()
    name, engine, results, _ = run_select(cands, seconds=0.4, say=lambda m: None)
    assert name == "fast" and all(r["cached"] for r in results.values())
    assert LOADS == ["fast"] and time.monotonic() - t0 < 0.3  # nothing benchmarked, winner loaded once
    LOADS.clear()
    _, _, results, _ = run_select(cands, seconds=0.4, rebench=True, say=lambda m: None)
    assert not any(r["cached"] for r in results.values()) and sorted(LOADS) == ["fast", "slow"]


def test_cache_key_changes_with_the_artifact(home):
    d1 = artifact_digest(home)
    home.write_bytes(b"y" * 1000)
    assert artifact_digest(home) != d1
    fp = host_fingerprint()
    assert {"cpu", "cores", "memory_gb", "accelerator"} <= set(fp)


def test_all_failing_raises(home):
    with pytest.raises(RuntimeError, match="no candidate engine"):
        run_select({"broken": (Broken, str(home))}, seconds=0.2, say=lambda m: None)


def test_a_candidate_that_cannot_win_stops_early_and_the_best_known_goes_first(home):
    cands = {"slow": (Slow, str(home)), "fast": (Fast, str(home))}
    _, _, first, _ = run_select(cands, seconds=1.0, say=lambda m: None)
    assert first["slow"]["stopped"] is None and first["slow"]["batch_decode_tok_s"] > 0  # measured before any leader
    LOADS.clear()
    lines: list[str] = []
    name, _, results, _ = run_select(cands, seconds=1.0, rebench=True, say=lines.append)
    assert LOADS[:2] == ["fast", "slow"]  # the best earlier result on this host runs first
    slow = results["slow"]
    assert name == "fast" and slow["stopped"].startswith("cannot win") and slow["batch_decode_tok_s"] is None
    assert slow["decode_tok_s"] > 0 and slow["seconds"] < 1.0
    assert upper_bound(slow) < results["fast"]["score"] and slow["score"] < upper_bound(slow)
    assert any("stopped early" in line for line in lines)


def test_early_stop_never_drops_a_candidate_that_could_win(home):
    fast = micro_benchmark(_load(Fast, str(home)), seconds=0.6)
    r = micro_benchmark(_load(Fast, str(home)), seconds=0.6, beat=0.5 * fast["score"])
    assert r["stopped"] is None and r["batch_decode_tok_s"] > 0


def test_a_steady_engine_settles_before_its_budget(home):
    r = micro_benchmark(_load(Fast, str(home)), seconds=5.0)
    assert r["decode_tok_s"] > 0 and r["batch_decode_tok_s"] > 0 and r["seconds"] < 3.0  # the budget is a ceiling


PREPARED: list[tuple[str, float]] = []
FIRST_STEP: list[float] = []


class Preparing(Slow):
    name = "preparing"

    @classmethod
    def prepare(cls):  # a slow import, done while the first candidate loads
        time.sleep(0.3)
        PREPARED.append((threading.current_thread().name, time.monotonic()))


class FirstMeasured(Fast):
    name = "first"

    def step(self, feeds):
        FIRST_STEP.append(time.monotonic())
        return super().step(feeds)


def test_prepare_runs_in_the_background_and_ends_before_any_measurement(home):
    PREPARED.clear()
    FIRST_STEP.clear()
    run_select({"first": (FirstMeasured, str(home)), "preparing": (Preparing, str(home))}, seconds=0.4,
           say=lambda m: None)
    assert [p[0] for p in PREPARED] == ["octo-prepare"]  # only the candidates after the first, in the background
    assert PREPARED[0][1] <= FIRST_STEP[0]  # no measurement shares the machine with it


# -- a floor of work whatever the budget; disturbance; what a cached result must say ------------------
class _Cold(_Fake):
    """Like a real engine, the first step of each size it has not run yet is slow (buffers, kernel choice)."""

    cold_seconds = 0.04

    def load(self, artifact, name):
        self.seen = set()
        return super().load(artifact, name)

    def step(self, feeds):
        n = sum(len(f.tokens) for f in feeds)
        if n not in self.seen:
            self.seen.add(n)
            time.sleep(self.cold_seconds)
        return super().step(feeds)


class ColdFast(_Cold):
    name = "coldfast"
    step_seconds = 0.001


class ColdSlow(_Cold):
    name = "coldslow"
    step_seconds = 0.003


class _Quiet:
    """Stands in for LoadMonitor: reports the next verdict of ``verdicts`` (then quiet) for each measurement."""

    verdicts: list[bool] = []

    def start(self):
        return self

    def disturbed_so_far(self):  # the verdict stop() will give, without taking it
        return bool(_Quiet.verdicts and _Quiet.verdicts[0])

    def stop(self):
        disturbed = _Quiet.verdicts.pop(0) if _Quiet.verdicts else False
        return {"foreign_load": 0.6 if disturbed else 0.0, "run_wait": 0.4 if disturbed else 0.0, "steal": 0.0,
                "disturbed": disturbed}


@pytest.fixture
def monitor(monkeypatch):
    import octo.runtime.benchmark as sel

    waits: list[float] = []
    monkeypatch.setattr(sel, "LoadMonitor", _Quiet)
    monkeypatch.setattr(sel, "wait_quiet", lambda limit: waits.append(limit) or True)
    _Quiet.verdicts = []
    return waits


def _stored(home) -> dict[str, dict]:
    out = {}
    for f in (home.parent / "bench").glob("*.json"):
        data = json.loads(f.read_text())
        out[data["key"]["engine"]] = data["result"]
    return out


def test_a_tiny_budget_still_measures_the_floor_and_the_fastest_wins(home, monitor):
    lines: list[str] = []
    name, _, results, _ = run_select({"coldslow": (ColdSlow, str(home)), "coldfast": (ColdFast, str(home))},
                                     seconds=0.05, say=lines.append)
    assert name == "coldfast" and results["coldfast"]["score"] > 1.5 * results["coldslow"]["score"]
    for r in results.values():
        work = r["conditions"]["work"]
        assert work["prefill_tokens"] >= MIN_PREFILL_TOKENS and work["decode_tokens"] >= 2 * MIN_DECODE_STEPS
        assert r["conditions"]["budget_too_small"] and r["conditions"]["budget_s"] == 0.05
    assert results["coldslow"]["conditions"]["work"]["batch_tokens"] >= BATCH * MIN_BATCH_STEPS
    assert sum("--bench-seconds 0.05 is too small to measure meaningfully" in line for line in lines) == 2


def test_a_disturbed_measurement_is_repeated_and_one_that_stays_disturbed_is_cached_as_provisional(home, monitor):
    _Quiet.verdicts = [True]  # fast's first measurement is disturbed, its second is not
    lines: list[str] = []
    name, _, results, _ = run_select({"fast": (Fast, str(home))}, seconds=0.2, say=lines.append)
    fast = results["fast"]["conditions"]
    assert [a["disturbed"] for a in fast["attempts"]] == [True, False] and not fast["disturbed"]
    assert len(monitor) == 1 and "fast" in _stored(home)  # waited for quiet once; the quiet result is cached
    assert not fast.get("cut_short") and results["fast"]["seconds"] >= 0.2  # the undisturbed repeat: whole budget
    _Quiet.verdicts = [True, True]  # disturbed both times: decides this start, cached as provisional
    (home.parent / "bench").rename(home.parent / "old-bench")
    name, _, results, reason = run_select({"fast": (Fast, str(home))}, seconds=0.2, say=lines.append)
    assert name == "fast" and results["fast"]["conditions"]["disturbed"] and results["fast"]["provisional"]
    assert len(results["fast"]["conditions"]["attempts"]) == 2 and _stored(home)["fast"]["conditions"]["disturbed"]
    assert any("other processes were busy" in line and "decides provisionally" in line for line in lines)
    assert not any("DISTURBED" in line for line in lines)
    assert "provisional: fast measured while other processes were busy" in reason
    n_monitor = len(monitor)
    lines.clear()  # the next start measures nothing: the provisional result stands until measured again
    name, _, results, _ = run_select({"fast": (Fast, str(home))}, seconds=0.2, say=lines.append)
    assert name == "fast" and results["fast"]["cached"] and results["fast"]["provisional"]
    assert len(monitor) == n_monitor and not any("loading and measuring" in line for line in lines)
    assert any("measured again when the model is idle" in line for line in lines)


def test_a_host_that_stays_busy_gets_no_repeat(home, monitor, monkeypatch):
    """A disturbed measurement is repeated only when the other processes calm down within QUIET_WAIT_S: on a host
    that stays busy a repeat would be disturbed as well, and would only delay the start; the result stands as
    provisional (measured again when the model is idle)."""
    import octo.runtime.benchmark as bm

    waits: list[float] = []
    monkeypatch.setattr(bm, "wait_quiet", lambda limit: waits.append(limit) or False)  # never calms down
    _Quiet.verdicts = [True, True]
    name, _, results, reason = run_select({"fast": (Fast, str(home))}, seconds=0.2, say=lambda m: None)
    cond = results["fast"]["conditions"]
    assert waits == [bm.QUIET_WAIT_S] and [a["disturbed"] for a in cond["attempts"]] == [True]
    assert name == "fast" and results["fast"]["provisional"] and _stored(home)["fast"]["conditions"]["disturbed"]
    assert "provisional: fast measured while other processes were busy" in reason
    assert _Quiet.verdicts == [True]  # one measurement taken, not two
    # two candidates: once the first saw the host stay busy, the second does not wait for quiet at all
    waits.clear()
    _Quiet.verdicts = [True, True, True]
    (home.parent / "bench").rename(home.parent / "busy-bench")
    name, _, results, _ = run_select({"fast": (Fast, str(home)), "slow": (Slow, str(home))}, seconds=0.2,
                                     say=lambda m: None)
    assert waits == [bm.QUIET_WAIT_S] and _Quiet.verdicts == [True]  # one wait, one measurement each
    assert all(r["provisional"] and len(r["conditions"]["attempts"]) == 1 for r in results.values())


def test_a_measurement_disturbed_after_its_prefill_measures_the_floor_only(home, monitor, monkeypatch):
    """Once a measurement is disturbed (checked after its prefill phase), the rest measures the floor only: the result
    is provisional anyway, so the rest of its budget would only delay the start."""
    import octo.runtime.benchmark as bm

    monkeypatch.setattr(bm, "wait_quiet", lambda limit: False)
    _Quiet.verdicts = [True]
    _, _, results, _ = run_select({"fast": (Fast, str(home))}, seconds=1.0, say=lambda m: None)
    r = results["fast"]
    assert r["provisional"] and r["conditions"]["cut_short"] and r["seconds"] < 0.5, r
    work = r["conditions"]["work"]
    assert work["decode_tokens"] >= MIN_DECODE_STEPS and work["batch_tokens"] >= BATCH * MIN_BATCH_STEPS
    assert r["decode_tok_s"] and r["batch_decode_tok_s"] and r["score"] > 0
    _Quiet.verdicts = []  # undisturbed: the whole budget (the measurement a calm host gets)
    (home.parent / "bench").rename(home.parent / "cut-bench")
    _, _, results, _ = run_select({"fast": (Fast, str(home))}, seconds=1.0, say=lambda m: None)
    assert not results["fast"]["conditions"].get("cut_short") and results["fast"]["seconds"] >= 0.75


def test_a_cached_result_stands_only_for_a_budget_it_covered_and_undisturbed(home, monitor):
    cands = {"slow": (Slow, str(home)), "fast": (Fast, str(home))}
    run_select(cands, seconds=0.2, say=lambda m: None)
    assert {r["conditions"]["budget_s"] for r in _stored(home).values()} == {0.2}
    lines: list[str] = []
    _, _, results, _ = run_select(cands, seconds=0.4, say=lines.append)  # a bigger budget: measured again
    assert not any(r["cached"] for r in results.values())
    assert any("it was measured with a 0.2 s budget, less than the 0.4 s asked" in line for line in lines)
    _, _, results, _ = run_select(cands, seconds=0.2, say=lambda m: None)  # a smaller one: the cache stands
    assert all(r["cached"] for r in results.values())
    assert distrust({"score": 1.0}, 0.2) == "it does not record how it was measured"  # an older octo's result
    assert distrust({"conditions": {"budget_s": 5, "disturbed": True}}, 0.2) is None  # stands, provisionally
    assert provisional({"conditions": {"budget_s": 5, "disturbed": True}})
    assert distrust({"error": "crashed: x", "conditions": {"budget_s": 0.2, "disturbed": False}}, 3.0) is None


def test_the_load_monitor_sees_a_busy_neighbour(tmp_path):
    from octo.benchload import LoadMonitor

    spinners = spin(CROWD, 30)
    try:
        time.sleep(0.2)
        mon = LoadMonitor().start()
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass
        cond = mon.stop()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert cond["disturbed"] and cond["foreign_load"] >= 0.3 and cond["run_wait"] >= 0.1, cond


# -- the real server with engines of known speed (tests/plugins/timed.py): fastone is twice slowone's speed ----
# Two spinners a core: with one a core, CFS may leave the measured thread alone on a core (three tasks on two
# cores split 2 + 1 and stay so), where it runs at full speed and rightly counts as undisturbed.
CROWD = 2 * len(os.sched_getaffinity(0))


def spin(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes, each spinning on a core for ``seconds``."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def serve_timed(tmp_path, order, *extra, bench="0.5", when_idle=False):
    """``octo serve timed-model`` whose candidates are the timed engines in ``order``, measured before serving (with
    ``when_idle``: served at once, measured while the model is idle: ``--bench-when-idle``)."""
    from serverproc import REPO, run_octo

    catalog = tmp_path / "models.yaml"
    catalog.write_text("models:\n  - id: timed-model\n    task: chat\n    default_variant: default\n    variants:\n"
                       "      default:\n" + "".join(f"        {e}: none://timed\n" for e in order))
    env = {"OCTO_HOME": str(tmp_path / "octo"), "OCTO_CATALOG": str(catalog)}
    return run_octo("timed-model", "--plugins-dir", str(REPO / "tests" / "plugins"), "--bench-seconds", bench,
                    *(["--bench-when-idle"] if when_idle else []), *extra, env=env)


def benchmarks_of(server) -> tuple[str, dict[str, dict]]:
    engines = server.get_json("/v1/engines")
    return engines["active"], {r["name"]: r["benchmark"] for r in engines["data"] if r.get("benchmark")}


def test_the_smallest_budget_allowed_still_crowns_the_fastest(tmp_path):
    with serve_timed(tmp_path, ("slowone", "fastone"), bench="0.2") as server:
        active, bench = benchmarks_of(server)
        log = server.log()
    assert active == "fastone" and bench["fastone"]["score"] > 1.4 * bench["slowone"]["score"]
    for r in bench.values():
        assert r["conditions"]["work"]["prefill_tokens"] >= MIN_PREFILL_TOKENS and r["conditions"]["budget_s"] == 0.2
    assert "--bench-seconds 0.2 is too small to measure meaningfully" in log


def after_switch(server, engine: str, wait: float = 90) -> tuple:
    """Wait (up to ``wait`` s) until ``engine`` serves timed-model, having won a measurement while it was idle; returns
    the log, the active engine and benchmarks, /v1/engines, and a chat answered after it (status, body)."""
    deadline = time.monotonic() + wait
    while f"now served by {engine}" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = server.log()
    active, bench = benchmarks_of(server)
    return log, active, bench, server.get_json("/v1/engines"), server.post_json("/v1/chat/completions", {
        "model": "timed-model", "max_tokens": 4, "messages": [{"role": "user", "content": "after"}]})


def _when_marked(mark: Path, engine: str, start) -> threading.Thread:
    """Run ``start()`` in a thread as soon as ``engine`` takes its first benchmark step (its mark file appears)."""

    def watch():
        deadline = time.monotonic() + 60
        while not Path(f"{mark}.{engine}").exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        start()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_busy_neighbour_during_the_whole_selection(tmp_path):
    mark, spinners = tmp_path / "mark", []

    def neighbours() -> None:  # started at the first candidate's first step, which waits until they compute
        spinners.extend(spin(CROWD, 60))
        time.sleep(0.5)  # (a loaded host starts a Python process slowly)
        Path(f"{mark}.slowone.go").touch()

    # every core busy from the first candidate's first step to the end of the start-up
    watcher = _when_marked(mark, "slowone", neighbours)
    cached = lambda: {json.loads(f.read_text())["key"]["engine"]: json.loads(f.read_text())["result"]  # noqa: E731
                      for f in (tmp_path / "octo" / "bench").glob("*one-*.json")}
    try:
        with serve_timed(tmp_path, ("slowone", "fastone"), "-o", f"timed_mark={mark}", "-o", "timed_hold=slowone",
                          bench="0.3") as server:
            active, bench = benchmarks_of(server)
            assert active == "fastone", bench
            for name, r in bench.items():  # seen; not repeated on a host that stays busy; cached as provisional
                assert r["conditions"]["disturbed"] and len(r["conditions"]["attempts"]) == 1, (name, r)
                assert r["provisional"], r
            assert {n: r["conditions"]["disturbed"] for n, r in cached().items()} == {"slowone": True, "fastone": True}
            assert "provisional: slowone, fastone measured while other processes were busy" in server.log()
            watcher.join(5)
            for p in spinners:  # the host calms down: both are measured again while the model is idle
                p.kill()
                p.wait()
            deadline = time.monotonic() + 90
            while "again while the model is idle" not in server.log() and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()  # a request now stops that measurement (its worker is killed) and is answered
            status, body = server.post_json("/v1/chat/completions", {
                "model": "timed-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
            assert time.monotonic() - t0 < 5
            while "measured again while idle" not in server.log() and time.monotonic() < deadline:
                time.sleep(0.5)
            log = server.log()
            assert "a request came; measuring" in log and "at the next idle moment" in log, log[-3000:]
            active, bench = benchmarks_of(server)
    finally:
        watcher.join(5)
        for p in spinners:
            p.kill()
            p.wait()
    assert "'timed-model': measured again while idle: fastone" in log, log[-3000:]
    assert active == "fastone"  # the serving engine is not switched; here it stays the choice anyway
    for name, r in cached().items():  # undisturbed now, in the cache and in /v1/engines
        assert not r["conditions"]["disturbed"] and not r.get("provisional"), (name, r)
        assert not bench[name]["conditions"]["disturbed"], bench[name]
    choice = list((tmp_path / "octo" / "bench" / "choice").glob("*.json"))
    assert len(choice) == 1 and json.loads(choice[0].read_text())["engine"] == "fastone"


def test_a_neighbour_that_disturbs_the_fastest_engines_measurement_is_waited_out(tmp_path):
    mark, spinners = tmp_path / "mark", []
    # 4 processes on 2 cores for 1 s from fastone's first step: its first measurement only (without the repeat,
    # that makes fastone look slower than slowone, which then wins)
    watcher = _when_marked(mark, "fastone", lambda: spinners.extend(spin(4, 1.0)))
    try:
        with serve_timed(tmp_path, ("fastone", "slowone"), "-o", f"timed_mark={mark}") as server:
            active, bench = benchmarks_of(server)
    finally:
        watcher.join(5)
        for p in spinners:
            p.kill()
            p.wait()
    attempts = bench["fastone"]["conditions"]["attempts"]
    assert attempts[0]["disturbed"] and len(attempts) == 2, attempts  # the neighbour was seen and waited out
    assert active == "fastone", bench


def test_an_engine_that_only_lost_because_the_host_was_busy_takes_over_once_measured_idle(tmp_path):
    mark, spinners = tmp_path / "mark", []
    stop = lambda: [(p.kill(), p.wait()) for p in spinners]  # noqa: E731
    # 8 processes on 2 cores through both of fastone's measurements, gone when slowone's starts: fastone looks
    # slower than slowone (disturbed: provisional), slowone wins and serves
    watchers = [_when_marked(mark, "fastone", lambda: spinners.extend(spin(8, 60))),
                _when_marked(mark, "slowone", stop)]
    try:
        with serve_timed(tmp_path, ("fastone", "slowone"), "-o", f"timed_mark={mark}") as server:
            active, bench = benchmarks_of(server)
            assert active == "slowone" and bench["fastone"]["provisional"], bench
            # idle now: fastone is measured again, wins clearly, and takes over
            log, active, bench, engines, (status, body) = after_switch(server, "fastone")
    finally:
        for w in watchers:
            w.join(5)
        stop()
    assert "'timed-model': measured again while idle: switching to fastone: it scored more than 1.10x slowone" in log
    assert "'timed-model' now served by fastone (switched from slowone in" in log, log[-3000:]
    assert active == "fastone" and not bench["fastone"]["conditions"]["disturbed"], bench
    assert bench["fastone"]["score"] > 1.5 * bench["slowone"]["score"]
    assert engines["selection"]["reason"].startswith("fastone: measured again while idle, switched from slowone")
    assert status == 200 and body["choices"][0]["message"]["content"] == "after", body  # served by the new engine
    choice = list((tmp_path / "octo" / "bench" / "choice").glob("*.json"))
    assert len(choice) == 1 and json.loads(choice[0].read_text())["engine"] == "fastone"


class _Busy(_Fake):
    """Computes (spins) through its steps, so other processes on the cores slow it down and show as run-queue
    wait, as they would a real engine."""

    def spend(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


class BusyFast(_Busy):
    name = "fast"
    step_seconds = 0.001


class Close(_Busy):
    """About 5% slower than BusyFast: within the margin a switch needs."""

    name = "close"
    step_seconds = 0.00105


def test_the_chosen_engine_stays_unless_a_challenger_wins_clearly_and_quietly():
    from octo.runtime.engine_choice import beats

    quiet, noisy = {"conditions": {"disturbed": False}}, {"conditions": {"disturbed": True}}
    kept = {**quiet, "score": 100.0}
    assert not beats("b", {**quiet, "score": 109.0}, "a", kept, "a")  # within 10%: the earlier choice stays
    assert beats("b", {**quiet, "score": 111.0}, "a", kept, "a")  # a clear, undisturbed win moves it
    assert not beats("b", {**noisy, "score": 200.0}, "a", kept, "a")  # never on a disturbed measurement
    assert beats("a", {**noisy, "score": 95.0}, "b", {**quiet, "score": 100.0}, "a")  # the kept one, met second
    assert not beats("a", {**quiet, "score": 90.0}, "b", {**quiet, "score": 100.0}, "a")
    assert beats("b", {**noisy, "score": 101.0}, "c", {**quiet, "score": 100.0}, None)  # no choice yet: score


def test_two_starts_under_contention_pick_the_same_engine(home, monkeypatch):
    import octo.runtime.benchmark as sel

    cands = {"fast": (BusyFast, str(home)), "close": (Close, str(home))}
    with monkeypatch.context() as m:  # a quiet start chooses (its measurements reported undisturbed)
        m.setattr(sel, "LoadMonitor", _Quiet)
        _Quiet.verdicts = []
        first, _, _, reason = run_select(cands, seconds=0.3, say=lambda m: None)
    assert first in reason and "highest benchmark score" in reason
    picks = []
    spinners = spin(3, 30.0)  # then the host gets busy, and every start measures again
    try:
        for _ in range(2):
            name, _, _, reason = run_select(cands, seconds=0.3, rebench=True, say=lambda m: None)
            picks.append(name)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert picks == [first, first], (first, picks)
    assert "as chosen before on this host" in reason
