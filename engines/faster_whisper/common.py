"""What the speech engines built on other runtimes share: options, request checks, OpenAI's segments.

Every speech engine follows OpenAI's transcription rules (those of ``whisper.transcribe``): temperature 0
means the fallback schedule 0, 0.2, ... 1.0 with the compression-ratio (2.4), average log-probability (-1.0)
and no-speech (0.6) thresholds; ``prompt`` is the first window's previous text; ``language`` fixes the
language, else it is detected on the first 30 seconds; each window's text conditions the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octo.engine import Transcription, TranscriptionRequest, VerboseSegment, fallback_temperatures
from octo.errors import InvalidRequest, OctoError
from octo.options import SPEECH_DECODING, parse_engine_options

SAMPLE_RATE = 16000


# the decoding options every speech engine takes (``-o KEY=VALUE``), with OpenAI's defaults
DECODING_OPTIONS = SPEECH_DECODING
DEFAULTS: dict[str, Any] = {
    "beam_size": 1,  # whisper.transcribe's default: greedy at temperature 0 (the CLI's is 5)
    "best_of": 1,  # one sample per fallback temperature
    "condition_on_previous_text": True,
    "temperature_increment": 0.2,
    "compression_ratio_threshold": 2.4,
    "logprob_threshold": -1.0,
    "no_speech_threshold": 0.6,
}


def parse_options(engine: str, options: dict[str, str], extra: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
    """The engine's options with OpenAI's defaults; a ConfigError names an unknown or malformed one."""
    return {**DEFAULTS, **parse_engine_options(engine, {**DECODING_OPTIONS, **extra}, options)}


temperatures = fallback_temperatures


def quiet_library_logs(*names: str) -> None:
    """The speech libraries' own info lines (faster-whisper's "Processing audio with duration ..." on every call,
    pywhispercpp's "Transcribing ...") at warning level, unless octo logs at debug level."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in names:
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)


def check_request(req: TranscriptionRequest, languages: frozenset[str], multilingual: bool) -> str | None:
    """The request's language code (None: detect it); InvalidRequest for what the model cannot do."""
    if req.task not in ("transcribe", "translate"):
        raise InvalidRequest(f"Unknown task '{req.task}'.", param="task")
    if not 0.0 <= req.temperature <= 1.0:
        raise InvalidRequest("temperature must be between 0 and 1.", param="temperature")
    language = req.language.strip().lower() if req.language else None
    if language:
        language = LANGUAGE_CODES.get(language, language)
        if language not in languages:
            raise InvalidRequest(
                f"Language '{req.language}' is not supported by this model; use an ISO-639-1 code such as 'en'.",
                param="language",
            )
        if not multilingual and language != "en":
            raise InvalidRequest(
                f"This model is English-only; language '{req.language}' is not supported.", param="language"
            )
    if req.task == "translate" and not multilingual:
        raise InvalidRequest("This model is English-only and cannot translate.", param="model")
    return language or None


SpeechSegment = VerboseSegment


def finish(text_parts: list[str], language: str, n_samples: int, segments: list[SpeechSegment]) -> Transcription:
    return Transcription(text="".join(text_parts), language=language, duration=n_samples / SAMPLE_RATE,
                         segments=segments)


def run_batch(one: Callable[[TranscriptionRequest], Transcription], requests: list[TranscriptionRequest],
              on_done: Callable[[int, Any], None] | None, workers: int) -> list[Transcription | OctoError]:
    """Run ``one`` for each request (``workers`` at a time), answering each through ``on_done`` when it ends;
    an OctoError stands in its request's place, any other failure is raised."""
    out: list[Any] = [None] * len(requests)

    def run(i: int) -> None:
        try:
            out[i] = one(requests[i])
        except OctoError as exc:
            out[i] = exc
        if on_done is not None:
            on_done(i, out[i])

    if workers <= 1 or len(requests) == 1:
        for i in range(len(requests)):
            run(i)
        return out
    with ThreadPoolExecutor(max_workers=min(workers, len(requests)), thread_name_prefix="octo-speech") as pool:
        for f in [pool.submit(run, i) for i in range(len(requests))]:
            f.result()
    return out


# OpenAI's API accepts a language name as well as its code ("english" -> "en"); whisper's table
LANGUAGE_CODES = {
    "english": "en", "chinese": "zh", "german": "de", "spanish": "es", "russian": "ru", "korean": "ko",
    "french": "fr", "japanese": "ja", "portuguese": "pt", "turkish": "tr", "polish": "pl", "catalan": "ca",
    "dutch": "nl", "arabic": "ar", "swedish": "sv", "italian": "it", "indonesian": "id", "hindi": "hi",
    "finnish": "fi", "vietnamese": "vi", "hebrew": "he", "ukrainian": "uk", "greek": "el", "malay": "ms",
    "czech": "cs", "romanian": "ro", "danish": "da", "hungarian": "hu", "tamil": "ta", "norwegian": "no",
    "thai": "th", "urdu": "ur", "croatian": "hr", "bulgarian": "bg", "lithuanian": "lt", "latin": "la",
    "welsh": "cy", "slovak": "sk", "persian": "fa", "latvian": "lv", "serbian": "sr", "slovenian": "sl",
    "estonian": "et", "icelandic": "is", "armenian": "hy", "swahili": "sw", "galician": "gl", "afrikaans": "af",
}
