"""Which CTranslate2 thread count transcribes faster on this host, measured while the model is idle.

The start-up benchmark measures a speech engine's thread counts only where several engines compete for a model
(``octo serve whisper-base``). A model only faster-whisper serves (a CTranslate2 folder, ``Systran/faster-whisper-*``,
``--engine faster-whisper``) would stay on all cores, where on some hosts one decoder thread decodes twice as fast
(a 2-vCPU VM here: 140 against 70 tokens/s). So the engine measures its other thread count itself, from the engine
loop's idle moments (``Engine.idle_work``), never between a request and its answer:

* the model serves at once, on the cached verdict for this host, build, model file and settings (``OCTO_HOME/probe``)
  when there is one, else on all cores;
* the probe loads the other configuration beside the serving model and times the same work on both (one 30-second
  window encoded and ``PROBE_TOKENS`` tokens decoded, end-of-text suppressed), checking for a waiting request between
  CTranslate2 calls (a request waits at most one call, under a second for "base"; the probe then drops the copy
  and runs again at a later idle moment);
* only a measurement that other processes did not disturb (``octo.benchload``) is cached and followed, and the
  other count serves only when it is faster by ``MARGIN``; a disturbed one is recorded with the time of its next
  try (``DISTURBED_RETRY_S``), so it is not repeated on every start; a busy host postpones the probe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from octo import benchload
from octo.paths import octo_home

log = logging.getLogger("octo.engines.faster_whisper")

PROBE_TOKENS = 96  # decoded per configuration (about half a window of speech: the decoder weighs as in real work)
MARGIN = 0.10  # the other count serves only when at least this much faster
INTERRUPTED_RETRY_S = 2.0
BUSY_RETRY_S = 30.0
DISTURBED_RETRY_S = (600.0, 3600.0, 6 * 3600.0, 86400.0)  # after the 1st, 2nd, 3rd, 4th+ disturbed measurement
VERSION = 1  # of this probe: a change of its work makes earlier verdicts stale


class Interrupted(Exception):
    """A request waits: the probe stops and leaves the serving model as it was."""


def cache_file(engine: Any) -> Path:
    """Where the verdict for this host, build, model file and settings lives."""
    model_bin = engine.path / "model.bin"
    st = model_bin.stat()
    o = engine.opts
    parts = [benchload.cpu_flags(), os.cpu_count(), engine.version(), os.path.realpath(model_bin), st.st_size,
             st.st_mtime_ns, o.get("compute_type", "auto"), o.get("device", "cpu"), o.get("workers", 1),
             o.get("encoder_threads"), VERSION]
    key = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:20]
    return octo_home() / "probe" / f"faster-whisper-threads-{key}.json"


def read_record(engine: Any) -> dict[str, Any] | None:
    try:
        record = json.loads(cache_file(engine).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(engine: Any, record: dict[str, Any]) -> None:
    from octo.atomic import write_json

    try:
        write_json(cache_file(engine), record, indent=1)
    except OSError:  # a read-only OCTO_HOME: measured again at the next start
        log.debug("could not cache the thread probe's record", exc_info=True)


def verdict_threads(record: dict[str, Any] | None) -> int | None:
    """The thread count a concluded probe's ``record`` (``read_record``) chose, or None (none yet, or pending)."""
    threads = record.get("threads") if record else None
    return threads if isinstance(threads, int) and threads > 0 else None


def measure(model: Any, interrupted: Any) -> float:
    """Seconds for the probe's work on ``model`` (a faster-whisper WhisperModel): one window encoded and
    ``PROBE_TOKENS`` tokens decoded, after an untimed encode and a few decoded tokens (a new model's first calls
    allocate: untimed on both models alike)."""
    import ctranslate2
    import numpy as np
    from faster_whisper.tokenizer import Tokenizer

    ct2 = model.model
    features = np.random.default_rng(0).standard_normal((1, ct2.n_mels, 3000)).astype(np.float32)
    storage = ctranslate2.StorageView.from_array(features)
    tokenizer = Tokenizer(model.hf_tokenizer, ct2.is_multilingual, task="transcribe",
                          language="en" if ct2.is_multilingual else None)
    prompt = [*tokenizer.sot_sequence, tokenizer.no_timestamps]
    check(interrupted)
    ct2.generate(ct2.encode(storage), [prompt], beam_size=1, max_length=8)  # untimed: a new model's first calls
    check(interrupted)
    started = time.perf_counter()
    encoded = ct2.encode(storage)
    encode_s = time.perf_counter() - started
    check(interrupted)
    started = time.perf_counter()  # CTranslate2 decodes min(max_length // 2, ...) new tokens (ct2_max_new_tokens)
    out = ct2.generate(encoded, [prompt], beam_size=1, max_length=2 * PROBE_TOKENS, suppress_blank=False,
                       suppress_tokens=[tokenizer.eot])
    decode_s = time.perf_counter() - started
    n = len(out[0].sequences_ids[0])
    return encode_s + decode_s * PROBE_TOKENS / max(1, n)


def room_for_a_copy(model_bin: Path) -> bool:
    """Whether the host has memory for the probe's second model (two copies: the encoder's, where it splits) with as
    much again to spare; True where /proc/meminfo cannot tell."""
    available = benchload.available_memory()
    return available is None or available > 4 * model_bin.stat().st_size


def check(interrupted: Any) -> None:
    if interrupted():
        raise Interrupted


class ThreadProbe:
    """The engine's pending measurement of its other thread count (``FasterWhisperEngine.idle_work`` runs it)."""

    def __init__(self, engine: Any, record: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.attempts = int((record or {}).get("attempts", 0))
        self.retry_at = float((record or {}).get("retry_at", 0.0))

    def run(self, interrupted: Any, watch_load: bool = True) -> float | None:
        """One try: None once concluded (nothing left to do), else the idleness to wait before the next try."""
        eng = self.engine
        counts = eng.thread_counts()
        if len(counts) < 2:
            return None
        wait = self.retry_at - time.time()
        if wait > 0:
            return wait
        if watch_load and not benchload.quiet_now(0.3):
            return BUSY_RETRY_S
        if not room_for_a_copy(eng.path / "model.bin"):
            log.info("faster-whisper: too little free memory to measure a second thread count beside the model; "
                     "it serves on %d thread(s) (-o threads=N sets the count)", counts[0])
            return None
        monitor = benchload.LoadMonitor().start()
        try:
            seconds = {counts[0]: measure(eng.model, interrupted)}
            candidate = eng._model(counts[1])
            seconds[counts[1]] = measure(candidate, interrupted)
        except Interrupted:
            log.debug("faster-whisper: the thread probe stopped for a request; it goes on at the next idle moment")
            return INTERRUPTED_RETRY_S
        conditions = monitor.stop()
        if watch_load and conditions.get("disturbed"):
            self.attempts += 1
            self.retry_at = time.time() + DISTURBED_RETRY_S[min(self.attempts, len(DISTURBED_RETRY_S)) - 1]
            write_record(eng, {"pending": True, "attempts": self.attempts, "retry_at": self.retry_at})
            log.debug("faster-whisper: the thread probe was disturbed by other processes; tried again later")
            return self.retry_at - time.time()
        now, other = counts
        best = other if seconds[other] * (1 + MARGIN) < seconds[now] else now
        write_record(eng, {"threads": best, "seconds": {str(k): round(v, 4) for k, v in seconds.items()},
                           "probe_tokens": PROBE_TOKENS, "conditions": conditions, "measured_at": time.time()})
        if best != now:
            eng.adopt(candidate, best)
        eng.info.extra["threads_chosen_by"] = "idle probe"
        loser = other if best == now else now
        log.info("faster-whisper: %d thread(s) serve this model (a window and %d tokens: %.2f s; %d thread(s): %.2f s)"
                 "; cached for later starts", best, PROBE_TOKENS, seconds[best], loser, seconds[loser])
        return None
