"""The llama.cpp engine: continuous batching over llama-cpp-python's low-level API.

One ``llama_context`` holds every active sequence (``n_seq_max = max_batch``, one llama.cpp sequence id per
request; the KV layout, one unified pool or a stream per sequence, is timed while the model is idle unless set:
:mod:`.layout`; a pool runs bursts of short sequences in streams of the same memory: :mod:`.adapt`).
Each :meth:`LlamaCppEngine.step` packs all feeds (prefill chunks and decode tokens) into one ``llama_batch`` and
runs a single ``llama_decode``; each sequence then samples from its own logits row with its own native sampler
chain. Output constraints (``Feed.mask``) and logprobs work on that row
in place before the chain samples (:mod:`.logits`); feeds without them take the plain native path.

Shared prefixes (unified pool): a prefix-cache entry is the cells of a cache sequence id (``llama_memory_seq_cp``
adds an id to cells, no data is copied), a new sequence that matches it joins those cells, and so do sequences
that share a prefix being computed (the scheduler's in-flight deduplication, :meth:`kv_share`). A cell is free when
its last sequence leaves it; :mod:`.cells` keeps the count. Out of cache ids, or with per-sequence streams
(``kv_unified=false``), the cache keeps snapshots in RAM instead (``llama_state_seq_get/set_data``), as preemption's
swap always does (:mod:`.kvcache`).

KV-cache type (``-o cache_type=f16|q8_0|q4_0``): ``type_k``/``type_v`` of the context; a quantized cache turns flash
attention on (llama.cpp reads a quantized V only there). LoRA adapters (``-o lora``, what ``--lora`` passes): loaded
with the model; llama.cpp's adapter set is per context, so a step mixing adapters runs one decode per adapter
(:mod:`.lora`).

The engine holds the slots (sequence ids, sampler chains), the serving context and the decode loop; three parts it
holds own the rest, each with its own state, and reach the engine only through a small protocol of public names:

* ``cells`` (:class:`.kvcache.KVCells`): the KV cells of the context: the cell book, preemption, prefix sharing, the
  prefix cache and compaction;
* ``layout`` (:class:`.adapt.AdaptiveLayout`): how the KV layout was chosen, the probes that choose it while the model
  is idle (:mod:`.layout`, :mod:`.background`), the short-traffic policy and the switch between layouts;
* ``spec`` (:class:`.speculate.Speculation`, None without ``-o draft``): the draft model, drafting and verification.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from typing import TYPE_CHECKING, Any, ClassVar

from octo.engine import Detection, Embeddings, Engine, EngineConfig, Feed, KVHandle, ModelInfo, Sequence, Task
from octo.errors import ConfigError, ContextLengthExceeded, EngineError, InvalidRequest, KVCacheFull, Overloaded

from . import background, context, layout, loading, lora, native, vision
from . import logits as lg
from .adapt import AdaptiveLayout
from .embeddings import embed_texts
from .kvcache import KVCells, Slot
from .native import CACHE_TYPES, GGUF_MAGIC, Batch, LogTap, bindings, parse_options, physical_cores, read_metadata
from .native import version as lib_version
from .sampling import SamplerChain
from .speculate import Speculation
from .template import ChatTemplate
from .vision import Vision, position

if TYPE_CHECKING:
    from octo.engine import MediaChunk, MediaInput

log = logging.getLogger("octo.engines.llamacpp")

# A GGUF without a chat template gets ChatML, as llama-server does.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class LlamaCppEngine(Engine):
    name: ClassVar[str] = "llamacpp"
    aliases: ClassVar[tuple[str, ...]] = ("llama.cpp", "llama-cpp", "llama_cpp")
    tasks: ClassVar[frozenset[Task]] = frozenset({Task.CHAT, Task.COMPLETION, Task.EMBEDDINGS})
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    option_names: ClassVar[frozenset[str] | None] = frozenset(native.OPTIONS)
    batching: ClassVar[str] = "continuous"
    sampling_params: ClassVar[frozenset[str]] = frozenset({
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias",
    })
    # the mask and logprobs work on llama.cpp's logits rows (.logits); prompt logprobs ask logits of every position
    supports_masks: ClassVar[bool] = True
    supports_logprobs: ClassVar[bool] = True
    supports_prompt_logprobs: ClassVar[bool] = True
    prefill_chunk: ClassVar[int] = 512  # llama-server's n_ubatch: the CPU's cost per prompt token levels off there
    media_kinds: ClassVar[frozenset[str]] = frozenset({"image"})  # with a projector (mmproj) beside the GGUF: .vision
    supports_rollback: ClassVar[bool] = True  # kv_rollback: llama_memory_seq_rm of what a failed step wrote (.kvcache)
    fallbacks: ClassVar[tuple[tuple[dict[str, str], str], ...]] = (
        ({"repack": "false"}, "the AMX/CPU weight repack crashed on this host"),
    )

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        self.opts = parse_options(self.config.options)
        if self.config.max_batch < 1:
            raise ConfigError("max_batch must be >= 1", param="max_batch")
        self.prefill_chunk = self.opts.get("prefill_chunk", type(self).prefill_chunk)
        self.model = self.ctx = self.mem = self.vocab = None
        self.lib: Any = None  # the llama_cpp module (imported at load)
        self.adapters: lora.Adapters | None = None
        self.active: dict[int, Sequence] = {}  # running sequences by llama.cpp sequence id
        self.cells = KVCells(self)
        self.layout = AdaptiveLayout(self)
        self.spec: Speculation | None = None
        self.vision: Vision | None = None

    # -- discovery ---------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        # not imported here: detect() runs in the gateway, whose memory and start-up the library would cost (40 MB
        # with onnxruntime's); a library that is installed but does not load fails the load, in the worker
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None:
            return Detection(False, "llama-cpp-python is not installed; pip install 'octo[llamacpp]'")
        return Detection(True, f"llama-cpp-python {cls.version()} ({loading.backends(spec)})")

    @classmethod
    def prepare(cls) -> None:
        try:  # the native library (its bindings only) and numpy (the load's batch), ahead of the load
            bindings()
            import numpy  # noqa: F401
        except Exception:  # noqa: BLE001 - the load reports a library that does not load
            pass

    @classmethod
    def version(cls) -> str:
        return lib_version()

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return "gguf" if f.read(4) == GGUF_MAGIC else None
        except OSError:
            return None

    # -- life cycle --------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        L = bindings()
        self.lib = L
        self._load_model(artifact)
        eog_scan = loading.EogScan(L, self.vocab, self.n_vocab)  # meanwhile: the context is made without the GIL
        arch = self.metadata.get("general.architecture", "?")
        pooling = int(self.metadata.get(f"{arch}.pooling_type", "-1"))
        self.is_embedding = pooling > 0
        try:
            self._load_adapters()
            self._make_context(pooling)
            eog = eog_scan.ids()
        except BaseException:
            eog_scan.join()  # (it reads the vocabulary unload frees)
            self.unload()
            raise
        last_n = self.opts.get("penalty_last_n", 64)
        self.penalty_last_n = self.n_ctx_seq if last_n < 0 else last_n  # -1: the whole context, as llama-server
        self._pieces: dict[int, bytes] = {}
        self._special: dict[str, int] | None = None
        # one piece buffer per thread: llama_token_to_piece runs without the GIL, and the deferred vocabulary build
        # (its own thread) and request handling (tokenizer, detokenizer) may both miss the piece cache at once
        self._piece_bufs = threading.local()
        self._tok_buf = (L.llama_token * 4096)()
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = L.llama_vocab_bos(self.vocab)
        tmpl = L.llama_model_chat_template(self.model, None)
        self.template_source = "gguf" if tmpl else "chatml (default: no tokenizer.chat_template)"
        self.gguf_template = tmpl.decode() if tmpl else None
        self.template = ChatTemplate(
            self.gguf_template or CHATML, self._text(self.bos), self._text(L.llama_vocab_eos(self.vocab))
        )
        try:
            # the KV layout: the one given or cached, else the unified pool while the probes run when the model is
            # idle (.background)
            unified, verdicts = layout.decide(self, self.n_ctx_opt, self.cell_bytes)
            if unified != self.kv_unified or not self.ctx:
                self.flash_default = context.default_flash_attn(L, self.opts, unified)
                self._build_context(pooling, self.n_ctx_opt, unified)
            self.layout.start(verdicts)
            self.vision = vision.load(self) if not self.is_embedding else None
            if self.opts.get("draft"):
                self.spec = Speculation.load(L, self.opts, self.vocab, eog, max_batch=self.config.max_batch,
                                             n_ctx=self.n_ctx_seq, n_threads=self.n_threads, repack=self.repack,
                                             n_batch=self.n_batch)
        except BaseException:
            self.unload()
            raise
        self.info = ModelInfo(
            name=name,
            n_ctx=self.n_ctx_seq,
            eos_token_ids=eog,
            n_vocab=self.n_vocab,
            embedding_dim=L.llama_model_n_embd_out(self.model) if self.is_embedding else 0,
            tasks=frozenset({Task.EMBEDDINGS}) if self.is_embedding else frozenset({Task.CHAT, Task.COMPLETION}),
            extra={**loading.describe(self, arch, pooling), **(self.vision.describe() if self.vision else {})},
            media=frozenset({"image"}) if self.vision is not None else frozenset(),
        )
        return self.info

    def _load_adapters(self) -> None:
        if self.opts.get("lora"):
            if self.is_embedding:
                raise ConfigError("LoRA adapters apply to generative models; this GGUF is an embedding model.",
                                  param="lora")
            self.adapters = lora.Adapters(self.lib, self.model, self.opts["lora"])

    def _load_model(self, artifact: str) -> None:
        self.artifact_path, self.model, self.repack, self.repack_source = loading.load_model(self.lib, artifact,
                                                                                             self.opts)
        L = self.lib
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.metadata = read_metadata(L, self.model)

    def _make_context(self, pooling: int) -> None:
        L = self.lib
        n_ctx_train = L.llama_model_n_ctx_train(self.model)
        n_ctx = self.opts.get("n_ctx", n_ctx_train)
        self.n_threads = self.opts.get("n_threads", physical_cores())
        self.n_threads_batch = self.opts.get("n_threads_batch", self.n_threads)
        self.cache_type = self.opts.get("cache_type", "f16")
        head_dim = L.llama_model_n_embd(self.model) // max(1, L.llama_model_n_head(self.model))
        self.cell_bytes = round(L.llama_model_n_layer(self.model) * 2 * L.llama_model_n_head_kv(self.model) * head_dim
                                * CACHE_TYPES[self.cache_type])
        self.n_ctx_opt, self.pooling = n_ctx, pooling
        self.plain_kv = not (L.llama_model_n_swa(self.model) or L.llama_model_is_recurrent(self.model)
                             or L.llama_model_is_hybrid(self.model))  # one KV cache: .kvcache.restream applies
        self.free_ids = list(range(self.config.max_batch))  # add_sequence takes the lowest
        self.active = {}
        self.cells = KVCells(self)
        self.layout = AdaptiveLayout(self)
        unified = (layout.given(self) or (True, None))[0]  # measured after the load
        self.flash_default = context.default_flash_attn(L, self.opts, unified)  # the load's layout decides it
        self._build_context(pooling, n_ctx, unified)

    def _build_context(self, pooling: int, n_ctx: int, unified: bool, stream_cells: int | None = None) -> None:
        """The serving context with a KV layout (freeing one built before: the layout probe builds both); streams of
        ``stream_cells`` each (default ``n_ctx``: :mod:`.adapt` runs short traffic in smaller ones)."""
        L = self.lib
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = self.mem = None
        self.kv_unified = unified
        if self.adapters is not None:
            self.adapters.active = None  # a new context has no adapter set
        max_batch = self.config.max_batch
        p = context.plan(L, self.model, self.opts, is_embedding=self.is_embedding, pooling=pooling,
                         max_batch=max_batch, prefill_chunk=self.prefill_chunk, n_ctx=n_ctx, unified=unified,
                         stream_cells=stream_cells, n_threads=self.n_threads, n_threads_batch=self.n_threads_batch,
                         cache_type=self.cache_type, flash_default=self.flash_default)
        self.n_batch, self.stream_cells, self.n_cache_seqs, self.flash_attn = (p.n_batch, p.stream_cells, p.n_cache,
                                                                               p.flash_attn)
        LogTap.recent.clear()
        self.ctx = L.llama_init_from_model(self.model, p.params)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not create a context (n_ctx={n_ctx}, cache_type={self.cache_type}): "
                              f"{LogTap.tail()}")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_ctx_seq = min(n_ctx, L.llama_n_ctx_seq(self.ctx))
        self.batch = Batch(self.n_batch)
        self.cells.reset(p.n_cache, max_batch, self.opts.get("kv_compact", True))
        self.kv_cells = L.llama_n_ctx(self.ctx)
        self.kv_shares_cells = self.kv_unified

    def rebuild_context(self, unified: bool, stream_cells: int | None) -> None:
        """A new serving context in another layout (:meth:`.adapt.AdaptiveLayout.relayout`, which moves the running
        sequences' KV): the slots and the context a sequence may grow to stay as they were."""
        n_ctx_seq = self.n_ctx_seq
        self._build_context(self.pooling, self.n_ctx_opt, unified, stream_cells)
        self.n_ctx_seq = n_ctx_seq

    def thread_counts(self) -> list[int]:
        """Current threads first, then one fewer: on a busy 2-core host 1 thread can beat 2 (issue 3)."""
        if "n_threads" in self.opts or self.n_threads <= 1:
            return []  # the user chose, or nothing to try
        return [self.n_threads, self.n_threads - 1]

    def set_threads(self, n: int) -> None:
        self.n_threads = self.n_threads_batch = n
        self.lib.llama_set_n_threads(self.ctx, n, n)
        if self.spec is not None:
            self.spec.set_threads(self.lib, n)
        if self.info is not None:
            self.info.extra.update(threads=n, threads_batch=n)

    def unload(self) -> None:
        L = self.lib
        if self.spec is not None:
            self.spec.close()
            self.spec = None
        if self.vision is not None:
            self.vision.close()
            self.vision = None
        if L is not None:
            if self.ctx:
                L.llama_free(self.ctx)
            if self.model:
                L.llama_model_free(self.model)
        self.ctx = self.model = self.mem = self.vocab = None
        self.adapters = None  # llama.cpp frees a model's adapters with it
        super().unload()

    def idle_work(self, interrupted: Any) -> float | None:
        return background.run(self.layout, interrupted)

    def draft_stats(self) -> dict[str, Any] | None:
        """Draft tokens proposed and accepted so far (None without a draft model)."""
        return self.spec.stats() if self.spec is not None else None

    # -- text --------------------------------------------------------------------------------------
    def _text(self, token: int) -> str | None:
        if token < 0:
            return None
        raw = self.lib.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else None

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer (``llama_tokenize``) with the model's BOS/EOS rule; no doubled BOS when the
        text (e.g. a rendered chat template) already starts with it."""
        L = self.lib
        data = text.encode("utf-8")
        n = L.llama_tokenize(self.vocab, data, len(data), self._tok_buf, len(self._tok_buf), True, special)
        if n < 0:
            self._tok_buf = (L.llama_token * (-n + 16))()
            n = L.llama_tokenize(self.vocab, data, len(data), self._tok_buf, len(self._tok_buf), True, special)
        tokens = self._tok_buf[:n]
        if self.add_bos and len(tokens) > 1 and tokens[0] == self.bos and tokens[1] == self.bos:
            tokens = tokens[1:]
        return tokens

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = getattr(self._piece_bufs, "buf", None)
            if buf is None:
                buf = self._piece_bufs.buf = ctypes.create_string_buffer(256)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        extra = {} if tools is None else {"tools": tools}
        return self.template.render(messages, add_generation_prompt, **extra)

    def chat_template(self) -> str | None:
        return self.gguf_template

    def special_tokens(self) -> dict[str, int]:
        """Control and user-defined tokens by their text (llama.cpp's token attributes; the first id of a text)."""
        if self._special is None:
            self._special = loading.special_tokens(self.lib, self.vocab, self.n_vocab)
        return dict(self._special)

    # -- media (a projector beside the GGUF: .vision) ------------------------------------------------------------------
    def tokenize_media(self, parts: list[str | MediaInput]) -> tuple[list[int], list[MediaChunk]]:
        if self.vision is None:
            raise InvalidRequest(f"Model '{self.info.name}' takes no images (no projector loaded).", param="model")
        return self.vision.tokenize(parts)

    def encode_media(self, chunk: MediaChunk) -> Any:
        return self.vision.encode(chunk)

    # -- generation --------------------------------------------------------------------------------
    def _require_generative(self) -> None:
        if self.is_embedding:
            raise InvalidRequest(f"Model '{self.info.name}' is an embedding model; use /v1/embeddings.", param="model")

    def add_sequence(self, seq: Sequence) -> None:
        self._require_generative()
        if len(seq.tokens) >= self.n_ctx_seq:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.n_ctx_seq} tokens; the prompt has "
                f"{len(seq.tokens)} tokens.",
                param="messages",
            )
        if not self.free_ids:
            raise EngineError(f"All {self.config.max_batch} llama.cpp sequence slots are in use.")
        if self.layout.policy is not None:
            self.layout.before_add(seq)
        if self.kv_unified:  # the shared pool must hold this prompt next to the running sequences (the prefix it
            used = self.cells.book.used()  # may share with one of them or a cached entry in the pool takes no new cell)
            if used + len(seq.tokens) + 1 - self.cells.shareable(seq.tokens, seq.sampling.adapter) > self.kv_cells:
                raise Overloaded(
                    f"The KV cache is full ({used} of {self.kv_cells} cells in use by {len(self.active)} "
                    f"sequences); retry shortly.",
                    headers={"Retry-After": "2"},
                )
        if seq.sampling.adapter is not None:
            if self.adapters is None:
                raise InvalidRequest(f"Model '{self.info.name}' has no LoRA adapters (--lora NAME=PATH).",
                                     param="model")
            self.adapters.check(seq.sampling.adapter, self.info.name)
        chain = SamplerChain(self.n_vocab, seq.sampling, self.penalty_last_n, seq.tokens)
        seq_id = min(self.free_ids)  # the lowest: in streams, a step's sequences form few runs of consecutive ids
        self.free_ids.remove(seq_id)
        self.cells.join(seq_id)
        seq.slot = Slot(seq_id, chain)
        seq.n_cached = 0
        self.active[seq_id] = seq
        self.layout.added(len(self.active), len(seq.tokens))

    def step(self, feeds: list[Feed]) -> list[int | BaseException | None]:
        if not feeds:
            return []
        if self.vision is not None and any(f.media is not None for f in feeds):
            return self.vision.step(feeds)  # images: their embeddings go in batches of their own (.vision)
        if self.layout.policy is not None:
            self.layout.before_step(feeds, self.spec.n_draft if self.spec is not None else 0)
        cells = self.cells
        if cells.members_changed and cells.entries:  # decoding now: idle cached cells would be scanned every row
            cells.demote_after_change()
        if self.kv_unified and cells.compact:
            cells.compact_scattered()
        if self.adapters is None:
            return self._decode(feeds)
        parts = lora.groups(feeds)  # llama.cpp's adapter set is per context: one decode per adapter (.lora)
        if len(parts) == 1:
            self.adapters.apply(self.ctx, next(iter(parts)))
            return self._decode(feeds)
        out: list[int | BaseException | None] = [None] * len(feeds)
        done: list[Feed] = []
        for adapter, idx in parts.items():
            self.adapters.apply(self.ctx, adapter)
            group = [feeds[i] for i in idx]
            try:
                res = self._run(group, None)  # (not speculated: the rollback below counts one token per feed)
            except KVCacheFull:  # nothing of the step may stay consumed: take back what earlier groups added (their
                # tokens come again after the preemption; a penalties sampler keeps one extra accepted token)
                for f in done:
                    f.seq.n_cached -= len(f.tokens)
                    cells.seq_rm(f.seq.slot.seq_id, f.seq.n_cached)
                raise
            done += group
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out

    def _decode(self, feeds: list[Feed]) -> list[int | list[int] | BaseException | None]:
        spec = self.spec
        drafts = spec.drafts(feeds, self.batch.capacity, self.n_ctx_seq, self.kv_room) if spec is not None else None
        if drafts is not None:
            try:
                return self._run(feeds, drafts)
            except KVCacheFull:  # the drafts did not fit where the step alone may: try without them
                pass
        return self._run(feeds, None)

    def _run(self, feeds: list[Feed], drafts: list[list[int]] | None) -> list[int | list[int] | BaseException | None]:
        if not self.kv_unified and len(feeds) > 1:  # streams: llama.cpp puts in one micro-batch only sequences whose
            # ids rise by one in batch order (the graph views a range of streams); in any other order a step of 16
            # decode rows became several micro-batches, each reading all the weights (0.53x the tok/s)
            order = sorted(range(len(feeds)), key=lambda i: feeds[i].seq.slot.seq_id)
            if order != list(range(len(feeds))):
                res = self._run_batch([feeds[i] for i in order], None if drafts is None else [drafts[i] for i in order])
                out: list[int | list[int] | BaseException | None] = [None] * len(feeds)
                for j, i in enumerate(order):
                    out[i] = res[j]
                return out
        return self._run_batch(feeds, drafts)

    def _run_batch(self, feeds: list[Feed],
                   drafts: list[list[int]] | None) -> list[int | list[int] | BaseException | None]:
        b, L, ctx, cells = self.batch, self.lib, self.ctx, self.cells
        n = 0
        starts: list[int] = []  # each feed's first batch position
        for i, f in enumerate(feeds):
            k = len(f.tokens)
            d = drafts[i] if drafts is not None else ()
            if f.seq.n_cached + k > self.n_ctx_seq:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {self.n_ctx_seq} tokens; sequence {f.seq.id} "
                    f"would reach {f.seq.n_cached + k}.",
                    param="max_tokens",
                )
            if n + k + len(d) > b.capacity:
                raise EngineError(f"step of more than n_batch={b.capacity} tokens")
            b.token[n : n + k] = f.tokens
            p = f.seq.n_cached if not f.seq.media else position(f.seq, f.seq.n_cached)  # (M-RoPE images: .vision)
            b.pos[n : n + k + len(d)] = range(p, p + k + len(d))
            b.seq[n : n + k + len(d)] = f.seq.slot.seq_id
            b.logits[n : n + k] = f.prompt_logprobs >= 0  # prompt logprobs: logits of every position
            if f.sample and k:
                b.logits[n + k - 1] = 1
            if d:  # speculative decoding (.speculate): the draft's tokens, each with its logits row
                b.token[n + k : n + k + len(d)] = d
                b.logits[n + k : n + k + len(d)] = 1
            starts.append(n)
            n += k + len(d)
        b.struct.n_tokens = n
        rc = L.llama_decode(ctx, b.struct)
        if rc != 0:
            cells.decode_failed(rc, feeds)
        if self.kv_unified:
            cells.count_runs(feeds)
        result: list[int | list[int] | BaseException | None] = []
        append = cells.book.append
        for i, (f, start) in enumerate(zip(feeds, starts, strict=True)):
            seq, k = f.seq, len(f.tokens)
            if f.prompt_logprobs >= 0:  # before the mask touches the last row
                f.prompt_out = lg.prompt_entries(L, ctx, self.n_vocab, f, start, seq.n_cached)
            d = drafts[i] if drafts is not None else ()
            seq.n_cached += k + len(d)
            append(seq.slot.seq_id, k + len(d))
            if d:
                out = self.spec.verify(f, ctx, start + k - 1, d)
                if len(out) - 1 < len(d):  # the KV of rejected draft tokens goes
                    seq.n_cached -= len(d) - (len(out) - 1)
                    cells.seq_rm(seq.slot.seq_id, seq.n_cached)
                result.append(out)
            elif not (f.sample and k):
                result.append(None)
            elif f.mask is None and f.logprobs < 0:  # the plain path: the native chain alone
                result.append(seq.slot.chain.sample(ctx, start + k - 1))
            else:
                result.append(lg.sample(L, ctx, self.n_vocab, f, start + k - 1, self.penalty_last_n))
        return result

    def remove_sequence(self, seq: Sequence) -> None:
        slot: Slot | None = seq.slot
        if slot is None:
            return
        self.layout.removed(seq.n_cached, len(self.active) - (slot.seq_id in self.active))
        self.cells.leave(slot.seq_id)
        if slot.chain is not None:
            slot.chain.close()
        self.free_ids.append(slot.seq_id)
        self.active.pop(slot.seq_id, None)
        if self.spec is not None:
            self.spec.drop(slot.seq_id)
        seq.slot = None

    # -- KV (the cells part: .kvcache) -------------------------------------------------------------
    def kv_stats(self) -> dict[str, Any] | None:
        if self.is_embedding or not self.ctx:
            return None
        return {"layout": "unified" if self.kv_unified else "streams", "cells": self.kv_cells, **self.layout.stats(),
                "compaction_passes": self.cells.compactions, "entries_moved_to_ram": self.cells.demoted}

    def kv_room(self) -> int | None:
        if not self.kv_unified:  # separate streams: every sequence owns n_ctx cells
            return None
        return self.kv_cells - self.cells.book.used()

    def kv_drop(self, seq: Sequence) -> None:
        self.cells.drop(seq)

    def kv_swap_out(self, seq: Sequence) -> KVHandle | None:
        return self.cells.snapshot(seq)

    def kv_share(self, src: Sequence, dst: Sequence, n_tokens: int) -> None:
        n = min(n_tokens, src.n_cached, len(dst.tokens) - 1)
        if not self.kv_unified:  # across streams llama.cpp would copy whole buffers: a snapshot copies less
            super().kv_share(src, dst, n)
            return
        if n > 0:
            self.cells.share(src, dst, n)
            self.layout.reused(n)

    def kv_save(self, seq: Sequence) -> KVHandle | None:
        return self.cells.save(seq)

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        """Give ``seq`` the first ``n_tokens`` of ``handle`` (at least one prompt token is always left to feed, so the
        next step has logits to sample from). On failure ``n_cached`` stays 0."""
        n = self.cells.restore(seq, handle, n_tokens)
        if n:
            self.layout.reused(n)

    def kv_free(self, handle: KVHandle) -> None:
        self.cells.free(handle)

    def kv_export(self, handle: KVHandle) -> bytes | None:
        return self.cells.export_bytes(handle)

    def kv_import(self, tokens: tuple[int, ...], data: bytes) -> KVHandle | None:
        return self.cells.import_bytes(tokens, data)

    def kv_rollback(self, seq: Sequence, n_tokens: int) -> None:
        """Undo a step that raised (octo.scheduler.step_isolation): its positions from ``n_tokens`` on leave the KV
        (``llama_memory_seq_rm``, which only drops this sequence from cells it shares). A sampler chain that may have
        drawn in that step and keeps state (penalties' history, a random draw) is rebuilt from the sequence's tokens:
        penalties come back exactly, a random draw restarts from its seed; a plain greedy pick keeps no state."""
        slot: Slot | None = seq.slot
        if slot is None:
            seq.n_cached = 0
            return
        advanced = seq.n_cached > n_tokens  # the step got to this sequence (its n_cached moves before it samples)
        seq.n_cached = n_tokens if self.cells.seq_rm(slot.seq_id, n_tokens) else 0
        if advanced and slot.chain is not None and slot.chain.argmax is None:
            old, slot.chain = slot.chain, SamplerChain(self.n_vocab, seq.sampling, self.penalty_last_n, seq.tokens)
            old.close()

    # -- embeddings --------------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Embeddings:
        if not self.is_embedding:
            raise InvalidRequest(
                f"Model '{self.info.name}' is not an embedding model (its GGUF has no pooling_type).", param="model"
            )
        return embed_texts(self, texts)
