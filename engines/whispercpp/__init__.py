"""The whispercpp engine: Whisper transcription and translation with whisper.cpp (through pywhispercpp).

Loads whisper.cpp's ggml model files (``ggml-*.bin``: ``ggerganov/whisper.cpp`` on the hub, whisper.cpp's
``convert-pt-to-ggml.py`` output, the synthetic builder's ``ggml-*.bin``). whisper.cpp's ``whisper_full`` runs
OpenAI's long-form loop: 30-second windows, temperature fallback (step ``temperature_increment``) with the
log-probability (-1.0) and no-speech (0.6) thresholds, previous text as prompt; its repetition test is the
token entropy (``entropy_thold`` 2.4) where OpenAI measures the gzip compression ratio (2.4) of the text.

One whisper.cpp context holds one decoding state, so queued requests run one after another (no batching);
a request whose client went away is aborted inside whisper.cpp (its abort callback, polled during compute).

Options (``-o KEY=VALUE``): ``threads`` (default: all cores), ``entropy_threshold`` (default 2.4), and the
common decoding options ``beam_size``, ``best_of``, ``max_new_tokens`` (tokens per window, OpenAI's
``n_text_ctx/2`` by default, at most whisper.cpp's ``n_text_ctx/2 - 4``), ``condition_on_previous_text``,
``temperature_increment``, ``logprob_threshold``, ``no_speech_threshold``; ``condition_on_previous_text`` is
always on (whisper.cpp has no switch for it within a request; ``no_context`` is set so that no request's text
prompts the next); ``compression_ratio_threshold`` is accepted only as its default or off (whisper.cpp tests
entropy instead).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from octo.engines.faster_whisper.common import (
    SpeechSegment,
    check_request,
    finish,
    parse_options,
    quiet_library_logs,
    run_batch,
)

from octo.engine import (
    Detection,
    Engine,
    ModelInfo,
    Task,
    Transcription,
    TranscriptionRequest,
    ffmpeg_note,
)
from octo.errors import ConfigError, EngineError, OctoError
from octo.hookspecs import hookimpl
from octo.options import SPEECH_DECODING, optional_float

GGML_MAGIC = 0x67676D6C
_EXTRA = {"entropy_threshold": optional_float}
log = logging.getLogger("octo.engines.whispercpp")
_CENTI = 0.01  # whisper.cpp's timestamps are in 10 ms units


def is_ggml_whisper(path: Path) -> bool:
    """A whisper.cpp model: the ggml magic, then Whisper's hyper-parameters (80 or 128 mel bins)."""
    try:
        with path.open("rb") as f:
            head = f.read(48)
    except OSError:
        return False
    if len(head) < 48 or struct.unpack("<I", head[:4])[0] != GGML_MAGIC:
        return False
    return struct.unpack("<i", head[40:44])[0] in (80, 128)


def window_budget(max_new_tokens: int | None, n_text_ctx: int) -> tuple[int, int]:
    """(tokens a window decodes at most, whisper.cpp's ``max_tokens`` parameter that gives it).

    OpenAI's budget is ``max_new_tokens`` (default ``n_text_ctx // 2``, 224) sampled tokens per window, and a
    window that reaches it is kept. whisper.cpp's loop stops at ``n_text_ctx // 2 - 4`` (220, hard-coded) and
    marks a window that gets there without ``max_tokens`` as failed (it then reruns it at every fallback
    temperature); with ``max_tokens = n - 1`` it ends the window after ``n`` tokens and keeps it, OpenAI's way,
    when the window has a timestamp after its first token or is the audio's last (whisper.cpp fails a middle
    window without one: a real model's windows have them)."""
    n = min(max_new_tokens or n_text_ctx // 2, n_text_ctx // 2 - 4)
    return n, max(1, n - 1)


class WhisperCppEngine(Engine):
    name = "whispercpp"
    aliases = ("whisper.cpp", "pywhispercpp")
    tasks = frozenset({Task.TRANSCRIPTION})
    formats = frozenset({"ggml"})
    option_names = frozenset({*SPEECH_DECODING, *_EXTRA})
    batching = "window"  # queued requests come together (transcribe_batch) and run in turn
    sampling_params = frozenset({"temperature"})
    supports_word_timestamps = True  # whisper.cpp token timestamps, grouped into words

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.opts = parse_options(self.name, self.config.options, _EXTRA)
        if self.opts["compression_ratio_threshold"] not in (None, 2.4):
            raise ConfigError("whisper.cpp has no compression-ratio test; its repetition test is "
                              "entropy_threshold.", param="compression_ratio_threshold")
        if not self.opts["condition_on_previous_text"]:
            raise ConfigError("whisper.cpp always conditions a window on the previous one's text.",
                              param="condition_on_previous_text")
        self.model = None
        self.lock = threading.Lock()

    @classmethod
    def detect(cls) -> Detection:
        if importlib.util.find_spec("pywhispercpp") is None:
            return Detection(False, "pywhispercpp is not installed (pip install 'octo[speech]')")
        try:
            import _pywhispercpp  # noqa: F401 - the compiled extension
        except ImportError as exc:
            return Detection(False, f"pywhispercpp's extension does not load: {exc}")
        return Detection(True, "cpu (whisper.cpp through pywhispercpp)" + ffmpeg_note())

    @classmethod
    def version(cls) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"pywhispercpp-{version('pywhispercpp')}"
        except PackageNotFoundError:
            return "0"

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        p = Path(path)
        return "ggml" if p.is_file() and is_ggml_whisper(p) else None

    def load(self, artifact: str, name: str) -> ModelInfo:
        import _pywhispercpp as pw
        from pywhispercpp.model import Model

        if not is_ggml_whisper(Path(artifact)):
            raise ConfigError(f"{artifact} is not a whisper.cpp ggml model file.")
        beam = self.opts["beam_size"] > 1
        quiet_library_logs("pywhispercpp")
        threads = self.opts.get("threads") or os.cpu_count() or 1
        try:
            self.model = Model(artifact, params_sampling_strategy=1 if beam else 0, redirect_whispercpp_logs_to=None,
                               n_threads=threads, print_progress=False, print_realtime=False,
                               print_timestamps=False)
        except Exception as exc:  # noqa: BLE001 - any loading failure is a configuration problem
            raise ConfigError(f"Cannot load whisper.cpp model from {artifact}: {type(exc).__name__}: {exc}") from exc
        ctx = self.model._ctx  # noqa: SLF001 - the binding's context, for the per-token API
        if ctx is None:
            raise ConfigError(f"whisper.cpp could not load {artifact}.")
        self.multilingual = bool(pw.whisper_is_multilingual(ctx))
        self.max_new_tokens, self.max_tokens = window_budget(self.opts.get("max_new_tokens"),
                                                             pw.whisper_model_n_text_ctx(ctx))
        n = pw.whisper_lang_max_id() + 1
        self.languages = frozenset(pw.whisper_lang_str(i) for i in range(n)) if self.multilingual else frozenset({"en"})
        self.info = ModelInfo(
            name=name,
            n_ctx=pw.whisper_model_n_text_ctx(ctx),
            n_vocab=pw.whisper_model_n_vocab(ctx),
            eos_token_ids=frozenset({pw.whisper_token_eot(ctx)}),
            extra={
                "threads": threads,
                "type": pw.whisper_model_type_readable(ctx),
                "ftype": pw.whisper_model_ftype(ctx),
                "multilingual": self.multilingual,
                "beam_size": self.opts["beam_size"],
                "max_new_tokens": self.max_new_tokens,
                "batching": "none: queued requests run in turn (one whisper.cpp state)",
            },
        )
        return self.info

    def unload(self) -> None:
        self.model = None
        super().unload()

    def _params(self, req: TranscriptionRequest, language: str | None) -> dict[str, Any]:
        o = self.opts
        entropy = o.get("entropy_threshold", 2.4)
        return {
            "language": language or ("auto" if self.multilingual else "en"),
            "translate": req.task == "translate",
            "temperature": req.temperature,
            "temperature_inc": o["temperature_increment"],
            "entropy_thold": 1e9 if entropy is None else entropy,
            "logprob_thold": -1e9 if o["logprob_threshold"] is None else o["logprob_threshold"],
            "no_speech_thold": 1e9 if o["no_speech_threshold"] is None else o["no_speech_threshold"],
            # whisper.cpp keeps the last call's text in its state unless no_context: another request's text must
            # not prompt this one. Within a call, each window's text still conditions the next (OpenAI's rule).
            "no_context": True,
            "initial_prompt": req.prompt or "",
            "max_tokens": self.max_tokens,
            "token_timestamps": req.word_timestamps,
            "greedy": {"best_of": o["best_of"]},
            "beam_search": {"beam_size": o["beam_size"], "patience": -1.0},
            "detect_language": False,
        }

    def transcribe(self, request: TranscriptionRequest) -> Transcription:
        import _pywhispercpp as pw
        import numpy as np

        if self.model is None:
            raise EngineError("The whisper.cpp model is not loaded.")
        language = check_request(request, self.languages, self.multilingual)
        audio = np.ascontiguousarray(request.audio, dtype=np.float32).reshape(-1)
        cancelled = request.cancelled
        with self.lock, native_log(cancelled):
            try:
                self.model.transcribe(audio, abort_callback=(lambda: bool(cancelled())) if cancelled else None,
                                      **self._params(request, language))
                ctx = self.model._ctx  # noqa: SLF001
                n = pw.whisper_full_n_segments(ctx)
                segments = [_segment(pw, ctx, i, request.word_timestamps) for i in range(n)]
                detected = pw.whisper_lang_str(pw.whisper_full_lang_id(ctx)) if self.multilingual else "en"
            except OctoError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise EngineError(f"whisper.cpp failed: {type(exc).__name__}: {exc}") from exc
        return finish([s.text for s in segments], language or detected or "en", len(audio), segments)

    def transcribe_batch(self, requests: list[TranscriptionRequest],
                         on_done: Callable[[int, Any], None] | None = None) -> list[Transcription | OctoError]:
        return run_batch(self.transcribe, requests, on_done, 1)


@contextlib.contextmanager
def native_log(cancelled: Callable[[], bool] | None) -> Iterator[None]:
    """whisper.cpp's own log lines during a call go to octo's log instead of raw to stderr (where "whisper_full:
    failed to encode" showed whenever a cancelled request or a benchmark's deadline stopped it): its warnings and
    errors at warning level unless the call was cancelled, the rest at debug level. Set around each call only: a
    Python callback still set when the interpreter exits would crash it."""
    import _pywhispercpp as pw

    def emit(level: int, text: str) -> None:  # ggml's levels: 3 warning, 4 error
        if level >= 3 and not (cancelled is not None and cancelled()):
            log.warning("whisper.cpp: %s", text.rstrip())
        else:
            log.debug("whisper.cpp: %s", text.rstrip())

    pw.whisper_log_set(emit)
    try:
        yield
    finally:
        pw.whisper_log_set(None)


def _segment(pw, ctx, i: int, words: bool) -> SpeechSegment:
    """Segment ``i`` of the last ``whisper_full``, with OpenAI's fields (and words from token timestamps)."""
    eot = pw.whisper_token_eot(ctx)
    text = pw.whisper_full_get_segment_text(ctx, i).decode("utf-8", errors="replace")
    toks = [pw.whisper_full_get_token_data(ctx, i, j) for j in range(pw.whisper_full_n_tokens(ctx, i))]
    spoken = [t for t in toks if t.id < eot]
    raw = text.strip().encode("utf-8")
    t0, t1 = pw.whisper_full_get_segment_t0(ctx, i) * _CENTI, pw.whisper_full_get_segment_t1(ctx, i) * _CENTI
    return SpeechSegment(
        start=t0, end=t1, text=text, words=_words(pw, ctx, spoken) if words else None, id=i,
        seek=round(t0 * 100), tokens=[t.id for t in toks if t.id != eot],  # OpenAI's segments omit <|endoftext|>
        avg_logprob=float(sum(t.plog for t in spoken) / (len(spoken) + 1)),
        compression_ratio=len(raw) / len(zlib.compress(raw)) if raw else 0.0,
    )


def _words(pw, ctx, tokens) -> list[dict]:
    """Words from token timestamps: a token that starts with a space starts a word."""
    words: list[dict] = []
    for t in tokens:
        piece = pw.whisper_token_to_bytes(ctx, t.id)
        if not words or piece.startswith(b" "):
            words.append({"word": b"", "start": t.t0 * _CENTI, "end": t.t1 * _CENTI, "probability": [], "n": 0})
        w = words[-1]
        w["word"] += piece
        w["end"] = max(w["end"], t.t1 * _CENTI)
        w["probability"].append(t.p)
    return [{"word": w["word"].decode("utf-8", errors="replace"), "start": w["start"], "end": w["end"],
             "probability": float(sum(w["probability"]) / len(w["probability"]))} for w in words if w["word"].strip()]


@hookimpl
def register_engines(register):
    register(WhisperCppEngine)
