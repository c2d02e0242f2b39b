"""One loaded model as the HTTP layer sees it: :class:`ModelHandle` runs it in this process (``--isolation
thread``, and inside every worker process and cluster replica). It implements ``octo.runtime.handle.Handle``, the
surface the
routes use, as do ``octo.runtime.remote.RemoteHandle`` (a worker process) and ``octo.cluster.deploy.ClusterHandle``
(Ray Serve
replicas), so the route handlers never know where a model lives. Its streams carry ``octo.scheduler.events``."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from octo.config import ServerConfig
from octo.engine import Embeddings, Engine, EngineConfig, ModelInfo, Task, Transcription
from octo.errors import ConfigError, EngineError, InvalidRequest, ModelFailed, OctoError
from octo.logsafe import quoted
from octo.runtime.handle import HandleInfo
from octo.scheduler.admission import Scheduler
from octo.scheduler.jobs import Ticket
from octo.scheduler.posting import safe_free, set_exception, set_result
from octo.scheduler.prefix_cache import PrefixCache
from octo.serving.media import MediaLimits

log = logging.getLogger("octo.runtime.model")
_OFFLOAD_BYTES = 64 * 1024  # prepare bigger requests in a worker thread so the loop never stalls
PREP_STUCK_S = 5.0  # in the gateway: the engine's tokenizer or template stuck this long (or the queue time-out)


@dataclass
class ModelHandle(HandleInfo):
    name: str
    aliases: tuple[str, ...]
    engine_name: str
    engine: Engine
    artifact: str
    scheduler: Scheduler | None = None
    cache: PrefixCache | None = None
    selection: dict[str, Any] = field(default_factory=dict)  # how the engine was chosen (/v1/engines)
    benchmarks: dict[str, Any] = field(default_factory=dict)  # engine name -> benchmark result
    engine_thread: Any = None  # the executor that loaded the engine: the scheduler steps on the same thread
    tool_format: str | None = None  # --tool-format (None: detected from the chat template)
    reasoning_format: str = "parsed"  # --reasoning-format
    media_limits: Any = None  # octo.serving.media.MediaLimits (--max-image-mb, --max-images, --max-image-pixels)
    # In the gateway by --isolation thread (an engine that does not declare itself safe there), the engine's tokenizer
    # and chat template run off the event loop, timed: one that hangs would stop every route of the server (a worker
    # process has its own loop and a watch on it instead)
    guard_loop: bool = False
    prep_limit: float = PREP_STUCK_S
    vocab: DeferredVocab | None = None  # the constrained-decoding vocabulary, built in a lull after the start
    _prep_stuck: int = 0  # calls past prep_limit still running: the model refuses requests until they return
    isolation = "thread"

    @property
    def state(self) -> str:
        """"ready", or what the watchdog found: "wedged" (a step that does not return, or a tokenizer or template
        call), "failed" (a dead loop)."""
        if self._prep_stuck:
            return "wedged"
        dog = self.scheduler.watchdog if self.scheduler is not None else None
        return "ready" if dog is None or dog.state == "ok" else ("wedged" if dog.state == "wedged" else "failed")

    @property
    def reason(self) -> str | None:
        if self._prep_stuck:
            return self._prep_reason()
        return self.scheduler.watchdog.reason if self.scheduler is not None else None

    def _prep_reason(self) -> str:
        return (f"the {self.engine_name} engine's tokenizer or chat template has been stuck for over "
                f"{self.prep_limit:g} s")

    def _prep_failed(self) -> ModelFailed:
        return ModelFailed(f"The model cannot serve requests now: {self._prep_reason()}.", headers={"Retry-After": "5"})

    async def _engine_work(self, fn: Any, *args: Any, big: bool = False) -> Any:
        """``fn(*args)`` (serving work that calls the engine's tokenizer or template): inline when small, else on a
        thread; in the gateway (``guard_loop``) always on a thread (``_PrepThreads``) and timed, and one past
        ``prep_limit`` is a 503 and marks the model wedged until it returns."""
        loop = asyncio.get_running_loop()
        if not self.guard_loop:
            return await loop.run_in_executor(None, fn, *args) if big else fn(*args)
        fut = _PREP.run(loop, fn, *args)
        done, _ = await asyncio.wait({fut}, timeout=self.prep_limit)
        if done:
            return fut.result()
        self._prep_stuck += 1
        log.error("model %s: %s", quoted(self.name, bare=True), self._prep_reason())

        def unstuck(_: Any) -> None:
            self._prep_stuck -= 1
            if not self._prep_stuck:
                log.warning("model %s: its tokenizer or chat template returned; serving again",
                            quoted(self.name, bare=True))

        fut.add_done_callback(unstuck)
        raise self._prep_failed()

    @property
    def info(self):
        return self.engine.info

    @property
    def engine_cls(self) -> type[Engine]:
        return type(self.engine)

    # -- life cycle --------------------------------------------------------------------------------------
    def start(self, config: ServerConfig, scheduler_cls: type[Scheduler] = Scheduler, **kw: Any) -> None:
        cache = None
        if not config.no_cache and config.cache_size_mb > 0 and self.engine.tasks & {Task.CHAT, Task.COMPLETION}:
            cache = PrefixCache(int(config.cache_size_mb * 2**20), safe_free(self.engine))
        self.cache = cache
        self.tool_format = config.tool_format
        self.reasoning_format = config.reasoning_format
        self.media_limits = MediaLimits(int(config.max_image_mb * 2**20), config.max_images, config.max_image_pixels)
        self.prep_limit = max(PREP_STUCK_S, config.queue_timeout)
        disk = self._disk_cache(config) if cache is not None and config.prefix_cache_dir else None
        self.scheduler = scheduler_cls(self.engine, max_batch=config.max_batch, max_queue=config.max_queue,
                                       queue_timeout=config.queue_timeout, cache=cache, preempt=config.preempt,
                                       step_stretch=config.step_stretch, dedup=config.prefix_dedup, disk=disk,
                                       default_max_tokens=config.default_max_tokens, **kw)
        self.scheduler.start(engine_thread=self.engine_thread)
        if self.engine.supports_masks and self.engine.tasks & {Task.CHAT, Task.COMPLETION}:
            self.vocab = DeferredVocab(self.engine, self.scheduler)

    def _disk_cache(self, config: ServerConfig) -> Any:
        """The disk tier of the prefix cache for this model, or None (with a log line) when its engine cannot export
        its KV."""
        from octo.engine import Engine
        from octo.runtime.selection import artifact_digest
        from octo.scheduler.disk_cache import DiskPrefixCache, cache_key

        eng = type(self.engine)
        if eng.kv_export is Engine.kv_export or eng.kv_import is Engine.kv_import:
            log.warning("--prefix-cache-dir: the %s engine cannot save its KV to disk; model '%s' keeps an in-memory "
                        "prefix cache only", self.engine_name, quoted(self.name, bare=True))
            return None
        key = cache_key(self.engine_name, eng.version(), artifact_digest(self.artifact),
                        {k: str(v) for k, v in self.engine.config.options.items()})
        try:
            return DiskPrefixCache(config.prefix_cache_dir, key, int(config.prefix_cache_disk_mb * 2**20))
        except Exception as exc:  # noqa: BLE001 - a cache folder that cannot be used costs the disk tier, not the model
            log.warning("--prefix-cache-dir %s cannot be used (%s: %s); model '%s' keeps an in-memory prefix cache "
                        "only", quoted(config.prefix_cache_dir), type(exc).__name__, exc, quoted(self.name, bare=True))
            return None

    async def activate(self, config: ServerConfig) -> None:
        if self.scheduler is None:
            self.start(config)

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            if getattr(self.scheduler, "disk", None) is not None:
                self.scheduler.disk.close()  # the writes queued so far complete
        if self.vocab is not None:
            self.vocab.cancel()  # (waits for a chunk of token reads under way, not for a whole build)
        try:
            self.engine.unload()
        except Exception:  # noqa: BLE001
            log.exception("engine unload failed")

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    # -- requests ----------------------------------------------------------------------------------------
    async def ensure_ready(self) -> None:
        if self._prep_stuck:
            raise self._prep_failed()
        if self.scheduler is not None:
            self.scheduler.watchdog.check_open()  # wedged or dead: 503 at once

    async def submit(self, kind: str, req: Any, size: int = 0) -> tuple[list[Ticket], asyncio.Queue | None]:
        big = size > _OFFLOAD_BYTES
        if self.guard_loop or big:
            gens, n = await self._engine_work(prepare, self, kind, req, big=big)
        else:  # (what _engine_work does with it, without a coroutine: every request comes here)
            gens, n = prepare(self, kind, req)
        events = asyncio.Queue() if req.stream else None
        return self.scheduler.submit_all(gens, n, events), events

    async def wait_admitted(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            await self.scheduler.wait_admitted(t)

    def abandon(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            if t.state in ("pending", "active"):
                self.scheduler.abandon(t)

    async def call(self, op: str, payload: Any) -> Any:
        return await run_call(self, op, payload)

    async def prompt_texts(self, req: Any) -> list[str]:
        return await self._engine_work(engine_call, serving_api().prompt_texts, self, req)

    async def count_tokens(self, kind: str, req: Any) -> int:
        """The prompt tokens of a request of ``kind`` ("messages"), rendered as a real one (off the event loop)."""
        return await self._engine_work(engine_call, serving_api().count_tokens, self, kind, req, big=True)

    async def tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> dict[str, Any]:
        """POST /tokenize's answer (octo.serving.tokens); a long text is tokenized off the event loop."""
        from octo.serving import tokens as api_tokens

        work = functools.partial(engine_call, api_tokens.tokenize, self, text, add_special, parse_special, with_pieces)
        return await self._engine_work(work, big=len(text) > _OFFLOAD_BYTES)

    async def detokenize(self, tokens: list[int]) -> str:
        """POST /detokenize's text (octo.serving.tokens): 400 naming ``tokens`` for an id outside the
        vocabulary."""
        from octo.serving import tokens as api_tokens

        work = functools.partial(engine_call, api_tokens.detokenize, self, tokens)
        return await self._engine_work(work, big=len(tokens) > _OFFLOAD_BYTES // 4)

    async def stats(self) -> dict[str, Any]:
        return local_stats(self)


class _PrepThreads:
    """Daemon threads for the gateway's prompt preparation (``ModelHandle.guard_loop``): kept between requests (a
    thread per request would cost its start on every request), never joined at exit (one stuck in an engine call must
    not keep the process alive, as a pool's thread would), and a busy or stuck one never makes a request wait: a new
    thread starts whenever none is idle. At most ``MAX_IDLE`` wait for work."""

    MAX_IDLE = 4

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> asyncio.Future:
        """``fn(*args)`` on one of the threads; its outcome as a future of ``loop``."""
        fut = loop.create_future()
        with self._lock:
            start = self._idle == 0
            self._idle -= not start  # an idle thread takes it
        self._jobs.put((loop, fut, fn, args))
        if start:
            threading.Thread(target=self._serve, name="octo-prep", daemon=True).start()
        return fut

    def _serve(self) -> None:
        while True:
            loop, fut, fn, args = self._jobs.get()
            try:
                out = (set_result, fut, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                out = (set_exception, fut, exc)
            try:
                loop.call_soon_threadsafe(*out)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass
            with self._lock:
                if self._idle >= self.MAX_IDLE:
                    return
                self._idle += 1


_PREP = _PrepThreads()


_serving: Any = None  # octo.serving.openai once imported (serving_api)


def serving_api() -> Any:
    """``octo.serving.openai`` (the request models: pydantic), imported on first use rather than with this module: a
    worker imports it while its model loads (``octo.runtime.worker.import_serving``), not before the load starts."""
    global _serving
    if _serving is None:
        import octo.serving.openai as module

        _serving = module
    return _serving


# -- the model-side work both kinds of handle share (a worker runs these on its own ModelHandle) ------------
def engine_call(fn: Any, handle: Any, *args: Any) -> Any:
    """``fn(handle, *args)`` (serving work that calls the engine's ``render_chat``, ``tokenize``, ``token_bytes``),
    where an engine method that raises or answers nonsense is a 500 ``engine_error``, not the request's fault."""
    try:
        return fn(handle, *args)
    except OctoError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise engine_failed(handle, fn, exc) from None


def engine_failed(handle: Any, fn: Any, exc: Exception) -> EngineError:
    log.exception("the %s engine failed in %s", handle.engine_name, getattr(fn, "__name__", fn))
    return EngineError(f"The {handle.engine_name} engine failed: {type(exc).__name__}: {exc}")


def prepare(handle: Any, kind: str, req: Any) -> tuple[list[Any], int]:
    """``serving.prepare`` as :func:`engine_call` runs it, with the prompt tokens the engine made checked (inline:
    this runs for every request)."""
    serving = _serving or serving_api()
    try:
        gens, n = serving.prepare(handle, kind, req)
        for g in gens:
            g.prompt_tokens = check_prompt(handle, g.prompt_tokens, g.media)
    except OctoError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise engine_failed(handle, serving.prepare, exc) from None
    return gens, n


def check_prompt(handle: Any, tokens: Any, media: tuple = ()) -> list[int]:
    """The engine's tokenization of a prompt as a list of token ids; EngineError for anything else (a native engine
    would crash on a negative id or one past its vocabulary). Two C-speed passes: this runs for every request. The
    positions of ``media`` (images: octo.engine.MediaChunk) hold placeholders, negative ids; only the text is checked
    against the vocabulary."""
    tokens = tokens if isinstance(tokens, list) else list(tokens)
    text = tokens
    if media:
        text, at = [], 0
        for m in media:
            if not 0 <= at <= m.pos <= m.end <= len(tokens) or max(tokens[m.pos:m.end], default=-2) >= -1:
                raise EngineError(f"The engine's tokenizer placed a {m.kind} at positions {m.pos}..{m.end - 1} of a "
                                  f"{len(tokens)}-token prompt, or not as placeholders.")
            text += tokens[at:m.pos]
            at = m.end
        text += tokens[at:]
    if text:
        low, high = min(text), max(text)  # (TypeError for what is not numbers)
        n_vocab = handle.info.n_vocab
        if low < 0 or (n_vocab and high >= n_vocab):
            raise EngineError(f"The engine's tokenizer produced token id {low if low < 0 else high}, which is outside "
                              "its vocabulary.")
    return tokens


async def run_call(handle: ModelHandle, op: str, payload: Any) -> Any:
    if op == "embed":
        texts = embed_texts(handle, payload)
        vectors, n_tokens = [], 0
        for chunk in _embed_chunks(texts):  # each chunk queues anew: other models' steps interleave
            out = await handle.scheduler.call(lambda engine, chunk=chunk: _embedded(engine, chunk))
            vectors += out.vectors
            n_tokens += out.n_tokens
        return Embeddings(vectors, n_tokens)
    if op == "transcribe":
        scheduler, engine = handle.scheduler, handle.engine
        if hasattr(engine, "transcribe_batch"):  # batched with other queued requests
            out = await scheduler.call_batch("transcribe", payload,
                                             lambda eng, reqs, done: eng.transcribe_batch(reqs, done))
        else:
            out = await scheduler.call(lambda eng: eng.transcribe(payload))
        if not isinstance(out, Transcription):
            raise EngineError(f"The {handle.engine_name} engine's transcription returned {type(out).__name__}.")
        return out
    if op == "tokenizer_info":
        from octo.serving import tokens as api_tokens

        return api_tokens.tokenizer_info(handle)
    raise ValueError(f"unknown call {op!r}")


def _embedded(engine: Engine, texts: list[str]) -> Embeddings:
    """``engine.embed(texts)``, checked (on the engine thread): one finite vector per text, all of one size."""
    import numpy as np
    out = engine.embed(texts)
    if not isinstance(out, Embeddings) or len(out.vectors) != len(texts):
        got = f"{len(out.vectors)} vectors" if isinstance(out, Embeddings) else type(out).__name__
        raise EngineError(f"The {engine.name} engine's embed returned {got} for {len(texts)} inputs.")
    dim = (engine.info.embedding_dim if engine.info else 0) or len(out.vectors[0])
    for v in out.vectors:
        if len(v) != dim:
            raise EngineError(f"The {engine.name} engine's embed returned a vector of {len(v)} dimensions, not {dim}.")
        if not np.isfinite(np.asarray(v, dtype=np.float64)).all():
            raise EngineError(f"The {engine.name} engine's embed returned a vector that is not finite (NaN or inf).")
    return out


EMBED_CHUNK_TEXTS = 32
EMBED_CHUNK_CHARS = 32_768


def _embed_chunks(texts: list[str]):
    """Split a long embeddings request into engine calls of at most 32 texts or ~32k characters, so that the
    decode steps of generations queued behind it run between them instead of waiting for all of it."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and (len(chunk) >= EMBED_CHUNK_TEXTS or size + len(text) > EMBED_CHUNK_CHARS):
            yield chunk
            chunk, size = [], 0
        chunk.append(text)
        size += len(text)
    if chunk:
        yield chunk


def embed_texts(handle: ModelHandle, inp: Any) -> list[str]:
    """The texts of an embeddings ``input``: a string, strings, token ids or lists of token ids."""
    serving = serving_api()
    if isinstance(inp, str):
        texts = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        texts = [serving.detokenize_ids(handle, inp)]
    elif inp and all(isinstance(x, list) for x in inp):
        texts = [serving.detokenize_ids(handle, x) for x in inp]
    else:
        texts = list(inp)
    if not texts or any(t == "" for t in texts):
        raise InvalidRequest("input must be a non-empty string or a non-empty list of non-empty strings.",
                             param="input")
    return texts


def local_stats(handle: ModelHandle) -> dict[str, Any]:
    """Queue and prefix-cache numbers of an in-process model (``cache`` None when it has none)."""
    sched = handle.scheduler
    cache = handle.cache.stats() if handle.cache is not None else None
    disk = getattr(sched, "disk", None)
    if cache is not None and disk is not None:
        cache["disk"] = {**disk.stats(), "tokens_reused": sched.disk_tokens_reused}
    return {"queue": sched.stats() if sched is not None else None, "cache": cache}


VOCAB_AFTER_FIRST_S = 0.5  # the engine idle this long after a request finished: the vocabulary is built then ...
VOCAB_UNUSED_S = 5.0  # ... or this long idle when no request came yet
VOCAB_LATEST_S = 30.0  # ... or this long after the start, busy or not


class DeferredVocab:
    """Builds the engine's constrained-decoding vocabulary (``octo.text.constrain.vocab_for``: 0.5-1 s of
    GIL-holding Python for a 150k-token vocabulary) in a thread of its own, in the first lull after the model serves:
    once the engine has been idle for ``VOCAB_AFTER_FIRST_S`` after its first request (``VOCAB_UNUSED_S`` if none
    came; ``VOCAB_LATEST_S`` at the latest), so that it never competes with the first requests (at a start it
    doubled the first token's time on 2 cores). A constrained request before then builds it itself (``vocab_for``
    has a lock: one build, the other waits for it). :meth:`cancel` (the model unloads) stops the wait, or a build
    while it still reads the engine's tokens (it waits for that to stop: the engine is freed next)."""

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine, self.scheduler = engine, scheduler
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="octo-vocab", daemon=True).start()

    def _lull(self) -> None:
        """(its thread) Return once the vocabulary may be built, or when cancelled."""
        start = idle_since = time.monotonic()
        while not self._cancelled.wait(0.1):
            now = time.monotonic()
            if self.scheduler.has_work():
                idle_since = now
            quiet = VOCAB_AFTER_FIRST_S if self.scheduler.total_processed else VOCAB_UNUSED_S
            if now - idle_since >= quiet or now - start >= VOCAB_LATEST_S:
                return

    def _run(self) -> None:
        from octo.text.constrain import vocab_built, vocab_for

        self._lull()
        if self._cancelled.is_set():
            return
        if vocab_built(self.engine):
            log.debug("constrained-decoding vocabulary: a request built it before the first lull")
            return
        t0 = time.perf_counter()
        try:
            tokens = self._tokens()
            if tokens is not None:
                vocab_for(self.engine, tokens.__getitem__)
        except Exception:  # noqa: BLE001 - the first constrained request builds it again and reports the error
            log.exception("building the constrained-decoding vocabulary failed")
            return
        if tokens is not None:
            log.debug("constrained-decoding vocabulary built in a lull after the start (%.2f s)",
                      time.perf_counter() - t0)

    def _tokens(self, chunk: int = 4096) -> list[bytes] | None:
        """Every token's bytes, read from the engine a chunk at a time under the lock :meth:`cancel` takes, and its
        special tokens (the engine keeps them: ``vocab_for`` then reads nothing more from it); None: cancelled."""
        tokens: list[bytes] = []
        engine = self.engine
        n, token_bytes = engine.info.n_vocab, engine.token_bytes
        for start in range(0, n, chunk):
            with self._lock:
                if self._cancelled.is_set():
                    return None
                tokens += [token_bytes(i) for i in range(start, min(n, start + chunk))]
        with self._lock:
            if self._cancelled.is_set():
                return None
            if callable(getattr(engine, "special_tokens", None)):
                engine.special_tokens()
        return tokens

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:  # a chunk of token reads under way ends before the engine is freed
            pass


def make_engine(cls: type[Engine], config: ServerConfig, own_process: bool = False) -> Engine:
    return cls(EngineConfig(max_batch=config.max_batch, options=dict(config.options), own_process=own_process))


def load_engine(cls: type[Engine], config: ServerConfig, artifact: str, name: str,
                own_process: bool = False) -> Engine:
    """Construct and load an engine; any failure is a ConfigError naming the engine and artifact. ``own_process``:
    this is an engine worker, which serves this one engine (``EngineConfig.own_process``)."""
    engine = make_engine(cls, config, own_process)
    try:
        engine.load(artifact, name)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"Engine '{cls.name}' could not load '{artifact}': {type(exc).__name__}: {exc}") from exc
    info = engine.info
    if not isinstance(info, ModelInfo) or not isinstance(info.n_ctx, int) or info.n_ctx <= 0 \
            or not isinstance(info.n_vocab, int) or info.n_vocab < 0:
        raise ConfigError(f"Engine '{cls.name}' returned no usable model info for '{artifact}' (a ModelInfo with "
                          f"n_ctx > 0 and n_vocab >= 0): {info!r}.")
    return engine
