"""The audio endpoints in-process: the real aiohttp app, scheduler and whisper engine; raw multipart."""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import time
import wave

import aiohttp
import numpy as np
import pytest

pytest.importorskip("torch")
whisper = pytest.importorskip("whisper")

from octo.engines.echo import EchoEngine  # noqa: E402
from octo.engines.whisper import WhisperEngine  # noqa: E402

from octo.config import ServerConfig  # noqa: E402
from octo.engine import EngineConfig, Segment, Transcription  # noqa: E402
from octo.errors import InvalidRequest  # noqa: E402
from octo.runtime.model import ModelHandle  # noqa: E402
from octo.server.app import create_app  # noqa: E402
from octo.server.routes import audio  # noqa: E402
from octo.synth.whisper import AUDIO_CODECS, build_whisper, encode, speech  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed (installed by .ci/run)",
)

OPTS = {"max_new_tokens": "8", "temperature_increment": "0"}
URL = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same espeak-ng sentence in every container, plus other speech and non-audio files."""
    d = tmp_path_factory.mktemp("audio")
    wav = speech("Hello world. This is a test of the speech transcription service.", d / "hello.wav")
    out = {fmt: encode(wav, fmt, d / f"encoded.{fmt}").read_bytes() for fmt in AUDIO_CODECS}
    with wave.open(str(wav)) as w:
        out["seconds"] = w.getnframes() / w.getframerate()
    out["numbers"] = speech("One two three four five six seven.", d / "numbers.wav").read_bytes()
    out["weather"] = speech("The weather today is sunny.", d / "weather.wav").read_bytes()
    long = d / "long.wav"
    import subprocess

    subprocess.run(["ffmpeg", "-y", "-loglevel", "error", "-stream_loop", "9", "-i", str(wav), str(long)], check=True)
    out["long"] = long.read_bytes()  # ~40 s
    png = d / "image.png"
    subprocess.run(
        ["ffmpeg", "-y", "-loglevel", "error", "-f", "lavfi", "-i", "color=c=red:s=32x32", "-frames:v", "1", str(png)],
        check=True,
    )
    out["png"] = png.read_bytes()
    return out


def whisper_app(options: dict | None = None, **config):
    engine = WhisperEngine(EngineConfig(max_batch=config.get("max_batch", 8), options=options or dict(OPTS)))
    engine.load(str(build_whisper("test")), "whisper-test")
    handle = ModelHandle("whisper-test", ("whisper-1",), "whisper", engine, "model.pt")
    return create_app(ServerConfig(model="whisper-test", **config), handle)


@pytest.fixture
async def client(aiohttp_client):
    return await aiohttp_client(whisper_app())


def form(data: bytes | None = None, filename: str = "speech.wav", **fields) -> aiohttp.FormData:
    f = aiohttp.FormData(default_to_multipart=True)  # as the openai SDK does, even without a file
    if data is not None:
        f.add_field("file", data, filename=filename, content_type="application/octet-stream")
    for name, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            f.add_field(name.replace("__", "[]"), str(v))
    return f


async def error(resp, status: int, param: str | None, needle: str) -> dict:
    body = await resp.json()
    assert resp.status == status, body
    assert body["error"]["param"] == param and needle in body["error"]["message"], body
    return body


# -- input formats -------------------------------------------------------------------------------------
async def test_decoding_every_container(files):
    wav = await audio.decode_audio(files["wav"], max_seconds=60)
    assert wav.dtype == np.float32 and abs(len(wav) / 16000 - files["seconds"]) < 0.01
    assert np.array_equal(await audio.decode_audio(files["flac"], max_seconds=60), wav)  # lossless
    for fmt in ("mp3", "m4a", "ogg", "webm"):
        got = await audio.decode_audio(files[fmt], max_seconds=60)
        assert abs(len(got) - len(wav)) < 0.1 * 16000, fmt  # codec padding only
        assert best_correlation(got, wav) > 0.9, fmt  # the same speech, up to the codec's delay
    # the same samples as whisper.load_audio (which decodes from a file path with the same arguments)
    ref = whisper.load_audio(str(encode_tmp(files["m4a"], "m4a")))
    assert np.array_equal(await audio.decode_audio(files["m4a"], max_seconds=60), ref)


def best_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Peak normalised cross-correlation of two signals (lossy codecs delay the audio a little)."""
    n = 1 << (len(a) + len(b)).bit_length()
    corr = np.fft.irfft(np.fft.rfft(a, n) * np.conj(np.fft.rfft(b, n)), n)
    return float(corr.max() / (np.linalg.norm(a) * np.linalg.norm(b)))


def encode_tmp(data: bytes, ext: str):
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    p = d / f"clip.{ext}"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("fmt", list(AUDIO_CODECS))
async def test_transcribe_every_container(client, files, fmt):
    resp = await client.post(
        URL, data=form(files[fmt], f"speech.{fmt}", response_format="verbose_json", model="whisper-test")
    )
    body = await resp.json()
    assert resp.status == 200, body
    assert abs(body["duration"] - files["seconds"]) < 0.1 and body["task"] == "transcribe"
    assert isinstance(body["language"], str) and body["segments"]


# -- response formats ----------------------------------------------------------------------------------
async def test_response_formats_agree(client, files):
    data = files["wav"]
    verbose = await (await client.post(URL, data=form(data, response_format="verbose_json", language="en"))).json()
    assert verbose["language"] == "english"
    assert verbose["usage"] == {"type": "duration", "seconds": math.ceil(verbose["duration"])}
    seg = verbose["segments"][0]
    assert set(seg) == {
        "id",
        "seek",
        "start",
        "end",
        "text",
        "tokens",
        "temperature",
        "avg_logprob",
        "compression_ratio",
        "no_speech_prob",
    }
    text = verbose["text"]
    assert text == "".join(s["text"] for s in verbose["segments"]).strip()

    j = await client.post(URL, data=form(data, language="en"))
    assert j.status == 200 and (await j.json()) == {"text": text, "usage": verbose["usage"]}
    t = await client.post(URL, data=form(data, language="en", response_format="text"))
    assert t.content_type == "text/plain" and await t.text() == text + "\n"

    cues = [s for s in verbose["segments"] if s["text"].strip()]
    srt = await (await client.post(URL, data=form(data, language="en", response_format="srt"))).text()
    blocks = [b.split("\n") for b in srt.strip().split("\n\n")]
    assert [b[0] for b in blocks] == [str(i) for i in range(1, len(cues) + 1)]
    assert [b[2] for b in blocks] == [s["text"].strip() for s in cues]
    assert blocks[0][1] == f"{audio.timestamp(cues[0]['start'], ',')} --> {audio.timestamp(cues[0]['end'], ',')}"
    assert re.fullmatch(r"\d\d:\d\d:\d\d,\d\d\d --> \d\d:\d\d:\d\d,\d\d\d", blocks[-1][1])

    vtt = await client.post(URL, data=form(data, language="en", response_format="vtt"))
    body = await vtt.text()
    assert vtt.content_type == "text/vtt" and body.startswith("WEBVTT\n\n")
    assert [b.split("\n")[1] for b in body[8:].strip().split("\n\n")] == [s["text"].strip() for s in cues]


async def test_word_and_segment_granularities(client, files):
    resp = await client.post(
        URL,
        data=form(
            files["wav"], response_format="verbose_json", language="en", timestamp_granularities__=["word", "segment"]
        ),
    )
    body = await resp.json()
    assert resp.status == 200, body
    assert body["segments"] and body["words"]
    assert all(set(w) == {"word", "start", "end"} and w["start"] <= w["end"] for w in body["words"])
    resp = await client.post(
        URL, data=form(files["wav"], response_format="verbose_json", language="en", timestamp_granularities__=["word"])
    )
    body = await resp.json()
    assert "segments" not in body and body["words"]


def test_srt_vtt_formatting():
    r = Transcription(
        text=" a b",
        language="en",
        duration=3725.5,
        segments=[Segment(0.0, 1.5, " Hello --> there"), Segment(1.5, 1.5, " "), Segment(3661.25, 3725.5, " Bye.")],
    )
    assert audio.srt(r) == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello -> there\n\n2\n01:01:01,250 --> 01:02:05,500\nBye.\n\n"
    )
    assert audio.vtt(r) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello -> there\n\n01:01:01.250 --> 01:02:05.500\nBye.\n\n"
    )


async def test_translation(client, files):
    resp = await client.post("/v1/audio/translations", data=form(files["wav"], response_format="verbose_json"))
    body = await resp.json()
    assert resp.status == 200, body
    assert body["task"] == "translate" and body["language"] == "english" and "usage" not in body
    resp = await client.post("/v1/audio/translations", data=form(files["wav"], timestamp_granularities__="segment"))
    await error(resp, 400, "timestamp_granularities[]", "not supported")


# -- bad input -----------------------------------------------------------------------------------------
async def test_not_audio(client, files):
    resp = await client.post(URL, data=form(b"this is plain text, not audio\n" * 50, "notes.txt"))
    await error(resp, 400, "file", "could not be decoded as audio")
    resp = await client.post(URL, data=form(files["png"], "image.png"))
    await error(resp, 400, "file", "no audio stream")
    resp = await client.post(URL, data=form(b"\x00\x00\x00\x18ftypM4A " + b"\x00" * 4000, "broken.m4a"))
    await error(resp, 400, "file", "could not be decoded as audio")


async def test_missing_and_empty_file(client):
    await error(await client.post(URL, data=form(None, model="whisper-test")), 400, "file", "Missing")
    await error(await client.post(URL, data=form(b"")), 400, "file", "empty")
    await error(await client.post(URL, json={"file": "x"}), 400, "file", "multipart/form-data")
    await error(await client.post(URL, data={"model": "whisper-test"}), 400, "file", "multipart/form-data")


async def test_bad_fields(client, files):
    wav = files["wav"]
    await error(
        await client.post(URL, data=form(wav, chunking_strategy="auto")), 400, "chunking_strategy", "not supported"
    )
    await error(
        await client.post(URL, data=form(wav, response_format="diarized_json")), 400, "response_format", "diarized_json"
    )
    await error(
        await client.post(URL, data=form(wav, timestamp_granularities__="word")),
        400,
        "timestamp_granularities[]",
        "verbose_json",
    )
    await error(
        await client.post(URL, data=form(wav, response_format="verbose_json", timestamp_granularities__="char")),
        400,
        "timestamp_granularities[]",
        "'char'",
    )
    await error(await client.post(URL, data=form(wav, stream="true")), 400, "stream", "not supported")
    await error(await client.post(URL, data=form(wav, temperature="hot")), 400, "temperature", "number")
    await error(await client.post(URL, data=form(wav, temperature="1.5")), 400, "temperature", "between")
    await error(await client.post(URL, data=form(wav, language="klingon")), 400, "language", "klingon")
    await error(await client.post(URL, data=form(wav, model="gpt-4o")), 404, "model", "gpt-4o")
    ok = await client.post(URL, data=form(wav, model="whisper-1", stream="false", temperature="0"))
    assert ok.status == 200  # the handle's alias; stream=false is OpenAI's default


async def test_size_and_duration_limits(aiohttp_client, files):
    client = await aiohttp_client(whisper_app(max_audio_mb=0.1, max_audio_seconds=10.0))
    big = files["wav"] * 2  # 346 KB > 0.1 MB
    await error(await client.post(URL, data=form(big)), 413, "file", "--max-audio-mb")
    await error(await client.post(URL, data=form(files["long"][:200_000], "cut.wav")), 413, "file", "larger")
    client2 = await aiohttp_client(whisper_app(max_audio_seconds=10.0))
    await error(await client2.post(URL, data=form(files["long"])), 400, "file", "longer than the limit of 10")
    assert (await client2.post(URL, data=form(files["wav"]))).status == 200


async def test_body_limit(aiohttp_client, files):
    client = await aiohttp_client(whisper_app(max_body_mb=0.2))
    resp = await client.post(URL, data=form(files["long"]))
    assert resp.status == 413


# -- temporary files and subprocesses ------------------------------------------------------------------
async def test_no_temp_file_left(client, files, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    procs = []
    real = asyncio.create_subprocess_exec

    async def spy(*args, **kw):
        procs.append(await real(*args, **kw))
        return procs[-1]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
    assert (await client.post(URL, data=form(files["m4a"], "a.m4a"))).status == 200  # via a temp file
    assert (await client.post(URL, data=form(files["mp3"], "a.mp3"))).status == 200  # via the pipe
    broken = b"\x00\x00\x00\x18ftypM4A " + b"\x01" * 5000
    assert (await client.post(URL, data=form(broken, "b.m4a"))).status == 400
    with pytest.raises(InvalidRequest):
        await audio.decode_audio(files["long"], max_seconds=1.0)
    # cancelled half-way (a client that went away): the temp file and ffmpeg go too
    task = asyncio.ensure_future(audio.decode_audio(files["m4a"] * 40, max_seconds=600))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(tmp_path.iterdir()) == []
    assert procs and all(p.returncode is not None for p in procs)


# -- scheduling ----------------------------------------------------------------------------------------
async def test_concurrent_requests_do_not_mix(client, files):
    names = ["wav", "numbers", "weather", "mp3"]
    alone = [await (await client.post(URL, data=form(files[n], response_format="verbose_json"))).json() for n in names]
    together = await asyncio.gather(
        *(client.post(URL, data=form(files[n], response_format="verbose_json")) for n in names)
    )
    together = [await r.json() for r in together]
    for a, b in zip(alone, together, strict=True):
        assert decoded(b) == decoded(a)  # batched float sums differ in the last bits only
        assert [s["avg_logprob"] for s in b["segments"]] == pytest.approx(
            [s["avg_logprob"] for s in a["segments"]], abs=1e-3
        )


def decoded(body: dict) -> tuple:
    return body["text"], [(s["start"], s["end"], s["text"], s["tokens"]) for s in body["segments"]]


async def test_event_loop_stays_responsive(aiohttp_client, files):
    client = await aiohttp_client(whisper_app({"max_new_tokens": "64"}))  # slow on purpose: fallback on
    lag, ticks = 0.0, 0
    done = False

    async def ticker():
        nonlocal lag, ticks
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lag = max(lag, time.perf_counter() - t - 0.01)
            ticks += 1

    tick = asyncio.ensure_future(ticker())
    started = time.perf_counter()
    resp = await client.post(URL, data=form(files["long"], language="en"))
    elapsed = time.perf_counter() - started
    done = True
    await tick
    assert resp.status == 200
    assert elapsed > 1.0 and lag < 0.25 and ticks > elapsed / 0.02 / 2, (elapsed, lag, ticks)


async def test_queue_full_and_timeout(aiohttp_client, files):
    slow = {"max_new_tokens": "64"}
    client = await aiohttp_client(whisper_app(slow, max_queue=1))
    resps = await asyncio.gather(*(client.post(URL, data=form(files["long"], language="en")) for _ in range(5)))
    statuses = sorted(r.status for r in resps)
    assert statuses.count(200) >= 2 and 503 in statuses, statuses
    full = next(r for r in resps if r.status == 503)
    assert int(full.headers["Retry-After"]) >= 1
    assert (await full.json())["error"]["code"] == "queue_full"

    client = await aiohttp_client(whisper_app(slow, queue_timeout=0.3, max_batch=1))
    resps = await asyncio.gather(*(client.post(URL, data=form(files["long"], language="en")) for _ in range(3)))
    statuses = sorted(r.status for r in resps)
    assert 200 in statuses and 504 in statuses, statuses


# -- the wrong kind of model ---------------------------------------------------------------------------
async def test_chat_model_refuses_audio(aiohttp_client, files):
    engine = EchoEngine(EngineConfig())
    engine.load("echo-model", "echo-model")
    app = create_app(ServerConfig(model="echo-model"), ModelHandle("echo-model", (), "echo", engine, "x"))
    client = await aiohttp_client(app)
    for path in (URL, "/v1/audio/translations"):
        body = await error(await client.post(path, data=form(files["wav"])), 400, "model", "does not support audio")
        assert "whisper" in body["error"]["message"].lower()


async def test_whisper_model_refuses_chat(client):
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    body = await resp.json()
    assert resp.status == 400 and "transcription" in body["error"]["message"], body


@pytest.mark.xfail(
    not hasattr(__import__("octo.scheduler.admission").scheduler.Scheduler, "call_batch"),
    reason="needs Scheduler.call_batch (queued transcriptions run as one transcribe_batch)",
    strict=True,
)
async def test_queued_requests_are_batched_and_answered_early(aiohttp_client, files):
    """Requests queued behind a running one are transcribed together, and a short clip batched with a long
    recording is answered when its own windows are done."""
    app = whisper_app()
    client = await aiohttp_client(app)
    finished = {}

    async def timed(name, data):
        resp = await client.post(URL, data=form(data, language="en"))
        finished[name] = time.perf_counter()
        assert resp.status == 200, await resp.text()

    from octo.server.state import STATE

    # keep the engine thread busy while the two requests queue up behind it, the long one first
    blocker = asyncio.ensure_future(app[STATE].handle.scheduler.call(lambda engine: time.sleep(1.5)))
    await asyncio.sleep(0.1)
    long = asyncio.ensure_future(timed("long", files["long"]))
    await asyncio.sleep(0.5)
    await asyncio.gather(blocker, long, timed("short", files["numbers"]))
    assert finished["short"] < finished["long"], finished
