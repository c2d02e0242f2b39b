"""What a busy host does to a start-up measurement's verdict: a measurement that ran out of time ("hung") while other
processes kept the cores busy is provisional (measured again while the model is idle, as a disturbed measurement is),
never a failure cached for good; a speech engine's measurement records the host's load as a text engine's does."""

from __future__ import annotations

import asyncio
import time

from test_selection import Fast, _Cand, spin
from test_speech_benchmark import Scripted

import octo.runtime.selection as selection
from octo.config import ServerConfig
from octo.errors import EngineCrashed
from octo.runtime.benchmark import speech_benchmark
from octo.runtime.loader import pending_of
from octo.runtime.selection import cached_result, candidate_key, provisional, select

BUSY = {"foreign_load": 0.93, "run_wait": 0.01, "steal": 0.0, "disturbed": True}


class HangsEngine(Fast):
    name = "hangs"


class Hangs(_Cand):
    """A candidate whose measurement never answers in time: what the worker's bound reports."""

    async def open(self, bench):
        if bench is None:
            return await super().open(bench)
        raise EngineCrashed("slowspeech hung while measuring 'm' (no answer in 29 s); the worker was stopped.",
                            code="engine_hung")


def _select(art, monkeypatch, busy):
    monkeypatch.setattr(selection, "busy_host", lambda window=0.5: busy)
    cands = {"hangs": Hangs(HangsEngine, art), "fast": _Cand(Fast, art)}
    lines: list[str] = []
    name, _, results, _ = asyncio.run(select(cands, seconds=0.3, say=lines.append))
    return name, results, lines, cands


def test_a_hang_while_measuring_on_a_busy_host_is_measured_again_when_idle(tmp_path, monkeypatch):
    art = tmp_path / "m.bin"
    art.write_bytes(b"x" * 100)
    name, results, lines, cands = _select(str(art), monkeypatch, BUSY)
    hung = results["hangs"]
    assert name == "fast" and hung["error"].startswith("hung:") and hung["provisional"], hung
    assert any("FAILED: hung" in line and "measured again when the model is idle" in line for line in lines), lines
    assert provisional(cached_result(candidate_key(cands["hangs"])))  # cached as provisional, not for good
    pending = pending_of("m", (), name, cands, results, ServerConfig(), {})
    assert pending is not None and "hangs" in pending.names  # the gateway measures it again while idle
    _, again, lines, _ = _select(str(art), monkeypatch, None)  # the next start: the verdict stands provisionally
    assert again["hangs"]["cached"] and again["hangs"]["provisional"]
    assert any("cached    FAILED: hung" in line and "measured again when the model is idle" in line for line in lines)


def test_a_hang_on_a_quiet_host_is_a_failure(tmp_path, monkeypatch):
    art = tmp_path / "m.bin"
    art.write_bytes(b"x" * 100)
    name, results, _, cands = _select(str(art), monkeypatch, None)
    assert results["hangs"]["error"].startswith("hung:") and not results["hangs"].get("provisional")
    assert not provisional(cached_result(candidate_key(cands["hangs"])))
    pending = pending_of("m", (), name, cands, results, ServerConfig(), {})  # (fast: provisional on a busy host)
    assert pending is None or "hangs" not in pending.names


class Spinning(Scripted):
    """Transcribes with ``cost`` seconds of CPU per second of audio (competing neighbours slow it down)."""

    def transcribe(self, request):
        seconds = len(request.audio) / 16000
        end = time.thread_time() + seconds * self.cost[self.threads]
        while time.thread_time() < end:
            pass
        return super().transcribe(request.__class__(audio=request.audio[:0]))


def test_a_busy_host_is_seen_as_busy():
    spinners = spin(6, 3.0)
    try:
        time.sleep(0.3)
        busy = selection.busy_host()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert busy is not None and busy["disturbed"] and busy["foreign_load"] >= 0.15, busy


def test_a_speech_measurement_records_the_hosts_load():
    quiet = speech_benchmark(Scripted({2: 0.02}, tunable=False), seconds=0.3)
    assert {"foreign_load", "run_wait", "steal", "disturbed", "loadavg"} <= set(quiet["conditions"])
    spinners = spin(6, 8.0)  # three busy processes a core, through the whole measurement
    try:
        time.sleep(0.3)
        busy = speech_benchmark(Spinning({2: 0.05}, tunable=False), seconds=1.0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert busy["conditions"]["disturbed"] and busy["conditions"]["foreign_load"] > 0.1, busy["conditions"]
    assert provisional(busy)  # the selection uses it provisionally and measures it again while idle
