"""The start-up micro-benchmark of one loaded engine (``octo.runtime.selection`` compares the candidates).

Per candidate: warm up, then measure prefill tok/s, single-stream decode tok/s and batched decode
tok/s (4 sequences), and try each thread count the engine offers, within ``--bench-seconds`` (warm-up
and measurement; the load time is reported apart). The budget is a ceiling: a decode phase ends as soon as its
rate is known to 1.5% (standard error of the mean step time). It is not a reason to measure nothing: whatever
the budget, every candidate does a floor of work (a warm-up that runs each timed shape once, then at least 64
prefill tokens, 8 timed decode steps per thread count and 8 timed steps of the 4-sequence batch); when that takes
longer than the budget the progress line says the budget is too small. The score favours serving throughput
(a weighted geometric mean, so no metric's units dominate):

    score = batch_decode_tok_s ** 0.5 * decode_tok_s ** 0.3 * prefill_tok_s ** 0.2

A model that takes images (``ModelInfo.takes_images``: a vision-language model) is measured on an image too, after
the warm-up (``_image_phase``): one synthetic picture and a short question, from the encode to the first token
(``image_prefill_s``, with ``image_encode_s`` and ``image_tokens``), and the score gives images per second 0.15 of the
weight (the text metrics the rest, in the same proportions). An engine that fails the image gets a near-zero image
factor: it could not serve the model's images. The image phase's time is added to the measurement's limits (a
picture's encode on a CPU can take longer than the whole text budget).

A measurement during which other processes competed for the cores (``octo.benchload.LoadMonitor``) measures the
floor only from the moment that shows (after its prefill phase), and is repeated once if they calm down within
``QUIET_WAIT_S``; the result says so in ``conditions``. With the leader's score, a
candidate stops as soon as it cannot win even with perfect batching (``upper_bound``). A speech engine is measured
on speech work instead (``speech_benchmark``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from octo.benchload import LoadMonitor, loadavg_1min, wait_quiet
from octo.engine import Engine, Feed, MediaInput, SamplingParams, Sequence, Task

log = logging.getLogger("octo.runtime.benchmark")
WEIGHTS = {"batch_decode_tok_s": 0.5, "decode_tok_s": 0.3, "prefill_tok_s": 0.2}
IMAGE_WEIGHT = 0.15  # a vision model's images per second (1 / image_prefill_s)
IMAGE_SIZE = (320, 240)  # the synthetic picture: small (dynamic-resolution models give it ~100 tokens)
BATCH = 4
PROMPT_TOKENS = 64
SETTLE = 0.015  # a decode phase ends once its mean step time is known to 1.5% (standard error)
# The floor of work every candidate does, whatever the budget (after a warm-up that runs every timed shape once):
WARM_TOKENS = 16  # warm-up prompt, fed in the prefill chunk the measurement uses, then 2 decode steps
MIN_PREFILL_TOKENS = 64  # prefill: at least one whole 64-token prompt
MAX_PREFILL_TOKENS = 512  # ... and more prompts while within 20% of the budget, up to this many tokens
MIN_DECODE_STEPS = 8  # single-stream decode: at least 8 timed steps per thread count (after 1 untimed one)
MIN_BATCH_STEPS = 8  # batched decode: at least 8 timed steps of BATCH sequences (32 tokens; after 1 untimed)
FLOOR_GRACE = 10.0  # the floor gives up this long after the budget (a very slow engine measures what it can)
MAX_ATTEMPTS = 2  # a disturbed measurement is repeated once; one still disturbed is cached as provisional
# how long a disturbed measurement waits for the other processes to calm down before its repeat; a host still busy
# then gets no repeat (it would be disturbed as well): the result stands as provisional and is measured again once
# the model is idle (octo.runtime.remeasure), instead of taking another measurement's time from the start
QUIET_WAIT_S = 1.0
_TEXT = ("The quick brown fox jumps over the lazy dog while the busy engineers measure how fast each engine "
         "decodes tokens on this machine, one step at a time. ")


# -- the micro-benchmark -----------------------------------------------------------------------------
def score(result: dict[str, Any]) -> float:
    if result.get("error"):
        return 0.0
    values = dict(result)
    if not values.get("batch_decode_tok_s"):  # too slow to reach the batch phase: no batching gain assumed
        values["batch_decode_tok_s"] = values.get("decode_tok_s")
    weights = WEIGHTS
    if "image_prefill_s" in values:  # a vision model: images per second weigh too
        weights = {**{k: w * (1 - IMAGE_WEIGHT) for k, w in WEIGHTS.items()}, "images_per_s": IMAGE_WEIGHT}
        values["images_per_s"] = 1 / values["image_prefill_s"] if values["image_prefill_s"] else 0.0
    s = 1.0
    for name, w in weights.items():
        s *= max(float(values.get(name) or 0.0), 1e-9) ** w
    return round(s, 3)


def upper_bound(result: dict[str, Any]) -> float:
    """The best score ``result`` could still reach: batched decode at most BATCH times single-stream decode."""
    return score({**result, "batch_decode_tok_s": BATCH * float(result.get("decode_tok_s") or 0.0)})


def bench_prompt(engine: Engine, n: int, salt: int = 0) -> list[int]:
    toks = engine.tokenize(f"[{salt}] " + _TEXT * (1 + n // 16), special=False)
    n_ctx = engine.info.n_ctx if engine.info else n + 64
    return toks[: max(1, min(n, n_ctx // 4))]


def decode_steps(engine: Engine, seqs: list[Sequence], deadline: float, max_steps: int,
                 enough: Callable[[float], bool] | None = None, settle: float = 0.0, min_steps: int = 0,
                 hard: float | None = None) -> tuple[int, float]:
    """Greedy decode steps for all ``seqs`` until the deadline; returns (tokens, seconds).

    At least ``min_steps`` steps whatever the deadline (a floor of work; ``hard`` still ends it). From
    ``max(3, min_steps)`` steps and 0.25 s on, it ends early when ``enough(tok_s)`` says so, or, with ``settle``,
    once the rate is known that well: the standard error of the mean step time below ``settle`` times the mean
    (after at least 8 steps), so a fast, steady engine does not spend its whole budget confirming a number.
    """
    tokens, t0, steps = 0, time.perf_counter(), 0
    n_ctx = engine.info.n_ctx if engine.info else 1 << 30
    times: list[float] = []
    while steps < max_steps and all(len(s.tokens) < n_ctx - 1 for s in seqs):
        now = time.perf_counter()
        if (now >= deadline and steps >= min_steps) or (hard is not None and now >= hard):
            break
        out = engine.step([Feed(s, s.tokens[-1:], True) for s in seqs])
        times.append(time.perf_counter() - now)
        for s, tok in zip(seqs, out, strict=True):
            tokens += take(s, tok)
        steps += 1
        dt = time.perf_counter() - t0
        if steps < max(3, min_steps) or dt < 0.25:
            continue
        if enough is not None and enough(tokens / dt):
            break
        if settle and steps >= 8 and statistics.stdev(times) / math.sqrt(steps) < settle * statistics.fmean(times):
            break
    return tokens, time.perf_counter() - t0


def take(seq: Sequence, out: int | list[int]) -> int:
    """Append a step's result to ``seq`` (a list: several tokens of one speculative step); how many tokens."""
    if isinstance(out, list):
        seq.tokens.extend(out)
        return len(out)
    seq.tokens.append(out)
    return 1


def start_sequences(engine: Engine, ids: list[int], prompts: list[list[int]]) -> list[Sequence]:
    """Add sequences and prefill them (window engines: all prompts in one step)."""
    seqs = [Sequence(i, list(p), SamplingParams(temperature=0.0)) for i, p in zip(ids, prompts, strict=True)]
    for s in seqs:
        engine.add_sequence(s)
    if engine.batching == "window":
        out = engine.step([Feed(s, s.tokens, True) for s in seqs])
    else:
        out = []
        for s in seqs:
            chunk = max(1, engine.prefill_chunk)
            while True:
                part = s.tokens[s.n_cached:s.n_cached + chunk]
                last = s.n_cached + len(part) >= len(s.tokens)
                res = engine.step([Feed(s, part, last)])
                if last:
                    out.append(res[0])
                    break
    for s, tok in zip(seqs, out, strict=True):
        take(s, tok)
    return seqs


def _prefill_until(engine: Engine, seq: Sequence, deadline: float) -> int:
    """Feed ``seq``'s prompt in small chunks until done or past ``deadline``; returns tokens fed."""
    chunk = len(seq.tokens) if engine.batching == "window" else max(1, min(engine.prefill_chunk, 16))
    fed, end = 0, len(seq.tokens)
    while seq.n_cached < end and time.perf_counter() < deadline:
        part = seq.tokens[seq.n_cached:min(end, seq.n_cached + chunk)]
        last = seq.n_cached + len(part) >= end
        out = engine.step([Feed(seq, part, last)])
        fed += len(part)
        if last:
            take(seq, out[0])
    return fed


def _feed_prompt(engine: Engine, seq: Sequence) -> None:
    """Prefill ``seq`` as the scheduler feeds a prompt with media: text in prefill chunks up to an item, the item whole
    (``Feed.media``, its embedding set), the rest; the last feed samples."""
    end, chunk = len(seq.tokens), max(1, engine.prefill_chunk)
    while seq.n_cached < end:
        at = seq.n_cached
        item = next((c for c in seq.media if c.pos <= at < c.end), None)
        n = item.end - at if item is not None else min(chunk, min((c.pos for c in seq.media if c.pos > at),
                                                                  default=end) - at)
        out = engine.step([Feed(seq, seq.tokens[at:at + n], at + n >= end, media=item)])
        if at + n >= end:
            take(seq, out[0])


def bench_image() -> MediaInput:
    """The synthetic picture of the image phase: a colour gradient with a few shapes (fixed, so its digest is too)."""
    import hashlib
    import io

    from PIL import Image, ImageDraw

    w, h = IMAGE_SIZE
    img = Image.merge("RGB", [Image.linear_gradient("L").resize((w, h)).rotate(a, expand=False) for a in (0, 90, 45)])
    draw = ImageDraw.Draw(img)
    draw.ellipse((w // 8, h // 8, w // 2, h // 2), fill=(240, 240, 240))
    draw.rectangle((w // 2, h // 2, w - w // 8, h - h // 8), fill=(20, 60, 200))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return MediaInput("image", hashlib.sha256(buf.getvalue()).hexdigest(), img.tobytes(), w, h)


def _image_phase(engine: Engine, result: dict[str, Any]) -> None:
    """One image prompt (:func:`bench_image` and a short question, in the model's chat template) from the engine's
    tokenization to its first token: ``image_prefill_s``, of which ``image_encode_s``, and ``image_tokens``. A
    failure is recorded (``image_error``), not raised: the text phases still measure."""
    mark = "<<octo-bench-image>>"
    seq = None
    t0 = time.perf_counter()
    try:
        before, after = engine.render_chat([{"role": "user", "content": f"{mark}What is in this picture?"}]).split(
            mark, 1)
        tokens, chunks = engine.tokenize_media([before, bench_image(), after])
        seq = Sequence(900_300, tokens, SamplingParams(temperature=0.0), media=tuple(chunks))
        engine.add_sequence(seq)
        t_enc = time.perf_counter()
        for c in chunks:
            c.embedding = engine.encode_media(c)
        encode_s = time.perf_counter() - t_enc
        _feed_prompt(engine, seq)
        result.update(image_prefill_s=round(time.perf_counter() - t0, 3), image_encode_s=round(encode_s, 3),
                      image_tokens=sum(c.n_tokens for c in chunks))
    except Exception as exc:  # noqa: BLE001 - an engine that cannot take the picture: recorded, scored as such
        log.warning("image benchmark of %s failed: %s", engine.name, exc)
        result["image_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if seq is not None:
            free_sequences(engine, [seq])


def micro_benchmark(engine: Engine, seconds: float = 3.0, beat: float | None = None,
                    quiet_wait: float = QUIET_WAIT_S) -> dict[str, Any]:
    """Measure a loaded engine within ``seconds``, doing at least the floor of work; never raises.

    One measurement (``_measure``) under a ``LoadMonitor``. When other processes competed for the cores
    meanwhile (``disturbed``), it waits for them to calm down (``quiet_wait`` seconds; 0: the selection already saw
    the host stay busy, so no wait and no repeat) and, if they did, measures again
    (at most ``MAX_ATTEMPTS`` in all, within 2 x the budget + 12 s, below the worker's hang limit); the result is
    the best undisturbed attempt, else the best one, flagged ``conditions.disturbed`` (``select`` does not cache
    it). ``conditions`` also records the budget, the load figures, the attempts, the work done and whether the
    budget was too small for the floor.
    """
    if Task.TRANSCRIPTION in engine.tasks:
        return speech_benchmark(engine, seconds)  # a speech engine: measured on speech work
    t0 = time.perf_counter()
    limit = t0 + 2 * seconds + FLOOR_GRACE + 2
    load1 = loadavg_1min()
    attempts: list[dict[str, Any]] = []
    for i in range(MAX_ATTEMPTS):
        if i and (quiet_wait <= 0 or time.perf_counter() + quiet_wait + attempts[-1]["seconds"] > limit
                  or not wait_quiet(quiet_wait)):
            break  # no time left for a repeat, or a host that stays busy: the disturbed result stands
        mon = LoadMonitor().start()
        r = _measure(engine, seconds, beat, min(time.perf_counter() + seconds + FLOOR_GRACE, limit),
                     mon.disturbed_so_far)
        r["conditions"] = {**mon.stop(), **r["conditions"]}
        attempts.append(r)
        if r["error"] or not r["conditions"]["disturbed"]:
            break
    best = next((r for r in attempts if r["error"]), None) or max(
        attempts, key=lambda r: (not r["conditions"]["disturbed"], r["score"]))
    if best is not attempts[-1] and best["threads"] is not None:
        try:
            engine.set_threads(best["threads"])  # the last attempt left its own choice set
        except Exception:  # noqa: BLE001
            log.debug("set_threads(%s) failed", best["threads"], exc_info=True)
    best["conditions"].update(
        budget_s=seconds, loadavg=load1, attempts=[{"score": r["score"], **{k: r["conditions"][k] for k in (
            "disturbed", "foreign_load", "run_wait", "steal")}} for r in attempts])
    best["seconds"] = round(time.perf_counter() - t0, 3)
    return best


def _measure(engine: Engine, seconds: float, beat: float | None, hard: float,
             disturbed: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """One measurement. Phases: warm-up (a 16-token prompt in the measured prefill chunks, 2 decode steps), a vision
    model's image prompt (outside the budget: the phases after it get the whole budget), prefill of 64-token prompts
    (at least one; more while within 20% of the budget), single-stream decode for each thread count (to 55% of the
    budget; at least MIN_DECODE_STEPS each, after an untimed step), then BATCH sequences decoding together until the
    budget ends (at least MIN_BATCH_STEPS, after an untimed step). The floor runs whatever the budget, until ``hard``
    (later by the image prompt's time).

    With ``beat`` (the leader's score), the engine stops once it cannot reach it: a thread count's decode
    phase ends when its upper bound is below ``beat``, and the batch phase is skipped when the best one is.

    When the measurement is ``disturbed`` after its prefill phase (other processes took the cores), the rest measures
    the floor only (``conditions.cut_short``): a disturbed result decides provisionally and is measured again, so
    the rest of the budget would only delay the start.
    """
    t_start = time.perf_counter()
    work = {"prefill_tokens": 0, "decode_tokens": 0, "batch_tokens": 0}
    result: dict[str, Any] = {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None,
                              "threads": None, "score": 0.0, "cached": False, "seconds": None, "error": None,
                              "stopped": None, "conditions": {"work": work}}
    live: list[Sequence] = []
    t_text, deadline, image_s = t_start, t_start + seconds, 0.0  # (set again after a vision model's image prompt)
    try:
        warm = Sequence(900_001, bench_prompt(engine, WARM_TOKENS, 1), SamplingParams(temperature=0.0))
        engine.add_sequence(warm)
        live.append(warm)
        _prefill_until(engine, warm, hard)
        decode_steps(engine, [warm], hard, 2)
        if engine.info is not None and engine.info.takes_images:  # a vision model: an image, in its own time
            t_image = time.perf_counter()
            result["image_prefill_s"] = None
            _image_phase(engine, result)
            image_s = time.perf_counter() - t_image
            hard, t_text, deadline = hard + image_s, t_text + image_s, deadline + image_s
        result["prefill_tok_s"] = _prefill_phase(engine, t_text + 0.2 * seconds, hard, work)
        if disturbed():
            deadline = time.perf_counter()
            result["conditions"]["cut_short"] = True
        result["threads"], rate = _decode_phase(engine, warm, result, beat, min(deadline, t_text + 0.55 * seconds),
                                                hard, work)
        result["decode_tok_s"] = round(rate, 2) if rate else None
        free_sequences(engine, live)
        if beat is not None and upper_bound(result) < beat:
            result["stopped"] = (f"cannot win: at most {upper_bound(result):.2f} with perfect batching, "
                                 f"below the leader's {beat:.2f}")
        else:
            result["batch_decode_tok_s"] = _batch_decode(engine, live, deadline, hard, work)
    except Exception as exc:  # noqa: BLE001 - a failing candidate is recorded, never raised
        log.warning("benchmark of %s failed: %s", engine.name, exc)
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        free_sequences(engine, live)
    result["score"] = score(result)
    result["seconds"] = round(time.perf_counter() - t_start, 3)
    result["conditions"]["budget_too_small"] = time.perf_counter() - t_start - image_s > 1.25 * seconds + 0.05
    return result


def _prefill_phase(engine: Engine, until: float, hard: float, work: dict[str, int]) -> float | None:
    """Prefill tok/s of 64-token prompts: at least MIN_PREFILL_TOKENS, more while before ``until`` (up to
    MAX_PREFILL_TOKENS), never past ``hard``."""
    fed, spent, k = 0, 0.0, 0
    while fed < MIN_PREFILL_TOKENS or (time.perf_counter() < until and fed < MAX_PREFILL_TOKENS):
        if time.perf_counter() >= hard:
            break
        prompt = Sequence(900_200 + k, bench_prompt(engine, PROMPT_TOKENS, 2 + k), SamplingParams(temperature=0.0))
        engine.add_sequence(prompt)
        t0 = time.perf_counter()
        n = _prefill_until(engine, prompt, hard)
        spent += time.perf_counter() - t0
        free_sequences(engine, [prompt])
        if not n:
            break
        fed, k = fed + n, k + 1
    work["prefill_tokens"] = fed
    return round(fed / spent, 2) if fed else None


def _decode_phase(engine: Engine, warm: Sequence, result: dict[str, Any], beat: float | None, phase_end: float,
                  hard: float, work: dict[str, int]) -> tuple[int | None, float]:
    """Single-stream decode of ``warm`` for each thread count the engine offers, until ``phase_end`` (at least
    MIN_DECODE_STEPS each, after an untimed step; a count stops once ``result`` with its rate cannot reach
    ``beat``): the best (thread count, tok/s), that count set."""
    threads = engine.thread_counts()
    best = None

    def hopeless(tok_s: float) -> bool:
        return beat is not None and upper_bound({**result, "decode_tok_s": tok_s}) < beat

    for k, n in enumerate(threads or [None]):
        if n is not None:
            engine.set_threads(n)
        decode_steps(engine, [warm], hard, 1)  # a new thread count's first step may be slow: untimed
        now = time.perf_counter()
        toks, dt = decode_steps(engine, [warm], now + (phase_end - now) / (len(threads or [1]) - k), 256,
                                hopeless, SETTLE, MIN_DECODE_STEPS, hard)
        work["decode_tokens"] += toks
        rate = toks / dt if toks and dt > 0 else 0.0
        if best is None or rate > best[1]:
            best = (n, rate)
    if best[0] is not None:
        engine.set_threads(best[0])
    return best


def _batch_decode(engine: Engine, live: list[Sequence], deadline: float, hard: float,
                  work: dict[str, int]) -> float | None:
    """BATCH sequences with 4-token prompts decoding together until ``deadline`` (at least MIN_BATCH_STEPS timed
    steps, after an untimed one): aggregate tok/s."""
    batch = [Sequence(900_010 + i, bench_prompt(engine, 4, 10 + i), SamplingParams(temperature=0.0))
             for i in range(BATCH)]
    for s in batch:
        engine.add_sequence(s)
        live.append(s)
    if engine.batching == "window":
        out = engine.step([Feed(s, s.tokens, True) for s in batch])
        for s, tok in zip(batch, out, strict=True):
            take(s, tok)
    else:
        for s in batch:
            _prefill_until(engine, s, hard)
    if not all(s.n_cached == len(s.tokens) - 1 for s in batch):
        return None
    decode_steps(engine, batch, hard, 1)
    toks, dt = decode_steps(engine, batch, deadline, 256, settle=SETTLE, min_steps=MIN_BATCH_STEPS, hard=hard)
    work["batch_tokens"] = toks
    return round(toks / dt, 2) if toks and dt > 0 else None


def free_sequences(engine: Engine, seqs: list[Sequence]) -> None:
    for s in seqs:
        try:
            engine.remove_sequence(s)
        except Exception:  # noqa: BLE001
            pass
    seqs.clear()


# -- speech engines ----------------------------------------------------------------------------------
SPEECH_CLIP_S = 6.0


def speech_clip(seconds: float = SPEECH_CLIP_S) -> Any:
    """A fixed synthetic clip (voiced tones with a syllable rhythm and a little noise), 16 kHz float32."""
    import numpy as np

    t = np.arange(int(seconds * 16000)) / 16000.0
    voice = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((140.0, 280.0, 420.0, 700.0, 1100.0), 1))
    rhythm = 0.5 * (1 + np.sin(2 * np.pi * 3.0 * t))
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (0.1 * voice * rhythm + 0.01 * noise).astype(np.float32)


def speech_benchmark(engine: Engine, seconds: float = 3.0) -> dict[str, Any]:
    """Measure a speech engine: transcriptions of :func:`speech_clip` through its own ``transcribe`` (OpenAI's
    decoding rules, as requests get), after an untimed one, until ``seconds`` are spent (at least one timed
    run), for each of its ``thread_counts`` in turn (the budget split between them; the fastest is set). Score:
    seconds of audio transcribed per second (x real time). Never raises; a run still going at twice the budget
    is cancelled at its next window and counts as done then (its score is an upper bound). Measured under a
    ``LoadMonitor``, as text engines are: one that other processes disturbed is ``conditions.disturbed``, so the
    selection uses it provisionally and it is measured again while the model is idle."""
    mon = LoadMonitor().start()
    t_start = time.perf_counter()
    hard = t_start + 2 * seconds + FLOOR_GRACE
    clip = speech_clip()
    result: dict[str, Any] = {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None,
                              "threads": None, "score": 0.0, "cached": False, "seconds": None, "error": None,
                              "stopped": None, "speech_x_realtime": None,
                              "conditions": {"work": {"clips": 0, "clip_s": SPEECH_CLIP_S}, "budget_s": seconds,
                                             "disturbed": False}}
    try:
        counts: list[int | None] = list(engine.thread_counts()) or [None]
        rates: dict[int | None, float] = {}
        for k, n in enumerate(counts):
            if n is not None:
                engine.set_threads(n)
            until = t_start + seconds * (k + 1) / len(counts)
            rates[n], runs = _speech_runs(engine, clip, until, hard)
            result["conditions"]["work"]["clips"] += runs
        best = max(rates, key=rates.__getitem__)
        if best is not None and best != counts[-1]:
            engine.set_threads(best)
        if time.perf_counter() > hard:
            result["stopped"] = f"cancelled at {2 * seconds + FLOOR_GRACE:g} s (an upper bound)"
        result.update(threads=best, speech_x_realtime=round(rates[best], 3), score=round(rates[best], 3))
        if len(rates) > 1:
            result["conditions"]["threads_x_realtime"] = {str(n): round(r, 3) for n, r in rates.items()}
    except Exception as exc:  # noqa: BLE001 - a failing candidate is recorded, never raised
        log.warning("speech benchmark of %s failed: %s", engine.name, exc)
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = round(time.perf_counter() - t_start, 3)
    result["conditions"].update({**mon.stop(), "loadavg": loadavg_1min()})
    return result


def _speech_runs(engine: Engine, clip: Any, until: float, hard: float) -> tuple[float, int]:
    """(seconds of ``clip`` transcribed per second, timed runs): an untimed second of it, then whole runs until
    ``until`` (at least one; a run past ``hard`` is cancelled at its next window)."""
    from octo.engine import TranscriptionRequest

    def late() -> bool:
        return time.perf_counter() > hard

    engine.transcribe(TranscriptionRequest(audio=clip[:16000], language="en", cancelled=late))
    runs, spent = 0, 0.0
    while runs == 0 or (time.perf_counter() < until and not late()):
        t0 = time.perf_counter()
        engine.transcribe(TranscriptionRequest(audio=clip, language="en", cancelled=late))
        spent += time.perf_counter() - t0
        runs += 1
    return runs * len(clip) / 16000 / spent, runs
