"""Start-up engine selection with fake engines of known speed (registered like any plugin engine)."""

import asyncio
import threading
import time

import pytest

from octo.config import ServerConfig
from octo.engine import Engine, Feed, ModelInfo, Task
from octo.loader import LocalCandidate
from octo.selection import artifact_digest, host_fingerprint, micro_benchmark, score, select, upper_bound

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
        time.sleep(self.step_seconds * (1 + 0.25 * (sum(len(f.tokens) for f in feeds) - 1) / 8))
        for f in feeds:
            f.seq.n_cached += len(f.tokens)
        return [7 if f.sample else None for f in feeds]

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
        return 0.0, micro_benchmark(self.engine, bench[0], beat=bench[1])


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
