"""`octo serve MODEL.pt` as a real process, driven by the official openai SDK (every response format)."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import shutil
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")
whisper = pytest.importorskip("whisper")
openai = pytest.importorskip("openai")

from serverproc import run_octo  # noqa: E402

from octo.synth.whisper import build_whisper, encode, speech  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed (installed by .ci/run)",
)
OPTS = ("-o", "max_new_tokens=8", "-o", "temperature_increment=0")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("speech")
    wav = speech("Hello world. This is a test of the speech transcription service.", d / "hello.wav")
    out = {"wav": wav, "mp3": encode(wav, "mp3"), "m4a": encode(wav, "m4a")}
    for i, text in enumerate(["One two three four.", "The weather is sunny.", "Good morning, everyone."]):
        out[f"other{i}"] = speech(text, d / f"other{i}.wav")
    return out


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return build_whisper("test")


@pytest.fixture(scope="module")
def server(ckpt):
    with run_octo(str(ckpt), "--engine", "whisper", *OPTS, "--max-audio-mb", "1") as s:
        yield s


def model_name(server) -> str:
    return server.openai().models.list().data[0].id


def test_json_text_srt_vtt(server, clips):
    client = server.openai()
    model = model_name(server)
    with open(clips["mp3"], "rb") as f:
        j = client.audio.transcriptions.create(model=model, file=f, language="en")
    assert isinstance(j.text, str) and j.text
    with open(clips["mp3"], "rb") as f:
        text = client.audio.transcriptions.create(model=model, file=f, language="en", response_format="text")
    assert text == j.text + "\n"
    with open(clips["mp3"], "rb") as f:
        srt = client.audio.transcriptions.create(model=model, file=f, language="en", response_format="srt")
    assert srt.startswith("1\n00:00:") and " --> " in srt
    with open(clips["mp3"], "rb") as f:
        vtt = client.audio.transcriptions.create(model=model, file=f, language="en", response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:")
    cue_texts = [b.split("\n")[1] for b in vtt[8:].strip().split("\n\n")]
    assert cue_texts == [b.split("\n")[2] for b in srt.strip().split("\n\n")]
    # the text is the segments' texts joined; a cue is stripped (a segment may start without a space)
    assert "".join(cue_texts).replace(" ", "") == j.text.replace(" ", "")


def test_verbose_json_with_words(server, clips):
    client = server.openai()
    with open(clips["m4a"], "rb") as f:
        r = client.audio.transcriptions.create(
            model=model_name(server),
            file=f,
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
            prompt="A test.",
            temperature=0.0,
        )
    assert isinstance(r, openai.types.audio.TranscriptionVerbose)
    assert r.language and 3.5 < r.duration < 5.0
    assert r.segments and all(s.start <= s.end for s in r.segments)
    assert r.segments[0].tokens and r.segments[0].avg_logprob < 0
    assert r.words and all(w.start <= w.end for w in r.words)
    assert r.usage.type == "duration" and r.usage.seconds == 5


def test_translation(server, clips):
    client = server.openai()
    with open(clips["wav"], "rb") as f:
        r = client.audio.translations.create(model=model_name(server), file=f, response_format="verbose_json")
    assert r.language == "english" and r.segments is not None
    with open(clips["wav"], "rb") as f:
        assert isinstance(client.audio.translations.create(model=model_name(server), file=f).text, str)


def test_errors_through_the_sdk(server, clips, tmp_path):
    client = server.openai()
    notes = tmp_path / "notes.txt"
    notes.write_text("hello, I am not audio\n" * 100)
    with pytest.raises(openai.BadRequestError, match="could not be decoded as audio"):
        client.audio.transcriptions.create(model=model_name(server), file=notes.open("rb"))
    with pytest.raises(openai.NotFoundError, match="gpt-4o-transcribe"):
        client.audio.transcriptions.create(model="gpt-4o-transcribe", file=clips["wav"].open("rb"))
    big = tmp_path / "big.wav"
    shutil.copy(clips["wav"], big)
    with big.open("ab") as f:
        f.write(b"\x00" * (2 << 20))  # over --max-audio-mb 1
    with pytest.raises(openai.APIStatusError) as err:
        client.audio.transcriptions.create(model=model_name(server), file=big.open("rb"))
    assert err.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="timestamp_granularities"):
        client.audio.transcriptions.create(
            model=model_name(server), file=clips["wav"].open("rb"), timestamp_granularities=["word"]
        )


def _post(server, fields: dict[str, str], file: tuple[str, bytes] | None) -> tuple[int, str]:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    if file is not None:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n".encode()
            + file[1]
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(
        server.url("/v1/audio/transcriptions"),
        data=body,
        method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_raw_multipart(server, clips):
    wav = clips["wav"].read_bytes()
    assert _post(server, {"response_format": "text"}, ("a.wav", wav))[0] == 200
    status, body = _post(server, {"model": model_name(server)}, None)
    assert status == 400 and "Missing required field 'file'" in body
    status, body = _post(server, {"include[]": "logprobs"}, ("a.wav", wav))
    assert status == 400 and "include[]" in body
    status, body = _post(server, {}, ("a.wav", b""))
    assert status == 400 and "empty" in body
    status, body = _post(server, {}, ("a.wav", wav[:44] + b"\x00" * (1 << 20)))  # > 1 MB
    assert status == 413


def test_concurrent_requests(server, clips):
    """Four requests at once get the same answers as one at a time."""
    client = server.openai()
    names = ["wav", "other0", "other1", "other2"]
    model = model_name(server)
    alone = [
        client.audio.transcriptions.create(
            model=model, file=clips[n].open("rb"), response_format="verbose_json"
        ).model_dump()
        for n in names
    ]

    async def together():
        aclient = server.async_openai()
        return await asyncio.gather(
            *(
                aclient.audio.transcriptions.create(
                    model=model, file=clips[n].open("rb"), response_format="verbose_json"
                )
                for n in names
            )
        )

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        b = b.model_dump()
        assert b["text"] == a["text"]  # batched float sums differ in the last bits only: compare decodings
        assert [(s["start"], s["end"], s["tokens"]) for s in b["segments"]] == [
            (s["start"], s["end"], s["tokens"]) for s in a["segments"]
        ]


def test_serve_path_without_engine_flag(ckpt, clips):
    """`octo serve ./model.pt`: the format picks the whisper engine."""
    with run_octo(str(ckpt), *OPTS) as s:
        r = s.openai().audio.transcriptions.create(model=model_name(s), file=clips["wav"].open("rb"))
        assert isinstance(r.text, str)


def test_catalog_entry_through_the_download_machinery(ckpt, clips, tmp_path):
    """A catalog alias whose artifact is a plain URL with the SHA-256 in its path, as OpenAI publishes."""
    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    root = tmp_path / "www"
    (root / digest).mkdir(parents=True)
    shutil.copy(ckpt, root / digest / "tiny.pt")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    catalog = tmp_path / "models.yaml"
    catalog.write_text(f"""models:
  - id: whisper-synthetic
    aliases: [whisper-1]
    family: whisper
    task: transcription
    default_variant: fp16
    variants:
      fp16:
        whisper: http://127.0.0.1:{httpd.server_address[1]}/{digest}/tiny.pt
""")
    try:
        env = {"OCTO_CATALOG": str(catalog), "OCTO_HOME": str(tmp_path / "home")}
        with run_octo("whisper-synthetic", "--engine", "whisper", *OPTS, env=env) as s:
            r = s.openai().audio.transcriptions.create(model="whisper-1", file=clips["wav"].open("rb"))
            assert isinstance(r.text, str)
        assert list((tmp_path / "home").rglob("tiny.pt"))
    finally:
        httpd.shutdown()


WHISPER_ALIASES = [
    "whisper-tiny",
    "whisper-base",
    "whisper-small",
    "whisper-medium",
    "whisper-large-v3",
    "whisper-tiny.en",
    "whisper-base.en",
    "whisper-small.en",
    "whisper-medium.en",
]


@pytest.mark.parametrize("alias", WHISPER_ALIASES)
def test_catalog_aliases_are_openais_checkpoints(alias):
    """Each catalog alias points at the very URL openai-whisper itself downloads for that model."""
    from octo.engines.whisper import WhisperEngine

    from octo.models.catalog import load_catalog

    resolved = load_catalog().resolve(alias, {"whisper": WhisperEngine.formats})
    assert resolved.task == "transcription"
    art = resolved.artifacts["whisper"]
    assert art.format == "whisper" and art.uri == whisper._MODELS[alias.removeprefix("whisper-")]


def test_chat_model_refuses_audio(echo_server, clips):
    """A served chat model answers the audio endpoints with a 400 that says what to serve instead."""
    client = echo_server.openai()
    with pytest.raises(openai.BadRequestError, match="does not support audio transcription"):
        client.audio.transcriptions.create(model="test-model", file=clips["wav"].open("rb"))
    with pytest.raises(openai.BadRequestError, match="does not support audio translation"):
        client.audio.translations.create(model="test-model", file=clips["wav"].open("rb"))


def test_whisper_model_refuses_chat(server):
    with pytest.raises(openai.BadRequestError, match="transcription"):
        server.openai().chat.completions.create(model=model_name(server), messages=[{"role": "user", "content": "hi"}])


def test_whisper_model_refuses_tokenize_and_detokenize(server):
    """A model without a text tokenizer: a 400 naming the model (detokenize was a 500)."""
    for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        status, doc = server.post_json(path, body)
        assert status == 400 and doc["error"]["param"] == "model", doc
        assert doc["error"]["code"] == "unsupported_task", doc


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_an_abandoned_transcription_stops_at_its_next_window(ckpt, isolation):
    """Disconnect = cancel for audio too: a client that gives up on a 5-minute recording (10 windows of 30 s, about
    a minute of decoding on the random-weight model) frees the engine within a window or two, and counts as
    cancelled."""
    import io
    import time
    import wave

    import numpy as np

    pcm = (np.random.default_rng(0).standard_normal(16000 * 300) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    with run_octo(str(ckpt), "--engine", "whisper", "--isolation", isolation, "--max-audio-mb", "50") as s:
        client = s.openai().with_options(timeout=2, max_retries=0)  # the SDK gives up and closes its connection
        with pytest.raises(openai.APITimeoutError):
            client.audio.transcriptions.create(model="whisper-1", file=("a.wav", buf.getvalue()))
        gone = time.monotonic()
        while True:
            q = s.get_json("/v1/queue/stats")
            if (q["calls_running"], q["pending"]) == (0, 0):
                break
            assert time.monotonic() - gone < 15, q  # the whole recording takes about a minute
            time.sleep(0.2)
        assert q["total_cancelled"] == 1 and q["total_processed"] == 0, q
