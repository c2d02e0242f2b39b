"""The faster-whisper engine: Whisper transcription and translation on CTranslate2.

Loads CTranslate2 Whisper folders (``model.bin`` + ``config.json`` + ``tokenizer.json``: ``Systran/faster-whisper-*``
on the hub, ``ct2-transformers-converter`` output, the synthetic builder's ``ct2-*`` folders) and transcribes
with faster-whisper's ``WhisperModel.transcribe``, whose long-form loop is ``whisper.transcribe``'s: 30-second
windows, OpenAI's temperature fallback with its thresholds, previous text as prompt. The engine sets the
options where faster-whisper's defaults differ from OpenAI's (faster-whisper: beam 5, best_of 5, 448 new
tokens on the first window; OpenAI: greedy, one sample, 224), and keeps VAD and the batched pipeline off
(``BatchedInferencePipeline`` cuts audio at VAD pauses and decodes chunks without the previous text or the
fallback: other semantics).

Options (``-o KEY=VALUE``): ``compute_type`` (default ``auto``: CTranslate2's fastest type on the device, int8
weights on a CPU that has int8 kernels (as faster-whisper recommends for CPUs and CPU speech servers run it),
float16 on CUDA; ``default`` keeps the folder's own type; int8, int8_float32, float32, float16 ...), ``device``
(cpu|cuda|auto), ``threads`` (CTranslate2 intra-op threads; default: all cores or one, measured by the start-up
benchmark, see ``thread_counts``, or where none ran by the engine's idle-time probe, see ``tuning.py``),
``encoder_threads`` (default: all cores where a copy of the model is small enough, see :class:`SplitModel`; set
it equal to ``threads`` for one copy), ``workers`` (default 1: the windows of queued requests go through
CTranslate2 in one batch, see ``batch.py``; N > 1: queued requests transcribed in parallel on N CTranslate2
workers instead), and the common
decoding options ``beam_size``, ``best_of``, ``max_new_tokens``, ``condition_on_previous_text``,
``temperature_increment``, ``compression_ratio_threshold``, ``logprob_threshold``, ``no_speech_threshold``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octo.engines.faster_whisper import tuning
from octo.engines.faster_whisper.batch import Abandoned, transcribe_together
from octo.engines.faster_whisper.common import (
    SpeechSegment,
    check_request,
    finish,
    parse_options,
    quiet_library_logs,
    run_batch,
    temperatures,
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
from octo.options import SPEECH_DECODING, positive_int

_EXTRA = {"compute_type": str, "device": str, "workers": positive_int, "encoder_threads": positive_int}
# The largest model.bin whose encoder gets a copy of its own on more threads than the decoder by default (SplitModel):
# Whisper up to "small" (float32: 0.97 GB); medium and large would double gigabytes of weights.
SPLIT_MAX_BYTES = 1 << 30


def is_ct2_whisper(path: Path) -> bool:
    """A CTranslate2 Whisper folder: model.bin and a config.json with Whisper's fields."""
    if not (path / "model.bin").is_file() or not (path / "config.json").is_file():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "suppress_ids_begin" in config and "lang_ids" in config


class FasterWhisperEngine(Engine):
    name = "faster-whisper"
    aliases = ("faster_whisper", "ctranslate2")
    tasks = frozenset({Task.TRANSCRIPTION})
    formats = frozenset({"ct2"})
    option_names = frozenset({*SPEECH_DECODING, *_EXTRA})
    batching = "window"  # queued requests come together (transcribe_batch): one CTranslate2 batch per round
    sampling_params = frozenset({"temperature"})
    supports_word_timestamps = True  # cross-attention alignment, as openai-whisper
    threads_switch_while_serving = False  # a switch reloads the model: only the start-up benchmark does it

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.opts = parse_options(self.name, self.config.options, _EXTRA)
        if self.opts.get("device", "cpu") not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"Option 'device' must be cpu, cuda or auto, got '{self.opts['device']}'.",
                              param="device")
        self.model = None
        self.languages: frozenset[str] = frozenset()
        self.probe: tuning.ThreadProbe | None = None

    @classmethod
    def detect(cls) -> Detection:
        for module, package in (("ctranslate2", "ctranslate2"), ("faster_whisper", "faster-whisper")):
            if importlib.util.find_spec(module) is None:
                return Detection(False, f"{package} is not installed (pip install 'octo[speech]')")
        # not imported here: detect() runs in the gateway, and CTranslate2 brings its own OpenMP runtime
        return Detection(True, "cpu (cuda when built with it); compute_type auto (int8 weights on CPU; "
                               "-o compute_type=float32|default|...)" + ffmpeg_note())

    @classmethod
    def version(cls) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"{version('faster-whisper')}+ct2-{version('ctranslate2')}"
        except PackageNotFoundError:
            return "0"

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        p = Path(path)
        return "ct2" if p.is_dir() and is_ct2_whisper(p) else None

    def load(self, artifact: str, name: str) -> ModelInfo:
        path = Path(artifact)
        if not is_ct2_whisper(path):
            raise ConfigError(f"{artifact} is not a CTranslate2 Whisper folder (model.bin + config.json).")
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"{artifact} has no tokenizer.json (faster-whisper would download one).")
        self.path = path
        quiet_library_logs("faster_whisper")
        record = None if self.opts.get("threads") else tuning.read_record(self)
        cached = tuning.verdict_threads(record)
        threads = self.opts.get("threads") or cached or os.cpu_count() or 1
        self.model = self._model(threads)
        ct2 = self.model.model
        self.languages = frozenset(self.model.supported_languages)
        self.info = ModelInfo(
            name=name,
            n_ctx=self.model.max_length,
            n_vocab=self.model.hf_tokenizer.get_vocab_size(),
            extra={
                "device": ct2.device,
                "compute_type": ct2.compute_type,
                "threads": threads,
                "threads_chosen_by": "option" if self.opts.get("threads") else "cached idle probe" if cached else
                "all cores",
                "encoder_threads": getattr(ct2, "encoder_threads", threads),
                "workers": self.opts.get("workers", 1),
                "multilingual": ct2.is_multilingual,
                "n_mels": ct2.n_mels,
                "max_new_tokens": self.opts.get("max_new_tokens") or self.model.max_length // 2,
                "beam_size": self.opts["beam_size"],
                "batching": ("queued requests in parallel on CTranslate2 workers" if self.opts.get("workers", 1) > 1
                             else "windows of queued requests in one CTranslate2 batch"),
            },
        )
        if cached is None and len(self.thread_counts()) > 1:
            self.probe = tuning.ThreadProbe(self, record)
            self.info.extra["threads_chosen_by"] = "all cores (the idle-time probe measures the other count)"
        return self.info

    def idle_work(self, interrupted: Callable[[], bool]) -> float | None:
        """The thread probe (``tuning.py``) while no request runs; None once it has concluded."""
        if self.probe is None or self.model is None:
            return None
        wait = self.probe.run(interrupted)
        if wait is None:
            self.probe = None
        return wait

    def adopt(self, model: Any, threads: int) -> None:
        """Serve with ``model``, loaded on ``threads`` (the probe's winner)."""
        self.model = model
        self.info.extra["threads"] = threads
        self.info.extra["encoder_threads"] = getattr(model.model, "encoder_threads", threads)

    def _model(self, threads: int) -> Any:
        """faster-whisper's model of the folder on ``threads`` CTranslate2 intra-op threads (its encoder on
        :meth:`encoder_threads`)."""
        device, compute_type = self.opts.get("device", "cpu"), self.opts.get("compute_type", "auto")
        try:
            model = model_class()(str(self.path), device=device, compute_type=compute_type, cpu_threads=threads,
                                  num_workers=self.opts.get("workers", 1), local_files_only=True)
            n = self.encoder_threads(threads, model.model.device)
            if n != threads:
                import ctranslate2

                encoder = ctranslate2.models.Whisper(str(self.path), device=device, compute_type=compute_type,
                                                     intra_threads=n, inter_threads=1)
                model.model = SplitModel(model.model, encoder, n)
            return model
        except Exception as exc:  # noqa: BLE001 - any loading failure is a configuration problem
            raise ConfigError(f"Cannot load CTranslate2 Whisper model from {self.path}: {type(exc).__name__}: "
                              f"{exc}") from exc

    def encoder_threads(self, threads: int, device: str) -> int:
        """The encoder's intra-op threads: ``-o encoder_threads``, else all cores when the decoder runs on fewer, on a
        CPU, with one CTranslate2 worker and a model.bin of at most ``SPLIT_MAX_BYTES`` (a second copy of the
        weights); else ``threads`` (one model for both)."""
        if self.opts.get("encoder_threads"):
            return self.opts["encoder_threads"] if device == "cpu" else threads
        cores = os.cpu_count() or 1
        if device != "cpu" or threads >= cores or self.opts.get("workers", 1) > 1:
            return threads
        try:
            small = (self.path / "model.bin").stat().st_size <= SPLIT_MAX_BYTES
        except OSError:
            small = False
        return cores if small else threads

    def thread_counts(self) -> list[int]:
        """The intra-op thread count now, then the other one worth measuring (all cores, or 1): a decoder step of
        Whisper is a few small products, and on some hosts one CTranslate2 thread decodes twice as fast as two
        (bench/speech_engines.py: 145 against 70 tok/s on a 2-vCPU VM), on others two win. The start-up
        benchmark measures both; ``-o threads=N`` fixes the count ([]: not tuned)."""
        if self.model is None or self.opts.get("threads") or self.model.model.device != "cpu":
            return []
        now, cores = self.info.extra["threads"], os.cpu_count() or 1
        return [now] + [n for n in dict.fromkeys((cores, 1)) if n != now]

    def set_threads(self, n: int) -> None:
        """Reload the model on ``n`` threads (CTranslate2 fixes them per model: 0.3 s for a base-size model)."""
        self.probe = None  # the start-up benchmark measures the counts: the idle-time probe is not needed
        if self.model is None:
            return
        self.info.extra["threads_chosen_by"] = "start-up benchmark"
        if n == self.info.extra["threads"]:
            return
        self.adopt(self._model(n), n)

    def unload(self) -> None:
        self.model = None
        super().unload()

    def transcribe(self, request: TranscriptionRequest) -> Transcription:
        if self.model is None:
            raise EngineError("The faster-whisper model is not loaded.")
        return self.transcribe_with(self.model, request)

    def transcribe_with(self, model: Any, request: TranscriptionRequest) -> Transcription:
        """faster-whisper's ``transcribe`` on ``model`` (the loaded one, or a batch's view of it) with OpenAI's
        decoding; a request whose client went away ends at its next window with what it has."""
        o = self.opts
        language = check_request(request, self.languages, self.model.model.is_multilingual)
        if language is None and not self.model.model.is_multilingual:
            language = "en"
        out: list[SpeechSegment] = []
        try:
            segments, info = model.transcribe(
                request.audio, language=language, task=request.task, beam_size=o["beam_size"],
                best_of=o["best_of"], temperature=list(temperatures(request.temperature, o["temperature_increment"])),
                compression_ratio_threshold=o["compression_ratio_threshold"],
                log_prob_threshold=o["logprob_threshold"], no_speech_threshold=o["no_speech_threshold"],
                condition_on_previous_text=o["condition_on_previous_text"], initial_prompt=request.prompt or None,
                word_timestamps=request.word_timestamps, vad_filter=False, without_timestamps=False,
                max_new_tokens=o.get("max_new_tokens") or self.model.max_length // 2,
            )
            language = info.language
            for s in segments:  # lazily decoded: one 30-second window per step
                out.append(_segment(s))
                if request.cancelled is not None and request.cancelled():
                    break
        except Abandoned:  # (batched) the client went away: nobody reads what is returned
            pass
        except OctoError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"faster-whisper failed: {type(exc).__name__}: {exc}") from exc
        return finish([s.text for s in out], language or "", len(request.audio), out)

    def transcribe_batch(self, requests: list[TranscriptionRequest],
                         on_done: Callable[[int, Any], None] | None = None) -> list[Transcription | OctoError]:
        """Queued requests together: one CTranslate2 batch per round of windows (``batch.py``); with
        ``workers`` > 1, each request on a CTranslate2 worker of its own instead."""
        if self.model is None:
            raise EngineError("The faster-whisper model is not loaded.")
        workers = self.opts.get("workers", 1)
        if workers > 1 or len(requests) == 1:
            return run_batch(self.transcribe, requests, on_done, workers)
        return transcribe_together(self.model, requests, self.transcribe_with, on_done, self.config.max_batch)


class SplitModel:
    """A CTranslate2 Whisper whose encoder runs on a second copy of the model with more threads.

    A decoder step is a few small products: on some hosts one thread decodes twice as fast as two (OpenMP's
    synchronisation costs more than the second core gives), while the encoder's large products gain from every
    core (2 vCPUs here: 0.48 s against 0.80 s a 30-second window). CTranslate2 fixes the thread count per model, so
    the encoder gets a model of its own; ``encode`` goes there, everything else (``generate``, ``detect_language``,
    ``align``, the attributes) to the decoder's. The encoder output is a host tensor either side reads."""

    def __init__(self, decoder: Any, encoder: Any, encoder_threads: int) -> None:
        self.decoder, self.encoder, self.encoder_threads = decoder, encoder, encoder_threads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)

    def encode(self, features: Any, to_cpu: bool = False) -> Any:
        return self.encoder.encode(features, to_cpu=to_cpu)


def _segment(s: Any) -> SpeechSegment:
    words = None
    if s.words is not None:
        words = [{"word": w.word, "start": float(w.start), "end": float(w.end), "probability": float(w.probability)}
                 for w in s.words]
    return SpeechSegment(start=float(s.start), end=float(s.end), text=s.text, words=words, id=s.id - 1, seek=s.seek,
                         tokens=list(s.tokens), temperature=float(s.temperature or 0.0),
                         avg_logprob=float(s.avg_logprob), compression_ratio=float(s.compression_ratio),
                         no_speech_prob=float(s.no_speech_prob))


def ct2_max_new_tokens(new: int, prompt: int, n_text_ctx: int) -> int:
    """The ``max_new_tokens`` to hand faster-whisper so that CTranslate2 decodes OpenAI's budget of a window:
    ``new`` tokens, and never a position past the text context.

    faster-whisper passes ``max_length = prompt + max_new_tokens`` to CTranslate2, whose Whisper ``generate``
    decodes at most ``min(max_length // 2, max_length - (prompt - 1))`` tokens (whisper.cc): taken as is,
    ``max_new_tokens=224`` would stop a window at 113 tokens. openai-whisper samples ``sample_len`` tokens and
    stops when the sequence passes ``n_text_ctx`` (``min(new, n_text_ctx + 1 - prompt)``); so does this."""
    return min(n_text_ctx, max(2 * new, new + prompt - 1)) - prompt


def model_class():
    """faster-whisper's WhisperModel with OpenAI's token budget per window (:func:`ct2_max_new_tokens`)."""
    from dataclasses import replace

    from faster_whisper import WhisperModel

    class Model(WhisperModel):
        def generate_with_fallback(self, encoder_output, prompt, tokenizer, options):
            new = options.max_new_tokens or self.max_length // 2
            options = replace(options, max_new_tokens=ct2_max_new_tokens(new, len(prompt), self.max_length))
            return super().generate_with_fallback(encoder_output, prompt, tokenizer, options)

    return Model


@hookimpl
def register_engines(register):
    register(FasterWhisperEngine)
