"""The whisper engine: speech transcription and translation with openai-whisper on PyTorch.

Loads openai-whisper checkpoints (``model.pt``: ``{"dims": {...}, "model_state_dict": {...}}``, OpenAI's
published files and the catalog's ``whisper-*`` entries) and Hugging Face ``transformers`` Whisper folders
(``openai/whisper-*`` on the hub, by renaming the weights), and transcribes like
``whisper.transcribe`` (30-second windows, temperature fallback, previous text as prompt), several
requests at a time: :meth:`WhisperEngine.transcribe_batch` encodes every request's current window in one
batch and decodes windows with the same decoding setup together (see ``batch.py``).

Options (``-o KEY=VALUE``): ``threads`` (torch intra-op threads), ``device`` (cpu|cuda, default: cuda
when available), ``fp16`` (default on cuda only), ``beam_size``, ``best_of``, ``max_new_tokens`` (tokens
per 30-second window; default whisper's n_text_ctx/2 = 224; bounds random-weight models),
``condition_on_previous_text``, ``temperature_increment`` (fallback step, 0 = no fallback),
``compression_ratio_threshold``, ``logprob_threshold``, ``no_speech_threshold``.
"""

from __future__ import annotations

import importlib.util
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octo.engine import (
    Detection,
    Engine,
    ModelInfo,
    Task,
    Transcription,
    TranscriptionRequest,
    VerboseSegment,
    ffmpeg_note,
)
from octo.errors import ConfigError, EngineError, InvalidRequest, OctoError
from octo.hookspecs import hookimpl
from octo.options import SPEECH_DECODING, boolean, parse_engine_options

_OPTIONS = {**SPEECH_DECODING, "device": str, "fp16": boolean}
_BATCH_FIELDS = {"max_new_tokens": "sample_len"}


WhisperSegment = VerboseSegment  # the name this engine has always used


class WhisperEngine(Engine):
    name = "whisper"
    tasks = frozenset({Task.TRANSCRIPTION})
    formats = frozenset({"whisper"})
    option_names = frozenset(_OPTIONS)
    batching = "window"  # queued requests are transcribed together (transcribe_batch), not joined mid-run
    sampling_params = frozenset({"temperature"})
    supports_word_timestamps = True  # cross-attention alignment (whisper.timing), for any checkpoint

    def __init__(self, config=None) -> None:
        super().__init__(config)
        opts = parse_engine_options("whisper", _OPTIONS, self.config.options)
        if opts.get("device", "cpu") not in ("cpu", "cuda") and not str(opts["device"]).startswith("cuda:"):
            raise ConfigError(f"Option 'device' must be cpu or cuda, got '{opts['device']}'.", param="device")
        self.opts = opts
        self.model = None
        self.settings = None

    # -- discovery -------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        for module, package in (("torch", "torch==2.13.0"), ("whisper", "openai-whisper")):
            if importlib.util.find_spec(module) is None:
                return Detection(False, f"{package} is not installed (pip install 'octo[whisper]')")
        # uploads are decoded by the gateway (ffmpeg, or octo itself for WAV): the engine takes samples, never files
        return Detection(True, "cpu (cuda when available)" + ffmpeg_note())

    @classmethod
    def version(cls) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"{version('openai-whisper')}+torch{version('torch')}"
        except PackageNotFoundError:
            return "0"

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        p = Path(path)
        if p.is_dir():
            from octo.engines.whisper.hf import is_hf_whisper

            return "whisper" if is_hf_whisper(p) else None
        if p.is_file() and _is_whisper_checkpoint(p):
            return "whisper"
        return None

    # -- life cycle ------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        import torch
        from octo.engines.whisper.batch import Settings

        device = self.opts.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        fp16 = self.opts.get("fp16", device != "cpu")
        if fp16 and device == "cpu":
            raise ConfigError("fp16 is not supported on CPU (whisper computes in float32 there).", param="fp16")
        if "threads" in self.opts:
            torch.set_num_threads(self.opts["threads"])
        try:
            model, heads = _load_model(Path(artifact), device)
        except OctoError:
            raise
        except Exception as exc:  # noqa: BLE001 - any loading failure is a configuration problem
            raise ConfigError(f"Cannot load whisper model from {artifact}: {type(exc).__name__}: {exc}") from exc
        self.model = model
        s = Settings(fp16=fp16, max_batch=self.config.max_batch)
        for key, value in self.opts.items():
            field = _BATCH_FIELDS.get(key, key)
            if hasattr(s, field):
                setattr(s, field, value)
        self.settings = s
        dims = model.dims
        from whisper.tokenizer import get_tokenizer

        tok = get_tokenizer(model.is_multilingual, num_languages=model.num_languages)
        self.info = ModelInfo(
            name=name,
            n_ctx=dims.n_text_ctx,
            eos_token_ids=frozenset({tok.eot}),
            n_vocab=dims.n_vocab,
            extra={
                "device": device,
                "threads": torch.get_num_threads(),
                "fp16": fp16,
                "multilingual": model.is_multilingual,
                "dims": dict(dims.__dict__),
                "alignment_heads": ("official" if isinstance(heads, str) else "checkpoint")
                if heads
                else "default (last half of decoder layers)",
                "max_new_tokens": s.sample_len or dims.n_text_ctx // 2,
                "beam_size": s.beam_size,
                "batching": "windows of concurrent requests",
            },
        )
        return self.info

    def unload(self) -> None:
        self.model = None
        super().unload()

    # -- transcription ---------------------------------------------------------------------------
    def transcribe(self, request: TranscriptionRequest) -> Transcription:
        result = self.transcribe_batch([request])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def transcribe_batch(
        self,
        requests: list[TranscriptionRequest],
        on_done: Callable[[int, Transcription | OctoError], None] | None = None,
    ) -> list[Transcription | OctoError]:
        """Transcribe several requests together; a request that is invalid gets its error in its place.

        ``on_done(index, result)``, when given, is called for each request as soon as it is finished (a
        short clip batched with a long recording need not wait for it); the list is returned at the end.
        """
        import torch
        from octo.engines.whisper.batch import Job, temperatures_from, transcribe_jobs

        if self.model is None:
            raise EngineError("The whisper model is not loaded.")
        out: list[Any] = [None] * len(requests)
        jobs: dict[int, Job] = {}
        for i, req in enumerate(requests):
            try:
                jobs[i] = self._job(req, Job, temperatures_from)
            except OctoError as exc:
                out[i] = exc
                if on_done is not None:
                    on_done(i, exc)
        index = {id(job): i for i, job in jobs.items()}

        def finished(job: Job) -> None:
            i = index[id(job)]
            out[i] = Transcription(
                text=job.text,
                language=job.language,
                duration=len(job.audio) / 16000.0,
                segments=[_segment(s) for s in job.segments],
            )
            if on_done is not None:
                on_done(i, out[i])

        try:
            with torch.inference_mode():
                transcribe_jobs(self.model, list(jobs.values()), self.settings, finished)
        except OctoError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"whisper failed: {type(exc).__name__}: {exc}") from exc
        return out

    def _job(self, req: TranscriptionRequest, job_cls, temperatures_from):
        import numpy as np
        from whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

        model = self.model
        if req.task not in ("transcribe", "translate"):
            raise InvalidRequest(f"Unknown task '{req.task}'.", param="task")
        language = req.language.strip().lower() if req.language else None
        if language:
            language = TO_LANGUAGE_CODE.get(language, language)
            if language not in LANGUAGES or list(LANGUAGES).index(language) >= model.num_languages:
                raise InvalidRequest(
                    f"Language '{req.language}' is not supported by this model; use an ISO-639-1 code such as 'en'.",
                    param="language",
                )
            if not model.is_multilingual and language != "en":
                raise InvalidRequest(
                    f"This model is English-only; language '{req.language}' is not supported.", param="language"
                )
        if req.task == "translate" and not model.is_multilingual:
            raise InvalidRequest("This model is English-only and cannot translate.", param="model")
        if not 0.0 <= req.temperature <= 1.0:
            raise InvalidRequest("temperature must be between 0 and 1.", param="temperature")
        audio = np.ascontiguousarray(req.audio, dtype=np.float32).reshape(-1)
        return job_cls(
            audio=audio,
            task=req.task,
            language=language or None,
            prompt=req.prompt or None,
            temperatures=temperatures_from(req.temperature, self.settings.temperature_increment),
            word_timestamps=req.word_timestamps,
            cancelled=req.cancelled,
        )


def _segment(s: dict) -> WhisperSegment:
    words = None
    if s.get("words") is not None:
        words = [
            {
                "word": w["word"],
                "start": float(w["start"]),
                "end": float(w["end"]),
                "probability": float(w["probability"]),
            }
            for w in s["words"]
        ]
    return WhisperSegment(
        start=float(s["start"]),
        end=float(s["end"]),
        text=s["text"],
        words=words,
        id=s["id"],
        seek=s["seek"],
        tokens=list(s["tokens"]),
        temperature=float(s["temperature"]),
        avg_logprob=float(s["avg_logprob"]),
        compression_ratio=float(s["compression_ratio"]),
        no_speech_prob=float(s["no_speech_prob"]),
    )


def _is_whisper_checkpoint(path: Path) -> bool:
    """A torch checkpoint holding ``dims`` and ``model_state_dict``, checked from its pickle header only."""
    try:
        if zipfile.is_zipfile(path):  # torch >= 1.6 format: the pickle is a small member, tensors are apart
            with zipfile.ZipFile(path) as zf:
                name = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                if name is None:
                    return False
                with zf.open(name) as f:
                    head = f.read(1 << 20)
        else:  # legacy format: the pickle comes first
            with open(path, "rb") as f:
                head = f.read(1 << 20)
    except OSError:
        return False
    return b"model_state_dict" in head and b"dims" in head and b"n_text_ctx" in head


def _load_model(path: Path, device: str):
    import torch
    import whisper
    from octo.engines.whisper.hf import is_hf_whisper, load_hf_folder
    from whisper.model import ModelDimensions, Whisper

    if path.is_dir():
        if not is_hf_whisper(path):
            raise ConfigError(f"{path} is not a whisper model folder (no config.json with model_type whisper).")
        dims, state, heads = load_hf_folder(path)
        model = Whisper(ModelDimensions(**dims))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        if heads:
            mask = torch.zeros(model.dims.n_text_layer, model.dims.n_text_head, dtype=torch.bool)
            for layer, head in heads:
                mask[layer, head] = True
            model.register_buffer("alignment_heads", mask.to_sparse(), persistent=False)
        return model.to(device).eval(), heads
    if not _is_whisper_checkpoint(path):
        raise ConfigError(f"{path} is not a whisper checkpoint (a torch file with 'dims' and 'model_state_dict').")
    model = whisper.load_model(str(path), device=device).eval()
    official = official_name(path)
    if official is not None:  # whisper.load_model(name) sets these; load_model(path) cannot know them
        model.set_alignment_heads(whisper._ALIGNMENT_HEADS[official])
    return model, official


def official_name(path: Path) -> str | None:
    """The name of an OpenAI checkpoint (``tiny``, ``large-v3``, ...) identified by its SHA-256, or None.

    OpenAI's URLs carry the file's SHA-256 as their folder, which octo's downloads keep; a file named like
    an official one elsewhere is hashed."""
    import hashlib

    import whisper

    urls = {name: url for name, url in whisper._MODELS.items() if name in whisper._ALIGNMENT_HEADS}
    name = path.stem if path.stem in urls else None
    if name is None:
        return None
    expected = urls[name].split("/")[-2]
    if path.parent.name == expected:
        return name
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return name if digest.hexdigest() == expected else None


@hookimpl
def register_engines(register):
    register(WhisperEngine)
