"""The start-up benchmark of a speech engine: speech work, each of the engine's thread counts measured, the fastest
set (a scripted engine whose speed per thread count is known)."""

from __future__ import annotations

import time

from octo.engine import Engine, ModelInfo, Task, Transcription
from octo.runtime.benchmark import speech_benchmark


class Scripted(Engine):
    """Transcribes in ``cost[threads]`` seconds per second of audio."""

    name = "scripted-speech"
    tasks = frozenset({Task.TRANSCRIPTION})

    def __init__(self, cost: dict[int, float], tunable: bool = True) -> None:
        super().__init__()
        self.cost, self.tunable, self.threads = cost, tunable, max(cost)
        self.switches: list[int] = []
        self.info = ModelInfo(name="s", n_ctx=448)

    def thread_counts(self) -> list[int]:
        return sorted(self.cost, key=lambda n: n != self.threads) if self.tunable else []

    def set_threads(self, n: int) -> None:
        self.switches.append(n)
        self.threads = n

    def transcribe(self, request) -> Transcription:
        seconds = len(request.audio) / 16000
        time.sleep(seconds * self.cost[self.threads])
        return Transcription(text="x", language="en", duration=seconds)


def test_each_thread_count_is_measured_and_the_fastest_is_set():
    engine = Scripted({2: 0.08, 1: 0.04})  # one thread twice as fast, as CTranslate2's decoder on a 2-vCPU VM
    r = speech_benchmark(engine, seconds=1.0)
    assert r["error"] is None and r["threads"] == 1 and engine.threads == 1
    speeds = r["conditions"]["threads_x_realtime"]
    assert set(speeds) == {"2", "1"} and 20 < speeds["1"] <= 25 and 10 < speeds["2"] <= 12.5
    assert r["score"] == speeds["1"] and engine.switches == [2, 1]  # the last one measured is the best: no switch
    engine = Scripted({2: 0.04, 1: 0.08})
    r = speech_benchmark(engine, seconds=1.0)
    assert r["threads"] == 2 and engine.threads == 2 and engine.switches == [2, 1, 2]


def test_an_engine_without_thread_counts_is_measured_as_it_is():
    engine = Scripted({2: 0.05}, tunable=False)
    r = speech_benchmark(engine, seconds=0.5)
    assert r["threads"] is None and engine.switches == [] and "threads_x_realtime" not in r["conditions"]
    assert 16 < r["speech_x_realtime"] <= 20 and r["conditions"]["work"]["clips"] >= 1
