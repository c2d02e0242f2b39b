"""OpenAI's audio endpoints: ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``.

The multipart form is OpenAI's: ``file`` (required), ``model``, ``language``, ``prompt``, ``temperature``,
``response_format`` (json | text | srt | vtt | verbose_json), ``timestamp_granularities[]`` (segment,
word) and ``stream`` (false only). Any other field is refused with a 400 naming it.

Uploads are decoded by ffmpeg in an asyncio subprocess, fed through stdin and read from stdout, so the
event loop never blocks and no file is written, except for MP4-family containers (m4a, mp4, mov), whose
index may sit at the end and needs seeking: those go through a private temporary file that is deleted
in ``finally``, whatever happens. Decoding stops as soon as the audio exceeds ``--max-audio-seconds``.
Without ffmpeg on the server, WAV uploads are decoded by octo itself (``octo.server.wav``) and any other format is a
415 that names ffmpeg.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from octo.engine import Transcription, TranscriptionRequest
from octo.errors import (
    InvalidRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
    UnsupportedParameter,
)
from octo.server.bodies import content_encoding

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np

MB = 2**20
SAMPLE_RATE = 16000
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
_FIELD_LIMIT = 256 * 1024  # bytes of any form field other than the file
_PLAIN_CODINGS = ("", "identity", "binary", "7bit", "8bit")  # a part's codings that mean "as is"
_COMMON = frozenset({"file", "model", "prompt", "temperature", "response_format", "stream", "language", "keep_alive"})
FIELDS = {
    "transcribe": _COMMON | {"timestamp_granularities[]", "timestamp_granularities"},
    "translate": _COMMON,  # ``language`` here is the spoken language (a hint; detected when absent)
}
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")
FFMPEG_TIMEOUT = 600.0


@dataclass
class AudioForm:
    data: bytes | None = None
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    granularities: list[str] = field(default_factory=list)


# -- handlers --------------------------------------------------------------------------------------
async def transcriptions(request: web.Request) -> web.Response:
    return await _handle(request, "transcribe")


async def translations(request: web.Request) -> web.Response:
    return await _handle(request, "translate")


async def _handle(request: web.Request, task: str) -> web.Response:
    from octo.server.state import STATE

    state = request.app[STATE]
    config = state.config
    form = await read_form(
        request, FIELDS[task], max_file_bytes=int(config.max_audio_mb * MB), max_body_bytes=int(config.max_body_mb * MB)
    )
    async with state.registry.use(form.fields.get("model"), form.fields.get("keep_alive")) as handle:
        if handle.task != "transcription":
            raise InvalidRequest(
                f"Model '{handle.name}' is a {handle.task} model and does not support audio "
                f"{'translation' if task == 'translate' else 'transcription'}; serve a Whisper model "
                "(e.g. `octo serve whisper-base`).",
                param="model",
                code="unsupported_task",
            )
        fmt, granularities, req_kw = parse_options(form, task, handle.engine_cls)
        audio = await decode_audio(form.data, max_seconds=config.max_audio_seconds)
        req = TranscriptionRequest(audio=audio, task=task, **req_kw)
        # through the model's admission queue; batched with other queued requests when the engine can
        result: Transcription = await handle.call("transcribe", req)
    return render(result, fmt, task, granularities)


# -- form --------------------------------------------------------------------------------------------
async def read_form(
    request: web.Request, allowed: frozenset[str], *, max_file_bytes: int, max_body_bytes: int
) -> AudioForm:
    """The multipart form; the file part is read in chunks and refused (413) past ``max_file_bytes``. The body is
    taken uncompressed (audio formats are compressed already): another Content-Encoding is a 415."""
    content_encoding(request, allow_compressed=False)
    if request.content_type != "multipart/form-data":
        raise InvalidRequest(
            f"The request must be multipart/form-data with the audio in a 'file' part (got '{request.content_type}').",
            param="file",
        )
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise PayloadTooLarge(
            f"The request body ({request.content_length / MB:.1f} MB) is larger than "
            f"the limit ({max_body_bytes / MB:g} MB).",
            param="file",
        )
    form = AudioForm()
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):  # a part that is a multipart body of its own
                raise InvalidRequest("Malformed multipart body: a form field cannot be multipart itself.", param="file")
            name = part.name or ""
            if name not in allowed:
                raise UnsupportedParameter(name or "(unnamed form field)")
            _check_part_coding(part, name)
            if name == "file":
                if form.data is not None:
                    raise InvalidRequest("Send exactly one 'file' part.", param="file")
                form.filename = part.filename
                form.data = await _read_limited(
                    part, max_file_bytes, what="audio file", flag="--max-audio-mb", exc=PayloadTooLarge
                )
                continue
            value = (
                await _read_limited(part, _FIELD_LIMIT, what=f"field '{name}'", flag=None, exc=InvalidRequest)
            ).decode("utf-8", errors="replace")
            if name.startswith("timestamp_granularities"):
                form.granularities.append(value.strip())
            elif name in form.fields:
                raise InvalidRequest(f"Field '{name}' is given more than once.", param=name)
            else:
                form.fields[name] = value
    except (ValueError, AssertionError, HttpProcessingError) as exc:  # aiohttp's errors for a malformed body
        why = getattr(exc, "message", None) or exc
        raise InvalidRequest(f"Malformed multipart body: {why}", param="file") from None
    if form.data is None:
        raise InvalidRequest("Missing required field 'file' (the audio to transcribe).", param="file")
    if not form.data:
        raise InvalidRequest("The uploaded file is empty.", param="file")
    return form


def _check_part_coding(part: BodyPartReader, name: str) -> None:
    """A field is read as sent: a part that says it is encoded (base64, gzip...) is a 415, not read as raw bytes."""
    for header in ("Content-Encoding", "Content-Transfer-Encoding"):
        coding = part.headers.get(header, "").strip().lower()
        if coding not in _PLAIN_CODINGS:
            raise UnsupportedMediaType(f"{header} '{coding}' on form field '{name}' is not supported; send the "
                                       "field as is (binary).")


async def _read_limited(part, limit: int, *, what: str, flag: str | None, exc) -> bytes:
    buf = bytearray()
    while chunk := await part.read_chunk(256 * 1024):
        buf += chunk
        if len(buf) > limit:
            hint = f" (set by {flag})" if flag else ""
            raise exc(
                f"The {what} is larger than the limit of {limit / MB:g} MB{hint}.",
                param="file" if what == "audio file" else None,
            )
    return bytes(buf)


def parse_options(form: AudioForm, task: str, engine: Any) -> tuple[str, list[str], dict[str, Any]]:
    """(response_format, timestamp granularities, TranscriptionRequest keywords) from the form fields."""
    f = form.fields
    fmt = (f.get("response_format") or "json").strip()
    if fmt not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format '{fmt}' is not supported; use one of {', '.join(RESPONSE_FORMATS)}.",
            param="response_format",
        )
    stream = (f.get("stream") or "false").strip().lower()
    if stream not in ("false", "0", ""):
        raise UnsupportedParameter("stream", "streamed transcription is not available; omit it or send false")
    try:
        temperature = float(f.get("temperature") or 0.0)
    except ValueError:
        raise InvalidRequest(f"temperature must be a number, got '{f['temperature']}'.", param="temperature") from None
    if not 0.0 <= temperature <= 1.0 or math.isnan(temperature):
        raise InvalidRequest("temperature must be between 0 and 1.", param="temperature")
    granularities = []
    for g in form.granularities:
        if g not in GRANULARITIES:
            raise InvalidRequest(
                f"timestamp_granularities value '{g}' is not supported; use segment or word.",
                param="timestamp_granularities[]",
            )
        if g not in granularities:
            granularities.append(g)
    if granularities and fmt != "verbose_json":
        raise InvalidRequest(
            "timestamp_granularities requires response_format 'verbose_json'.", param="timestamp_granularities[]"
        )
    if "word" in granularities and not getattr(engine, "supports_word_timestamps", False):
        raise UnsupportedParameter("timestamp_granularities[]", "the engine has no word timestamps")
    language = (f.get("language") or "").strip() or None
    prompt = f.get("prompt") or None
    return (
        fmt,
        granularities,
        {
            "language": language,
            "prompt": prompt,
            "temperature": temperature,
            "word_timestamps": "word" in granularities,
        },
    )


# -- decoding ----------------------------------------------------------------------------------------
def _is_mp4(data: bytes) -> bool:
    return len(data) >= 8 and data[4:8] in _MP4_BOXES


async def decode_audio(data: bytes, *, max_seconds: float) -> np.ndarray:
    """Mono float32 samples at 16 kHz of any format ffmpeg reads; 400 for non-audio or too long audio."""
    import numpy as np
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:  # WAV is read without it (octo.server.wav); other formats need it
        return await _without_ffmpeg(data, max_seconds)
    tmp_path = None
    proc = None
    try:
        if _is_mp4(data):  # MP4's index (moov) may follow the data: ffmpeg must seek, so use a file
            fd, tmp_path = tempfile.mkstemp(prefix="octo-audio-", suffix=".m4a")
            await asyncio.to_thread(_write_and_close, fd, data)
            source = tmp_path
        else:
            source = "pipe:0"
        proc = await asyncio.create_subprocess_exec(
            *_ffmpeg_argv(ffmpeg, source),
            stdin=asyncio.subprocess.PIPE if source == "pipe:0" else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        max_bytes = int(max_seconds * SAMPLE_RATE) * 2
        pcm, too_long, err = await asyncio.wait_for(
            _communicate(proc, data if source == "pipe:0" else None, max_bytes), FFMPEG_TIMEOUT
        )
    except TimeoutError:
        raise InvalidRequest(f"Decoding the audio took longer than {FFMPEG_TIMEOUT:g} s.", param="file") from None
    finally:
        if proc is not None and proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
        if tmp_path is not None:
            os.unlink(tmp_path)
    if too_long:
        raise InvalidRequest(
            f"The audio is longer than the limit of {max_seconds:g} seconds (--max-audio-seconds).", param="file"
        )
    if proc.returncode != 0:
        raise InvalidRequest(f"The file could not be decoded as audio: {_ffmpeg_reason(err)}", param="file")
    if len(pcm) < 2:
        raise InvalidRequest("The file contains no audio samples.", param="file")
    return np.frombuffer(pcm[: len(pcm) // 2 * 2], np.int16).astype(np.float32) / 32768.0


async def _without_ffmpeg(data: bytes, max_seconds: float) -> np.ndarray:
    """A WAV upload decoded by octo itself; any other format is a 415 that names ffmpeg."""
    from octo.server.wav import NotWav, decode_wav, is_riff_wave

    why = "this file is not a WAV file"
    if is_riff_wave(data):
        try:
            return await asyncio.to_thread(decode_wav, data, max_seconds=max_seconds, rate_out=SAMPLE_RATE)
        except NotWav as exc:
            why = f"this file is {exc}"
    raise UnsupportedMediaType(f"ffmpeg is not installed on the server, so it decodes only WAV uploads (PCM or float) "
                               f"and {why}. Send WAV, or install ffmpeg on the server (Debian/Ubuntu: apt-get install "
                               "ffmpeg) to decode mp3, m4a, ogg, flac, webm and the rest.", param="file")


def _ffmpeg_argv(ffmpeg: str, source: str) -> list[str]:
    """ffmpeg reading ``source`` (a file, or ``pipe:0``) and writing its first audio stream to stdout as mono 16-bit
    PCM at ``SAMPLE_RATE``."""
    return [ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-threads", "0", "-i", source,
            "-map", "0:a:0", "-f", "s16le", "-ac", "1", "-acodec", "pcm_s16le", "-ar", str(SAMPLE_RATE), "pipe:1"]


def _write_and_close(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)


async def _communicate(proc, data: bytes | None, max_bytes: int) -> tuple[bytes, bool, bytes]:
    async def feed() -> None:
        try:
            proc.stdin.write(data)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # ffmpeg stopped reading: it failed, or it has all it needs; its exit status says which
        finally:
            proc.stdin.close()

    async def drain_stderr() -> bytes:
        err = await proc.stderr.read(64 * 1024)
        while await proc.stderr.read(64 * 1024):
            pass
        return err

    writer = asyncio.ensure_future(feed()) if data is not None else None
    err_task = asyncio.ensure_future(drain_stderr())
    pcm = bytearray()
    too_long = False
    try:
        while chunk := await proc.stdout.read(1 << 20):
            pcm += chunk
            if len(pcm) > max_bytes:  # stop decoding now: the rest would only be thrown away
                too_long = True
                proc.kill()
                break
        err = await err_task
        await proc.wait()
        if writer is not None:
            await writer
    finally:
        for task in (writer, err_task):
            if task is not None and not task.done():
                task.cancel()
    return bytes(pcm), too_long, err


def _ffmpeg_reason(err: bytes) -> str:
    lines = [ln.strip() for ln in err.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    text = " ".join(lines)
    if "matches no streams" in text:
        return "it has no audio stream."
    if not lines:
        return "ffmpeg failed without a message."
    reason = lines[-1]
    for prefix in ("pipe:0: ", "pipe:"):
        if reason.startswith(prefix):
            reason = reason[len(prefix) :]
    if "octo-audio-" in reason and ": " in reason:  # the temporary file's name says nothing to the client
        reason = reason.split(": ", 1)[1]
    return reason[:300] + ("" if reason.endswith(".") else ".")


# -- responses ---------------------------------------------------------------------------------------
def render(result: Transcription, fmt: str, task: str, granularities: list[str]) -> web.Response:
    text = result.text.strip()
    if fmt == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    if fmt == "srt":
        return web.Response(text=srt(result), content_type="text/plain")
    if fmt == "vtt":
        return web.Response(text=vtt(result), content_type="text/vtt")
    usage = {"type": "duration", "seconds": math.ceil(result.duration)}
    if fmt == "json":
        body: dict[str, Any] = {"text": text}
        if task == "transcribe":
            body["usage"] = usage
        return _json(body)
    body = {
        "task": task,
        "language": "english" if task == "translate" else language_name(result.language),
        "duration": round(result.duration, 3),
        "text": text,
    }
    if not granularities or "segment" in granularities:
        body["segments"] = [_segment_json(i, s) for i, s in enumerate(result.segments)]
    if "word" in granularities:
        body["words"] = [
            {"word": w["word"].strip(), "start": round(w["start"], 3), "end": round(w["end"], 3)}
            for s in result.segments
            for w in (s.words or [])
        ]
    if task == "transcribe":
        body["usage"] = usage
    return _json(body)


def _json(body: dict) -> web.Response:
    import orjson

    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _segment_json(i: int, s: Any) -> dict:
    return {
        "id": getattr(s, "id", i),
        "seek": getattr(s, "seek", 0),
        "start": round(s.start, 3),
        "end": round(s.end, 3),
        "text": s.text,
        "tokens": list(getattr(s, "tokens", None) or []),
        "temperature": getattr(s, "temperature", 0.0),
        "avg_logprob": getattr(s, "avg_logprob", 0.0),
        "compression_ratio": getattr(s, "compression_ratio", 0.0),
        "no_speech_prob": getattr(s, "no_speech_prob", 0.0),
    }


def language_name(code: str) -> str:
    """OpenAI's verbose_json names the language ("english"); whisper's table when installed, else the code."""
    try:
        from whisper.tokenizer import LANGUAGES
    except ImportError:
        return code
    return LANGUAGES.get(code, code)


def timestamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _cues(result: Transcription):
    for s in result.segments:
        text = s.text.strip().replace("-->", "->")
        if text:
            yield s.start, s.end, text


def srt(result: Transcription) -> str:
    return "".join(
        f"{i}\n{timestamp(a, ',')} --> {timestamp(b, ',')}\n{t}\n\n"
        for i, (a, b, t) in enumerate(_cues(result), start=1)
    )


def vtt(result: Transcription) -> str:
    return "WEBVTT\n\n" + "".join(f"{timestamp(a, '.')} --> {timestamp(b, '.')}\n{t}\n\n" for a, b, t in _cues(result))
