"""Crash blame, back-off and stale figures (octo.runtime.supervision), without a server."""

from __future__ import annotations

import signal

from octo.runtime import supervision
from octo.runtime.prespawn import beat_interval


def test_only_a_signal_of_the_code_itself_blames_the_configuration():
    for sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
        assert supervision.config_fault(-sig, hung=False)
    assert supervision.config_fault(3, hung=False)  # a native library's exit(3)
    assert not supervision.config_fault(-signal.SIGKILL, hung=False)  # the OOM killer, an operator
    assert not supervision.config_fault(-signal.SIGSEGV, hung=True)  # the gateway killed it for silence
    assert not supervision.config_fault(supervision.FAULT_EXIT, hung=False)  # its own watchdog stopped it
    assert not supervision.config_fault(0, hung=False) and not supervision.config_fault(None, hung=False)


def test_back_off_doubles_up_to_its_cap():
    assert [supervision.backoff(n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert supervision.backoff(30) == supervision.BACKOFF_MAX_S == 300


def test_the_silence_bound_is_longer_while_a_worker_starts():
    assert supervision.silence_limit(10, serving=True) == 10
    assert supervision.silence_limit(10, serving=False) == 30
    assert supervision.silence_limit(60, serving=False) == 60
    assert beat_interval(10) == 1.0 and beat_interval(2) == 0.2


def test_a_fallback_remembered_after_a_sigkill_is_ignored(tmp_path, monkeypatch):
    from octo.engines.echo import EchoEngine

    monkeypatch.setenv("OCTO_BENCH_DIR", str(tmp_path))

    class Repacky(EchoEngine):
        name = "repacky"
        fallbacks = (({"repack": "false"}, "the weight repack crashed"),)

    supervision.remember(Repacky, "a.gguf", {"repack": "false"}, "the weight repack crashed (SIGSEGV)")
    assert supervision.remembered(Repacky, "a.gguf", {}) == 1
    supervision.remember(Repacky, "a.gguf", {"repack": "false"}, "the weight repack crashed (SIGKILL)")
    assert supervision.remembered(Repacky, "a.gguf", {}) == 0


def test_stale_figures_are_marked_with_their_age():
    out = supervision.stale_copy({"queue": {"pending": 2}, "cache": None}, 1.23456)
    assert out == {"queue": {"pending": 2, "stale": True, "age_s": 1.235}, "cache": None}
