"""The engine contract: what an engine plugin implements, and the data types it sees.

Engines import this module (plus ``octo.errors`` and ``octo.hookspecs.hookimpl``) and nothing else
from octo. The shared scheduler (``octo.scheduler.admission``) owns queueing, batching, stopping, streaming and
the prefix-cache index; an engine only supplies the model-specific steps below. Every method except
``detect``/``version`` is called from the model's single engine thread, never from the event loop,
so an engine needs no locking of its own.

A text generation step works on :class:`Feed` items: "append these tokens to this sequence's KV
and, if ``sample``, sample the next token from the logits at the last position". Prompt prefill is a
series of feeds (chunked by the scheduler), decoding feeds the last sampled token. One ``step`` call
receives every active sequence's feed, so a backend that can batch (llama.cpp) runs one forward pass.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


class Task(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDINGS = "embeddings"
    TRANSCRIPTION = "transcription"


TEXT_TASKS = frozenset({Task.CHAT, Task.COMPLETION})


@dataclass(frozen=True)
class Detection:
    """Whether an engine can run on this host; ``reason`` says why not, or which device it uses."""

    available: bool
    reason: str = ""


@dataclass
class EngineConfig:
    """Runtime settings handed to an engine at construction.

    ``options`` holds the user's ``-o KEY=VALUE`` pairs (strings); an engine must reject keys it does
    not know with :class:`octo.errors.ConfigError` rather than ignore them.
    """

    max_batch: int = 8
    options: dict[str, str] = field(default_factory=dict)
    # True when the engine runs in an engine worker process of its own (``--isolation process``, the default for native
    # engines): no other engine is loaded in this process, so process-wide choices (which optional libraries to
    # import) are the engine's to make. False in the gateway's own process, which other engines share.
    own_process: bool = False


@dataclass
class ModelInfo:
    """What the scheduler and serving layer need to know about a loaded model."""

    name: str
    n_ctx: int
    eos_token_ids: frozenset[int] = frozenset()
    n_vocab: int = 0
    embedding_dim: int = 0
    tasks: frozenset[Task] | None = None  # what this model can do, when less than the engine's tasks
    extra: dict[str, Any] = field(default_factory=dict)  # shown in /v1/engines (threads, quant, ...)
    # the media kinds this loaded model takes in a prompt ("image"; "audio" later): those of ``Engine.media_kinds``
    # its files have an encoder for (llama.cpp: the projector loaded beside the GGUF); empty: text only
    media: frozenset[str] = frozenset()

    @property
    def takes_images(self) -> bool:
        return "image" in self.media


@dataclass
class SamplingParams:
    """Sampling settings of one sequence. Defaults mean "off", so ``changed()`` lists what a request set."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # the LoRA adapter this sequence runs with, picked by model name ``base:adapter`` among the names an engine that
    # serves LoRA loaded (its ``adapters`` attribute, a container of names, from its ``lora`` option); None: the base
    # model. KV computed with one adapter never serves another (prefix cache and in-flight sharing key by it)
    adapter: str | None = None

    def changed(self) -> set[str]:
        """Names of the fields that differ from their defaults."""
        d = self.__dict__
        return {name for name, default in _SAMPLING_DEFAULTS if d[name] != default}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, n_vocab: int) -> None:
        """Range checks engines that sample in Python apply before a sequence starts (400 naming the field)."""
        from octo.errors import InvalidRequest

        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise InvalidRequest("temperature must be >= 0.", param="temperature")
        if not 0 <= self.top_p <= 1:
            raise InvalidRequest("top_p must be between 0 and 1.", param="top_p")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p must be between 0 and 1.", param="min_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be >= 0.", param="top_k")
        if not self.repetition_penalty > 0:
            raise InvalidRequest("repetition_penalty must be > 0.", param="repetition_penalty")
        for tok in self.logit_bias:
            if not 0 <= int(tok) < n_vocab:
                raise InvalidRequest(f"logit_bias token {tok} is outside the vocabulary (0..{n_vocab - 1}).",
                                     param="logit_bias")


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the common prefix of two token lists, at most ``limit`` (bisecting on slice compares, which run at C
    speed). Shared by the scheduler (in-flight prefix deduplication) and engines that count shared KV cells."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_SAMPLING_DEFAULTS = tuple((f.name, getattr(SamplingParams(), f.name)) for f in fields(SamplingParams))


# -- media in a prompt (images; audio later) -----------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class MediaInput:
    """One media item of a request, as the serving layer hands it to ``Engine.tokenize_media``: decoded and checked.

    ``digest`` is the SHA-256 (hex) of the bytes the client sent: the prefix cache keys the item's positions by it.
    An image's ``data`` is its pixels, RGB, row by row (``width * height * 3`` bytes)."""

    kind: str  # "image"
    digest: str
    data: bytes
    width: int = 0
    height: int = 0


@dataclass(eq=False)
class MediaChunk:
    """Positions ``pos`` .. ``end - 1`` of a prompt that hold one media item's embeddings instead of token embeddings.

    Their token ids are placeholders (:func:`media_token_ids`: negative, derived from the item's digest), so the prefix
    cache, in-flight sharing and KV accounting treat an image as the tokens it takes, and two prompts with the same
    image share its positions' KV as they share text. ``data`` is the engine's prepared input (``tokenize_media``),
    ``embedding`` the encoder's output (``encode_media``, run by the scheduler before the positions are fed)."""

    kind: str
    digest: str
    pos: int
    n_tokens: int
    data: Any = None
    embedding: Any = None

    @property
    def end(self) -> int:
        return self.pos + self.n_tokens


def media_token_ids(digest: str, n_tokens: int) -> list[int]:
    """The placeholder token ids of a media item's ``n_tokens`` positions: 32 bits of SHAKE-256 of its digest per
    position, as negative int32 values below -1 (no real token id; int32, as the disk prefix cache stores tokens). Two
    different items share a position's id with a chance of 2**-31 and all of them never in practice."""
    raw = hashlib.shake_256(b"octo-media\0" + digest.encode()).digest(4 * n_tokens)
    return [-2 - (int.from_bytes(raw[4 * i:4 * i + 4], "little") % (2**31 - 2)) for i in range(n_tokens)]


@dataclass(eq=False)
class Sequence:
    """One generation stream as the engine sees it.

    ``tokens`` is the prompt followed by every sampled token; the first ``n_cached`` of them are in the
    engine's KV for this sequence. ``slot`` is the engine's own per-sequence state (a llama.cpp
    sequence id, a sampler chain, ...): set it in ``add_sequence``, drop it in ``remove_sequence``. ``media``: the
    prompt's media items, in position order (their positions' ``tokens`` are placeholders).
    """

    id: int
    tokens: list[int]
    sampling: SamplingParams
    n_cached: int = 0
    slot: Any = None
    media: tuple[MediaChunk, ...] = ()


@dataclass(eq=False, slots=True)
class Feed:
    """Append ``tokens`` to ``seq``'s KV; when ``sample`` is true, sample the next token afterwards.

    Constrained decoding and logprobs (engines that declare ``supports_masks`` / ``supports_logprobs``):

    * ``mask`` (sampling feeds only): the allowed next tokens as an int32 bitmask of ``ceil(n_vocab / 32)`` words, bit
      ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (``octo.logits.apply_bitmask``); the engine
      samples only an allowed token. None: no constraint.
    * ``logprobs`` >= 0 (sampling feeds only): the engine sets ``logprob`` to ``(logprob of the sampled token,
      [(token, logprob), ...] the top `logprobs` tokens, most likely first)``. A logprob is the log-softmax, in at
      least float32, of the logits after the sampler's logit bias and penalties, before temperature, top-k/p and the
      mask (``octo.logits.top_logprobs``).
    * ``no_eos`` (sampling feeds of engines that declare ``supports_min_tokens`` but not ``supports_masks``): the
      sequence may not end here (``min_tokens``): the engine must not sample an end-of-sequence token. For engines
      with masks the scheduler clears the end-of-sequence bits of ``mask`` instead.
    * ``prompt_logprobs`` >= 0: the engine sets ``prompt_out`` to one ``(logprob, top)`` pair per fed position whose
      next token is already in ``seq.tokens`` (the logprob of that next token; for a prompt, what OpenAI's
      completions ``echo`` + ``logprobs`` reports), from the raw logits (no penalties).
    * ``media`` (engines whose model takes media): the feed's positions are those of this chunk of ``seq.media``,
      from ``seq.n_cached`` to the chunk's end (the scheduler never mixes text into it and feeds the rest of a chunk
      whole, once ``media.embedding`` is set): the engine appends rows ``seq.n_cached - media.pos`` on of the
      embedding. ``tokens`` holds the placeholders.
    """

    seq: Sequence
    tokens: list[int]
    sample: bool
    mask: Any = None
    logprobs: int = -1
    prompt_logprobs: int = -1
    no_eos: bool = False
    logprob: Any = None
    prompt_out: Any = None
    media: MediaChunk | None = None


@dataclass(eq=False)
class KVHandle:
    """Engine-owned saved KV state for the token prefix ``tokens`` (for the prefix-cache index)."""

    tokens: tuple[int, ...]
    nbytes: int
    data: Any = None
    cells: int = 0  # cells of the engine's shared KV pool this handle keeps in use (0: it lives in host memory)


@dataclass
class Embeddings:
    vectors: list[list[float]]
    n_tokens: int


@dataclass
class TranscriptionRequest:
    audio: Any  # float32 mono 16 kHz samples (numpy array)
    task: str = "transcribe"  # or "translate"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    # polled by the engine between units of work (Whisper: a 30 s window, a fallback temperature): True once the
    # client is gone; the engine may then stop this request and return anything (the scheduler discards it)
    cancelled: Any = field(default=None, repr=False, compare=False)


@dataclass
class Segment:
    start: float
    end: float
    text: str
    words: list[dict] | None = None


@dataclass
class VerboseSegment(Segment):
    """A segment with the per-segment details of OpenAI's ``verbose_json``, for speech engines that have them."""

    id: int = 0
    seek: int = 0
    tokens: list[int] | None = None
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


def fallback_temperatures(temperature: float, increment: float) -> tuple[float, ...]:
    """OpenAI's transcription fallback schedule (``whisper.transcribe``): ``temperature``, then up by ``increment``
    to 1.0 (an increment of 0: no fallback). Every speech engine decodes with it, so they do the same work."""
    if not increment:
        return (temperature,)
    out, t = [], temperature
    while t <= 1.0 + 1e-6:
        out.append(round(t, 6))
        t += increment
    return tuple(out) or (temperature,)


def ffmpeg_note() -> str:
    """What a speech engine's ``detect`` reason says about uploads: the gateway decodes them with ffmpeg, and without
    ffmpeg on PATH reads WAV files only (``octo.server.wav``); the engines themselves take samples, never files."""
    import shutil

    return "" if shutil.which("ffmpeg") else "; no ffmpeg on PATH: the server decodes WAV uploads only"


@dataclass
class Transcription:
    text: str
    language: str
    duration: float
    segments: list[Segment] = field(default_factory=list)


class Engine:
    """Base class of every engine. Subclasses set the class attributes and override what they support."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    tasks: ClassVar[frozenset[Task]] = frozenset()
    formats: ClassVar[frozenset[str]] = frozenset()  # "gguf", "mlx", "onnx", "whisper", ...
    # "continuous": sequences join a running batch between steps; "window": the backend cannot add a
    # sequence to a running batch, so the scheduler starts a new batch only when the current one is done.
    batching: ClassVar[str] = "continuous"
    # Whether kv_share makes sequences share KV cells (no new cells for the shared part: admission counts only the
    # rest of a prompt that shares a running sequence's prefix); False: kv_share copies.
    kv_shares_cells: bool = False
    # SamplingParams fields this engine honours; a request that sets any other one is refused (400).
    sampling_params: ClassVar[frozenset[str]] = frozenset({"temperature"})
    # Constrained decoding (response_format, tool_choice): the engine applies ``Feed.mask`` before sampling, and
    # its vocabulary is fixed at load (``token_bytes`` of 0..n_vocab-1), so the shared layer can compile grammars.
    supports_masks: ClassVar[bool] = False
    # ``Feed.logprobs`` (chat/completions logprobs) and ``Feed.prompt_logprobs`` (completions echo + logprobs).
    supports_logprobs: ClassVar[bool] = False
    supports_prompt_logprobs: ClassVar[bool] = False
    # ``min_tokens``: honoured through ``Feed.mask`` by engines with masks, else through ``Feed.no_eos``.
    supports_min_tokens: ClassVar[bool] = False
    # Greatest prompt chunk the scheduler feeds in one step (prefill chunking).
    prefill_chunk: ClassVar[int] = 512
    # Media kinds ("image"; "audio" later) the engine takes in a prompt when the model it loads has an encoder for
    # them: ``tokenize_media``, ``encode_media`` and ``Feed.media``. What a loaded model takes is ``ModelInfo.media``.
    media_kinds: ClassVar[frozenset[str]] = frozenset()
    # Where a loaded model runs by default: "process" (its own worker process, so a native crash costs only its
    # requests) or "thread" (inside the gateway). Engines with native code keep "process"; --isolation overrides.
    isolation: ClassVar[str] = "process"
    # Whether ``kv_rollback`` can undo what a ``step`` that raised did to its sequences. True: one sequence that makes
    # steps raise costs its own request only (the scheduler retries the others in smaller groups); False: a step that
    # raises fails every sequence it fed.
    supports_rollback: ClassVar[bool] = False
    # Safer configurations for crashes the engine knows, tried in order when a worker dies of a signal during
    # load, warm-up or its first steps: (options overlay, what crashed), e.g. ({"repack": "false"}, "the weight
    # repack crashed on this host"). An overlay is skipped when the user set one of its options explicitly.
    fallbacks: ClassVar[tuple[tuple[dict[str, str], str], ...]] = ()
    # The ``-o`` option names this engine takes (None: not declared). When several engines are candidates for a model,
    # each gets only the options it declares (``-o n_threads=2`` is llama.cpp's: ONNX Runtime and MLX run without it);
    # an engine that declares none gets them all and must refuse those it does not know. Only the class's own
    # declaration counts: a subclass that takes options of its own declares them too (an inherited set is ignored).
    option_names: ClassVar[frozenset[str] | None] = None

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.info: ModelInfo | None = None

    # -- discovery -------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        """Can this engine run here? Must not raise, and should not import its backend: it runs in the gateway
        (``importlib.util.find_spec`` says whether it is installed; ``load`` reports a library that does not load)."""
        return Detection(True)

    @classmethod
    def version(cls) -> str:
        return "0"

    @classmethod
    def prepare(cls) -> None:
        """Optional: import the backend (its library, slow pure-Python parts) ahead of ``load``. A pre-spawned
        worker calls it while it waits for its model; the start-up selection calls it in a background thread while
        another candidate loads (native loads release the GIL), and waits for it before any measurement. Must not
        choose anything ``load``'s options decide, and must not raise."""

    @classmethod
    def prepare_own_process(cls) -> None:
        """Optional: ``prepare`` in an engine worker started for this engine alone (the gateway gives that worker to no
        other engine), where process-wide choices are this engine's to make, as in a ``load`` with
        ``EngineConfig.own_process``. The default is ``prepare``."""
        cls.prepare()

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        """The format of a local artifact if this engine can load it, else None."""
        return None

    # -- life cycle ------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        raise NotImplementedError

    def unload(self) -> None:
        self.info = None

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of ``text``; ``special`` parses special-token text (rendered chat templates do)."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token stands for (special tokens: b"")."""
        raise NotImplementedError

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The model's chat template applied to OpenAI-style ``messages`` (content as plain text; assistant
        messages may carry ``tool_calls`` with arguments as objects, ``tool`` messages a ``tool_call_id``), with
        ``tools`` (OpenAI function tools) in the template's ``tools`` variable when given, as Hugging Face's
        ``apply_chat_template`` passes them."""
        raise NotImplementedError

    def chat_template(self) -> str | None:
        """The Jinja source of the model's chat template (the tool-call format is detected from it), or None."""
        return None

    def special_tokens(self) -> dict[str, int]:
        """Control tokens by their text (``{"<tool_call>": 151657}``), for grammars that must emit one; optional."""
        return {}

    # -- media (models whose ModelInfo.media is not empty) ------------------------------------------------------------
    def tokenize_media(self, parts: list[str | MediaInput]) -> tuple[list[int], list[MediaChunk]]:
        """The prompt tokens of a rendered chat prompt cut at its media items (``parts``: text as ``tokenize(text,
        special=True)`` reads it, and the items in their places), with a chunk per item: the tokens hold an item's
        :func:`media_token_ids` at its positions, and whatever the model wraps around an item (Gemma 3's
        ``<start_of_image>``) as text tokens. Called where requests are prepared, on any thread (as ``tokenize``); a
        bad item raises :class:`octo.errors.InvalidRequest`."""
        raise NotImplementedError

    def encode_media(self, chunk: MediaChunk) -> Any:
        """Run the model's encoder (a vision tower and its projector) on a chunk from ``tokenize_media``: its
        embedding, one row per position, which the engine reads when a ``Feed.media`` brings the chunk. The scheduler
        calls it on a thread of its own, one chunk at a time, while ``step`` runs on the engine thread (so an image's
        encode never stalls the other sequences' decoding): it must not touch the serving context or the sequences."""
        raise NotImplementedError

    def add_sequence(self, seq: Sequence) -> None:
        """Give ``seq`` a slot (KV sequence, sampler) before its first feed."""

    def step(self, feeds: list[Feed]) -> list[int | list[int] | BaseException | None]:
        """Run one forward pass over ``feeds``; return the sampled token per feed (None if not sampled).

        The engine advances ``feed.seq.n_cached`` by ``len(feed.tokens)``. An engine that verifies several tokens in
        one pass (speculative decoding) may return a list of tokens for a sampling feed: they are taken in order as
        if sampled one step each (stop, length and constraint rules apply to each; the rest is dropped when the
        sequence ends), and ``n_cached`` is then advanced past every token of the list but the last.

        A failure that belongs to one sequence (its sampler, its grammar) is returned as an exception instance in that
        feed's place: that request fails alone and the others go on. An exception raised from ``step`` fails every
        sequence of the step, except :class:`octo.errors.KVCacheFull` ("the shared pool had no room; nothing was
        consumed"), after which the scheduler preempts a sequence and runs the step again, and except in engines that
        declare ``supports_rollback``: the scheduler undoes the step (``kv_rollback``) and runs its sequences again in
        smaller groups until the one that raises is alone (``octo.scheduler.step_isolation``); only that one fails.
        """
        raise NotImplementedError

    def remove_sequence(self, seq: Sequence) -> None:
        """Free ``seq``'s slot and KV (finished, cancelled or failed)."""

    def kv_rollback(self, seq: Sequence, n_tokens: int) -> None:
        """Undo what a ``step`` that raised did to ``seq`` (engines that declare ``supports_rollback``): keep the
        first ``n_tokens`` positions of its KV (what it held before that step), drop the rest, set ``n_cached`` to
        ``n_tokens``, and put back per-sequence state the step advanced (a sampler's count) so that running the feed
        again gives what it would have given. When the KV cannot be kept, drop it all and set ``n_cached`` to 0 (the
        scheduler then fails the sequence, as without rollback)."""
        raise NotImplementedError

    def kv_stats(self) -> dict[str, Any] | None:
        """Live numbers about the engine's KV (its layout, ...) for ``/v1/queue/stats``, or None. Called from another
        thread than the engine's: read plain attributes only."""
        return None

    def idle_work(self, interrupted: Callable[[], bool]) -> float | None:
        """Work the engine does while no request runs, on its own thread: measurements that choose between good
        configurations (llama.cpp's KV layout probes), never needed to serve. The engine loop calls it when idle; it
        calls ``interrupted()`` between its engine calls and, once that says True (a request arrived), returns soon,
        leaving the engine as it serves. Returns None when nothing is left to do, else the seconds of idleness to
        wait before the next call (work interrupted or postponed)."""
        return None

    # -- KV pressure (engines whose sequences share one bounded KV pool) ---------------------------------
    def kv_room(self) -> int | None:
        """Free cells in a KV pool shared by every sequence (one cell per token of one sequence), or None when
        every sequence owns room for ``n_ctx`` tokens (nothing to preempt for). The scheduler admits, feeds and
        preempts so that a step never needs more than this."""
        return None

    def kv_drop(self, seq: Sequence) -> None:
        """Preemption: give back every KV cell of ``seq`` but keep its slot (sampler state, grammar), and set
        ``n_cached`` to 0. The scheduler later refills it with ``kv_restore`` or by feeding its tokens again.
        Required when ``kv_room`` can return a number."""
        raise NotImplementedError

    # -- prefix cache (optional: return None from kv_save to opt out) ---------------------------
    def kv_save(self, seq: Sequence) -> KVHandle | None:
        """Snapshot the KV of ``seq.tokens[:seq.n_cached]``; None when unsupported."""
        return None

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        """Load the first ``n_tokens`` of ``handle`` into ``seq``, which holds no KV (freshly added, or dropped by
        ``kv_drop``); set ``n_cached`` (left at 0 when it could not)."""
        raise NotImplementedError

    def kv_free(self, handle: KVHandle) -> None:
        """Release a handle the index evicted."""

    def kv_export(self, handle: KVHandle) -> bytes | None:
        """The bytes of a saved handle, for the disk prefix cache (``--prefix-cache-dir``); None: not supported. They
        are read back by ``kv_import`` of the same model, engine version and options only (the cache keys by them)."""
        return None

    def kv_import(self, tokens: tuple[int, ...], data: bytes) -> KVHandle | None:
        """A handle for ``tokens`` from ``kv_export``'s bytes, restorable by ``kv_restore`` (and freed by ``kv_free``);
        None when the bytes are not usable."""
        return None

    def kv_swap_out(self, seq: Sequence) -> KVHandle | None:
        """Preemption with ``--preempt swap``: a snapshot of ``seq``'s KV that holds no cells of a shared pool (the
        point is to give them back). Default: ``kv_save``, for engines whose snapshots live in host memory."""
        return self.kv_save(seq)

    def kv_share(self, src: Sequence, dst: Sequence, n_tokens: int) -> None:
        """Make ``dst`` (which holds no KV) start with the KV of ``src``'s first ``n_tokens`` tokens, equal in both;
        set ``dst.n_cached``. In-flight prefix deduplication: a prefix several requests share is computed once.
        Default: a snapshot of ``src`` restored into ``dst`` (a copy); engines whose sequences can share KV cells
        (llama.cpp's unified pool) share them instead."""
        handle = self.kv_save(src)
        if handle is None:
            return
        try:
            self.kv_restore(dst, handle, n_tokens)
        finally:
            self.kv_free(handle)

    # -- start-up benchmark (optional) -------------------------------------------------------------
    def thread_counts(self) -> list[int]:
        """Thread counts worth trying at start-up, current one first; [] when threads are not tunable."""
        return []

    # Whether ``set_threads`` may also run while the model serves: the registry shares the cores between busy models
    # with it. False where a switch reloads the model (faster-whisper: CTranslate2 fixes threads per model), so that
    # only the start-up benchmark switches.
    threads_switch_while_serving: ClassVar[bool] = True

    def set_threads(self, n: int) -> None:
        """Switch the number of compute threads without reloading (only called with thread_counts() values)."""

    # -- other tasks -----------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Embeddings:
        raise NotImplementedError

    def transcribe(self, request: TranscriptionRequest) -> Transcription:
        raise NotImplementedError
