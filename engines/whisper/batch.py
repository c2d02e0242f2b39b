"""Batched long-form transcription: ``whisper.transcribe``'s algorithm, several requests at a time.

Each request keeps the state ``whisper.transcribe`` keeps (seek position, token history used as the next
window's prompt, segments); every round, the current 30-second window of every active request goes
through the encoder in one batch, and windows whose decoding setup is identical (task, language, prompt
tokens, temperature) are decoded together by one ``whisper.decoding.DecodingTask``. Temperature fallback
then re-decodes only the rows that failed the thresholds, reusing their encoder output. One request on
its own follows exactly ``whisper.transcribe``'s steps (tests compare the two).

Not ported: ``clip_timestamps``, ``hallucination_silence_threshold``, ``carry_initial_prompt`` and
verbose printing (the engine never sets them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from whisper.audio import (
    FRAMES_PER_SECOND,
    HOP_LENGTH,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    pad_or_trim,
)
from whisper.decoding import DecodingOptions, DecodingResult, DecodingTask
from whisper.timing import add_word_timestamps
from whisper.tokenizer import Tokenizer, get_tokenizer
from whisper.utils import get_end

from octo.engine import fallback_temperatures


@dataclass
class Settings:
    """The ``whisper.transcribe`` keyword arguments the engine controls (its ``-o`` options)."""

    temperature_increment: float = 0.2
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    sample_len: int | None = None
    beam_size: int | None = None
    best_of: int | None = None
    fp16: bool = False
    max_batch: int = 8


@dataclass(eq=False)
class Job:
    """One request's transcription state (the local variables of ``whisper.transcribe``)."""

    audio: Any
    task: str
    language: str | None
    prompt: str | None
    temperatures: tuple[float, ...]
    word_timestamps: bool
    mel: torch.Tensor | None = None
    content_frames: int = 0
    tokenizer: Tokenizer | None = None
    seek: int = 0
    all_tokens: list[int] = field(default_factory=list)
    n_initial: int = 0
    prompt_reset_since: int = 0
    segments: list[dict] = field(default_factory=list)
    last_speech_timestamp: float = 0.0
    # the current window
    mel_segment: torch.Tensor | None = None
    segment_size: int = 0
    features: torch.Tensor | None = None
    fallback: int = 0
    cancelled: Any = None  # TranscriptionRequest.cancelled: polled between windows and fallbacks

    @property
    def gone(self) -> bool:
        """The client went away: no more windows or fallbacks for this job."""
        return self.cancelled is not None and bool(self.cancelled())

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames or self.gone

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.all_tokens[self.n_initial :])


temperatures_from = fallback_temperatures  # the name this engine has always used


def transcribe_jobs(model, jobs: list[Job], s: Settings, on_done: Callable[[Job], None] | None = None) -> None:
    """Run every job to completion; results stay on the jobs (``segments``, ``text``, ``language``).

    ``on_done(job)`` is called as soon as a job has its last window, so a short request batched with a
    long one is answered without waiting for it."""
    dtype = torch.float16 if s.fp16 else torch.float32
    for job in jobs:
        job.mel = log_mel_spectrogram(job.audio, model.dims.n_mels, padding=N_SAMPLES)
        job.content_frames = job.mel.shape[-1] - N_FRAMES
    _detect_languages(model, [j for j in jobs if j.language is None], dtype, s.max_batch)
    for job in jobs:
        job.tokenizer = get_tokenizer(
            model.is_multilingual, num_languages=model.num_languages, language=job.language, task=job.task
        )
        if job.prompt is not None:
            job.all_tokens = job.tokenizer.encode(" " + job.prompt.strip())
            job.n_initial = len(job.all_tokens)
    reported: set[int] = set()

    def report() -> None:
        for job in jobs:
            if on_done is not None and job.done and id(job) not in reported:
                reported.add(id(job))
                on_done(job)

    while active := [j for j in jobs if not j.done]:
        report()
        for job in active:
            job.segment_size = min(N_FRAMES, job.content_frames - job.seek)
            segment = job.mel[:, job.seek : job.seek + job.segment_size]
            job.mel_segment = pad_or_trim(segment, N_FRAMES).to(model.device).to(dtype)
            job.fallback = 0
        for chunk in _chunks(active, s.max_batch):
            features = model.encoder(torch.stack([j.mel_segment for j in chunk]))
            for job, row in zip(chunk, features, strict=True):
                job.features = row
        results = _decode_with_fallback(model, active, s)
        for job in active:
            _consume(model, job, results[job], s)
            job.features = job.mel_segment = None
    report()


def _chunks(items: list, size: int):
    for i in range(0, len(items), max(1, size)):
        yield items[i : i + size]


def _detect_languages(model, jobs: list[Job], dtype, max_batch: int) -> None:
    if not model.is_multilingual:
        for job in jobs:
            job.language = "en"
        return
    for chunk in _chunks(jobs, max_batch):
        mels = torch.stack([pad_or_trim(j.mel, N_FRAMES).to(model.device).to(dtype) for j in chunk])
        _, probs = model.detect_language(mels)
        for job, p in zip(chunk, probs, strict=True):
            job.language = max(p, key=p.get)


def _options(job: Job, s: Settings) -> DecodingOptions:
    t = job.temperatures[job.fallback]
    return DecodingOptions(
        task=job.task,
        language=job.language,
        temperature=t,
        sample_len=s.sample_len,
        beam_size=s.beam_size if t == 0 else None,
        best_of=s.best_of if t > 0 else None,
        prompt=job.all_tokens[job.prompt_reset_since :],
        fp16=s.fp16,
    )


def _decode_with_fallback(model, jobs: list[Job], s: Settings) -> dict[Job, DecodingResult]:
    """Decode each job's window; rows that fail the thresholds retry at their next temperature."""
    final: dict[Job, DecodingResult] = {}
    pending = list(jobs)
    while pending:
        groups: dict[tuple, tuple[DecodingOptions, list[Job]]] = {}
        for job in pending:
            opts = _options(job, s)
            groups.setdefault(_key(opts), (opts, []))[1].append(job)
        pending = []
        for opts, group in groups.values():
            for chunk in _chunks(group, s.max_batch):
                results = DecodingTask(model, opts).run(torch.stack([j.features for j in chunk]))
                for job, result in zip(chunk, results, strict=True):
                    final[job] = result
                    if _needs_fallback(result, s) and job.fallback + 1 < len(job.temperatures) and not job.gone:
                        job.fallback += 1
                        pending.append(job)
    return final


def _key(opts: DecodingOptions) -> tuple:
    return (opts.task, opts.language, opts.temperature, opts.beam_size, opts.best_of, tuple(opts.prompt or ()))


def _needs_fallback(r: DecodingResult, s: Settings) -> bool:
    needs = False
    if s.compression_ratio_threshold is not None and r.compression_ratio > s.compression_ratio_threshold:
        needs = True  # too repetitive
    if s.logprob_threshold is not None and r.avg_logprob < s.logprob_threshold:
        needs = True  # average log probability is too low
    if (
        s.no_speech_threshold is not None
        and r.no_speech_prob > s.no_speech_threshold
        and s.logprob_threshold is not None
        and r.avg_logprob < s.logprob_threshold
    ):
        needs = False  # silence
    return needs


def _consume(model, job: Job, result: DecodingResult, s: Settings) -> None:
    """Turn one window's decoding into segments and advance ``seek`` (``whisper.transcribe``'s loop body)."""
    seek, segment_size = job.seek, job.segment_size
    if s.no_speech_threshold is not None:
        should_skip = result.no_speech_prob > s.no_speech_threshold
        if s.logprob_threshold is not None and result.avg_logprob > s.logprob_threshold:
            should_skip = False  # the logprob is high enough, despite the no_speech_prob
        if should_skip:
            job.seek += segment_size
            return
    time_offset = float(seek * HOP_LENGTH / SAMPLE_RATE)
    current, single_timestamp_ending = _segments(model, job, result, time_offset)
    if job.word_timestamps:
        _word_timestamps(model, job, current, single_timestamp_ending, time_offset)

    for segment in current:  # an instantaneous segment or one without text is cleared
        if segment["start"] == segment["end"] or segment["text"].strip() == "":
            segment["text"] = ""
            segment["tokens"] = []
            segment["words"] = []
    job.segments.extend({"id": i, **seg} for i, seg in enumerate(current, start=len(job.segments)))
    job.all_tokens.extend(t for seg in current for t in seg["tokens"])
    if not s.condition_on_previous_text or result.temperature > 0.5:
        job.prompt_reset_since = len(job.all_tokens)  # no prompt after a high temperature
    if job.seek <= seek:
        # A window that ends in a segment starting at its own first timestamp would be decoded again
        # forever (random weights do this); whisper.transcribe has no guard. Move on to the next window.
        job.seek = seek + segment_size


def _segments(model, job: Job, result: DecodingResult, time_offset: float) -> tuple[list[dict], bool]:
    """The window's segments, cut at its timestamp tokens, with ``seek`` advanced past them; and whether the window
    ends with a single timestamp (no speech after it)."""
    tokenizer = job.tokenizer
    seek, segment_size = job.seek, job.segment_size
    input_stride = N_FRAMES // model.dims.n_audio_ctx  # mel frames per output token: 2
    time_precision = input_stride * HOP_LENGTH / SAMPLE_RATE  # seconds per output token: 0.02
    segment_duration = segment_size * HOP_LENGTH / SAMPLE_RATE
    tokens = torch.tensor(result.tokens)

    def new_segment(start: float, end: float, toks: torch.Tensor) -> dict:
        toks = toks.tolist()
        return {
            "seek": seek,
            "start": start,
            "end": end,
            "text": tokenizer.decode([t for t in toks if t < tokenizer.eot]),
            "tokens": toks,
            "temperature": result.temperature,
            "avg_logprob": result.avg_logprob,
            "compression_ratio": result.compression_ratio,
            "no_speech_prob": result.no_speech_prob,
        }

    current: list[dict] = []
    timestamp_tokens = tokens.ge(tokenizer.timestamp_begin)
    single_timestamp_ending = timestamp_tokens[-2:].tolist() == [False, True]
    consecutive = torch.where(timestamp_tokens[:-1] & timestamp_tokens[1:])[0]
    consecutive.add_(1)
    if len(consecutive) > 0:  # the output contains two consecutive timestamp tokens
        slices = consecutive.tolist()
        if single_timestamp_ending:
            slices.append(len(tokens))
        last_slice = 0
        for current_slice in slices:
            sliced = tokens[last_slice:current_slice]
            start_pos = sliced[0].item() - tokenizer.timestamp_begin
            end_pos = sliced[-1].item() - tokenizer.timestamp_begin
            current.append(
                new_segment(time_offset + start_pos * time_precision, time_offset + end_pos * time_precision, sliced)
            )
            last_slice = current_slice
        if single_timestamp_ending:  # no speech after the last timestamp
            job.seek += segment_size
        else:  # ignore the unfinished segment and seek to the last timestamp
            last_timestamp_pos = tokens[last_slice - 1].item() - tokenizer.timestamp_begin
            job.seek += last_timestamp_pos * input_stride
    else:
        duration = segment_duration
        timestamps = tokens[timestamp_tokens.nonzero().flatten()]
        if len(timestamps) > 0 and timestamps[-1].item() != tokenizer.timestamp_begin:
            duration = (timestamps[-1].item() - tokenizer.timestamp_begin) * time_precision
        current.append(new_segment(time_offset, time_offset + duration, tokens))
        job.seek += segment_size
    return current, single_timestamp_ending


def _word_timestamps(model, job: Job, current: list[dict], single_timestamp_ending: bool, time_offset: float) -> None:
    """Words and their times in ``current``; ``seek`` moves to the last word's end when the window was cut."""
    add_word_timestamps(
        segments=current,
        model=model,
        tokenizer=job.tokenizer,
        mel=job.mel_segment,
        num_frames=job.segment_size,
        last_speech_timestamp=job.last_speech_timestamp,
    )
    if not single_timestamp_ending:
        last_word_end = get_end(current)
        if last_word_end is not None and last_word_end > time_offset:
            job.seek = round(last_word_end * FRAMES_PER_SECOND)
    last_word_end = get_end(current)
    if last_word_end is not None:
        job.last_speech_timestamp = last_word_end
