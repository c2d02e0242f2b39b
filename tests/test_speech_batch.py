"""faster-whisper's cross-request batching: a request batched with others decodes exactly as it does alone.

Random (fixed-seed) weights decide nothing about content, so these tests compare the batched answers with the
same requests transcribed alone (faster-whisper's own ``WhisperModel.transcribe``), field by field, and check
that the batch really shared CTranslate2 calls.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("ctranslate2")
pytest.importorskip("faster_whisper")
pytest.importorskip("whisper")

from octo.engines.faster_whisper import FasterWhisperEngine  # noqa: E402
from octo.engines.faster_whisper import batch as fw_batch  # noqa: E402
from test_whisper import clips as clips  # noqa: E402 - the whisper engine's spoken clips (a fixture)

from octo.engine import EngineConfig, TranscriptionRequest  # noqa: E402
from octo.errors import InvalidRequest  # noqa: E402
from octo.synth.speech import build_whisper_ct2  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed (installed by .ci/run)",
)
SHAPE = "test3"


def engine(**options: str) -> FasterWhisperEngine:
    eng = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "10", **options}))
    eng.load(str(build_whisper_ct2(SHAPE)), "t")
    return eng


def fields(r):
    """Everything a response carries; the scores apart (:func:`same`)."""
    return (r.text, r.language, r.duration, [(s.id, s.seek, s.start, s.end, s.text, s.tokens, s.temperature,
                                              s.compression_ratio, s.words) for s in r.segments])


def same(batched, alone) -> None:
    """Equal in every field; scores within 1e-6 (a sum of float32 log-probabilities may differ in its last bit
    between a batch and a single row: the tokens and every decision do not)."""
    assert fields(batched) == fields(alone)
    scores = [x for s in batched.segments for x in (s.avg_logprob, s.no_speech_prob)]
    assert scores == pytest.approx([x for s in alone.segments for x in (s.avg_logprob, s.no_speech_prob)],
                                   rel=1e-6, abs=1e-9)


def requests(clips) -> list[TranscriptionRequest]:
    long = np.concatenate([clips["hello"]] * 9)  # ~40 s: several windows, previous text as prompt
    return [
        TranscriptionRequest(audio=clips["hello"]),
        TranscriptionRequest(audio=clips["numbers"], language="en"),
        TranscriptionRequest(audio=clips["weather"], prompt="Forecast."),
        TranscriptionRequest(audio=clips["french"], task="translate"),
        TranscriptionRequest(audio=long, language="en", word_timestamps=True),
        TranscriptionRequest(audio=np.zeros(16000, np.float32), language="en"),
    ]


def counting(monkeypatch) -> list:
    """Every Rendezvous made from now on, to read how many calls its batches served."""
    made = []
    original = fw_batch.Rendezvous.__init__

    def init(self, *args, **kw):
        original(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(fw_batch.Rendezvous, "__init__", init)
    return made


def test_batched_requests_decode_as_alone(clips, monkeypatch):
    """Greedy (no fallback): deterministic, so the answers must be equal in every field."""
    eng = engine(temperature_increment="0")
    reqs = requests(clips)
    alone = [eng.transcribe(r) for r in reqs]
    made = counting(monkeypatch)
    done: list[int] = []
    batched = eng.transcribe_batch(reqs, lambda i, r: done.append(i))
    assert sorted(done) == list(range(len(reqs)))
    for a, b in zip(alone, batched, strict=True):
        same(b, a)
    assert len({tuple(tuple(s.tokens) for s in r.segments) for r in batched[:4]}) == 4  # no rows mixed up
    (rv,) = made
    assert rv.calls > rv.rounds  # calls really shared CTranslate2 batches


def test_batched_fallback_follows_the_same_schedule(clips):
    """OpenAI's fallback (thresholds 2.4 / -1.0 / 0.6, temperatures 0..1): random weights fail the greedy pass, so
    later passes sample; sampled tokens are random, but the decisions that do not depend on them are the same."""
    eng = engine()
    reqs = [TranscriptionRequest(audio=clips[k], language="en") for k in ("hello", "numbers", "weather")]
    alone = [eng.transcribe(r) for r in reqs]
    batched = eng.transcribe_batch(reqs)
    for a, b in zip(alone, batched, strict=True):
        assert any(s.temperature > 0 for s in a.segments) and any(s.temperature > 0 for s in b.segments)
        assert b.language == a.language and b.duration == a.duration
        assert all(len(s.tokens) <= 10 for s in b.segments)


def test_no_fallback_needed_is_greedy_batched_or_alone(clips):
    """Thresholds that every pass meets: the fallback checks run, nothing samples, answers equal."""
    eng = engine(logprob_threshold="-1000", compression_ratio_threshold="1000")
    reqs = [TranscriptionRequest(audio=clips[k]) for k in ("hello", "numbers", "french")]
    alone = [eng.transcribe(r) for r in reqs]
    batched = eng.transcribe_batch(reqs)
    for a, b in zip(alone, batched, strict=True):
        same(b, a)
    assert all(s.temperature == 0 for r in batched for s in r.segments)


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish(clips):
    eng = engine(temperature_increment="0")
    reqs = requests(clips)
    alone = [eng.transcribe(r) for r in reqs]
    polls = {"n": 0}

    def gone() -> bool:  # the client of the long request goes away after its first calls
        polls["n"] += 1
        return polls["n"] > 2

    reqs[4] = TranscriptionRequest(audio=reqs[4].audio, language="en", word_timestamps=True, cancelled=gone)
    batched = eng.transcribe_batch(reqs)
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        if i != 4:
            same(b, a)
    assert len(batched[4].segments) < len(alone[4].segments)  # stopped early


def test_an_invalid_request_fails_alone_in_a_batch(clips):
    eng = engine(temperature_increment="0")
    out = eng.transcribe_batch([TranscriptionRequest(audio=clips["hello"], language="klingon"),
                                TranscriptionRequest(audio=clips["hello"], language="en"),
                                TranscriptionRequest(audio=clips["numbers"], language="en")])
    assert isinstance(out[0], InvalidRequest) and out[0].param == "language"
    same(out[1], eng.transcribe(TranscriptionRequest(audio=clips["hello"], language="en")))


def test_a_failed_batched_call_fails_its_requests_only(clips, monkeypatch):
    eng = engine(temperature_increment="0")
    ok = eng.transcribe(TranscriptionRequest(audio=clips["numbers"], language="en"))
    original = fw_batch.Rendezvous.generate

    def generate(self, chunk):
        if any(op.prompt and len(op.prompt) > 4 for op in chunk):  # the prompted request's first decode
            raise RuntimeError("device lost")
        original(self, chunk)

    monkeypatch.setattr(fw_batch.Rendezvous, "generate", generate)
    out = eng.transcribe_batch([TranscriptionRequest(audio=clips["hello"], language="en", prompt="A prompt here."),
                                TranscriptionRequest(audio=clips["numbers"], language="en")])
    assert "device lost" in str(out[0])
    same(out[1], ok)


def test_workers_run_queued_requests_in_parallel_instead(clips):
    eng = engine(temperature_increment="0", workers="2")
    reqs = requests(clips)[:3]
    for r, b in zip(reqs, eng.transcribe_batch(reqs), strict=True):
        same(b, eng.transcribe(r))


def test_a_short_request_is_answered_before_a_long_one_ends(clips):
    eng = engine(temperature_increment="0")
    long = np.concatenate([clips["hello"]] * 15)  # ~65 s: three windows
    order: list[int] = []
    out = eng.transcribe_batch([TranscriptionRequest(audio=long, language="en"),
                                TranscriptionRequest(audio=clips["numbers"], language="en")],
                               lambda i, r: order.append(i))
    assert order == [1, 0] and max(s.end for s in out[0].segments) > 30.0
