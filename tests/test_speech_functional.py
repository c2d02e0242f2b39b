"""The faster-whisper and whispercpp engines through a real `octo serve` and the official openai SDK.

The whisper engine's functional tests (formats, words, translations, errors, raw multipart, concurrent
requests) run again here against each engine, on the same synthetic weights converted to the engine's
format; then cancellation, local paths by format and the start-up benchmark choosing among the three.
"""

from __future__ import annotations

import io
import shutil
import time
import wave

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("whisper")
pytest.importorskip("faster_whisper")
pytest.importorskip("pywhispercpp")

from serverproc import run_octo  # noqa: E402
from test_whisper_functional import (  # noqa: E402,F401 - the whisper engine's tests, run for each engine here
    OPTS,
    model_name,
    test_concurrent_requests,
    test_errors_through_the_sdk,
    test_json_text_srt_vtt,
    test_raw_multipart,
    test_translation,
    test_verbose_json_with_words,
)
from test_whisper_functional import clips as clips  # noqa: E402 - the same spoken clips (a fixture)

from octo.synth.speech import build_whisper_ct2, build_whisper_ggml  # noqa: E402
from octo.synth.whisper import build_whisper  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed (installed by .ci/run)",
)
SHAPE = "test3"  # whisper.cpp takes a 2-layer decoder for a distilled model (no timestamps): 3 layers here
BUILD = {"faster-whisper": build_whisper_ct2, "whispercpp": build_whisper_ggml}


@pytest.fixture(scope="module", params=sorted(BUILD))
def server(request):
    engine = request.param
    with run_octo(str(BUILD[engine](SHAPE)), "--engine", engine, *OPTS, "--max-audio-mb", "1") as s:
        yield s


def test_the_engine_serves(server):
    engines = server.get_json("/v1/engines")
    assert engines["active"] in BUILD, engines
    row = next(r for r in engines["data"] if r["name"] == engines["active"])
    assert row["available"] and row["model"]["max_new_tokens"] == 8, row


def _noise_wav(seconds: int) -> bytes:
    import numpy as np

    pcm = (np.random.default_rng(0).standard_normal(16000 * seconds) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("engine", sorted(BUILD))
def test_an_abandoned_transcription_stops(engine):
    """A client that gives up on a 5-minute recording frees the engine within a window or two."""
    with run_octo(str(BUILD[engine](SHAPE)), "--engine", engine, "--max-audio-mb", "50") as s:
        client = s.openai().with_options(timeout=2, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            client.audio.transcriptions.create(model="whisper-1", file=("a.wav", _noise_wav(300)))
        gone = time.monotonic()
        while True:
            q = s.get_json("/v1/queue/stats")
            if (q["calls_running"], q["pending"]) == (0, 0):
                break
            assert time.monotonic() - gone < 20, q
            time.sleep(0.2)
        assert q["total_cancelled"] == 1 and q["total_processed"] == 0, q


@pytest.mark.parametrize("engine", sorted(BUILD))
def test_serve_a_path_picks_the_engine_by_format(engine, clips):
    with run_octo(str(BUILD[engine](SHAPE)), *OPTS) as s:
        assert s.get_json("/v1/engines")["active"] == engine
        r = s.openai().audio.transcriptions.create(model=model_name(s), file=clips["wav"].open("rb"))
        assert isinstance(r.text, str)


def test_startup_benchmark_chooses_among_speech_engines(tmp_path, clips, monkeypatch):
    """A catalog entry with the same synthetic weights for the three engines: each is measured on speech work,
    the table is in /v1/engines, and requests are served by the winner."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        "models:\n  - id: speech-test\n    task: transcription\n    default_variant: synth\n    variants:\n"
        "      synth:\n" + "".join(f"        {e}: synth://whisper-{SHAPE}\n" for e in ("whisper", *BUILD)))
    for build in (build_whisper, *BUILD.values()):
        build(SHAPE)
    monkeypatch.setenv("OCTO_CATALOG", str(catalog))
    monkeypatch.setenv("OCTO_BENCH_DIR", str(tmp_path / "bench"))
    with run_octo("speech-test", *OPTS, "--bench-seconds", "2") as s:
        table = s.get_json("/v1/engines")
        rows = {e["name"]: e for e in table["data"]}
        measured = {n: r for n, r in rows.items() if (r.get("benchmark") or {}).get("speech_x_realtime")}
        assert set(measured) == {"whisper", *BUILD}, rows
        winner = max(measured, key=lambda n: measured[n]["benchmark"]["score"])
        assert table["active"] == winner, table
        r = s.openai().audio.transcriptions.create(model="speech-test", file=clips["wav"].open("rb"))
        assert isinstance(r.text, str)
