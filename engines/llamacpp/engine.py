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
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, ClassVar

from octo.engine import (
    Detection,
    Embeddings,
    Engine,
    EngineConfig,
    Feed,
    KVHandle,
    ModelInfo,
    Sequence,
    Task,
)
from octo.errors import ConfigError, ContextLengthExceeded, EngineError, InvalidRequest, KVCacheFull, Overloaded

from . import layout, lora
from . import logits as lg
from .adapt import AdaptiveLayout
from .cells import CellBook
from .embeddings import embed_texts
from .kvcache import KVCells, Slot
from .native import CACHE_TYPES, GGUF_MAGIC, Batch, LogTap, check_gguf, parse_options, physical_cores, read_metadata
from .sampling import SamplerChain
from .speculate import Speculation
from .template import ChatTemplate

log = logging.getLogger("octo.engines.llamacpp")

POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
FLASH = {"auto": -1, "off": 0, "on": 1}
# A GGUF without a chat template gets ChatML, as llama-server does.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class LlamaCppEngine(AdaptiveLayout, Speculation, KVCells, Engine):
    name: ClassVar[str] = "llamacpp"
    aliases: ClassVar[tuple[str, ...]] = ("llama.cpp", "llama-cpp", "llama_cpp")
    tasks: ClassVar[frozenset[Task]] = frozenset({Task.CHAT, Task.COMPLETION, Task.EMBEDDINGS})
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    batching: ClassVar[str] = "continuous"
    sampling_params: ClassVar[frozenset[str]] = frozenset({
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias",
    })
    # the mask and logprobs work on llama.cpp's logits rows (.logits); prompt logprobs ask logits of every position
    supports_masks: ClassVar[bool] = True
    supports_logprobs: ClassVar[bool] = True
    supports_prompt_logprobs: ClassVar[bool] = True
    prefill_chunk: ClassVar[int] = 256
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
        self._L: Any = None
        self.adapters: lora.Adapters | None = None

    # -- discovery ---------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        try:
            import llama_cpp
        except Exception as e:  # ImportError, or a broken shared library (OSError)
            return Detection(
                False, f"llama-cpp-python is not installed ({e.__class__.__name__}: {e}); pip install 'octo[llamacpp]'"
            )
        gpu = llama_cpp.llama_supports_gpu_offload()
        return Detection(True, f"llama-cpp-python {llama_cpp.__version__} ({'GPU offload' if gpu else 'CPU'})")

    @classmethod
    def version(cls) -> str:
        try:
            import llama_cpp

            return llama_cpp.__version__
        except Exception:
            return "0"

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return "gguf" if f.read(4) == GGUF_MAGIC else None
        except OSError:
            return None

    # -- life cycle --------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        import llama_cpp as L

        self._L = L
        path = check_gguf(artifact)
        self.artifact_path = str(path)
        LogTap.install()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if "n_gpu_layers" in self.opts:  # else llama.cpp's default: everything on a GPU backend if there is one
            mp.n_gpu_layers = self.opts["n_gpu_layers"]
        mp.use_mmap = self.opts.get("use_mmap", True)
        mp.use_extra_bufts = self.repack = self._repack(L.__version__)
        LogTap.recent.clear()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ConfigError(
                f"llama.cpp could not load {artifact} (corrupt or truncated GGUF, or an "
                f"unsupported architecture): {LogTap.tail() or 'no details'}"
            )
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.metadata = read_metadata(L, self.model)
        arch = self.metadata.get("general.architecture", "?")
        pooling = int(self.metadata.get(f"{arch}.pooling_type", "-1"))
        self.is_embedding = pooling > 0
        try:
            if self.opts.get("lora"):
                if self.is_embedding:
                    raise ConfigError("LoRA adapters apply to generative models; this GGUF is an embedding model.",
                                      param="lora")
                self.adapters = lora.Adapters(L, self.model, self.opts["lora"])
            self._make_context(pooling)
        except BaseException:
            self.unload()
            raise
        last_n = self.opts.get("penalty_last_n", 64)
        self.penalty_last_n = self.n_ctx_seq if last_n < 0 else last_n  # -1: the whole context, as llama-server
        eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self._pieces: dict[int, bytes] = {}
        self._special: dict[str, int] | None = None
        self._piece_buf = ctypes.create_string_buffer(256)
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
            self._choose_layout(pooling)
            if self.opts.get("draft"):
                self._load_draft(L)
        except BaseException:
            self.unload()
            raise
        ftype = L.llama_ftype_name(L.llama_model_ftype(self.model))
        self.info = ModelInfo(
            name=name,
            n_ctx=self.n_ctx_seq,
            eos_token_ids=eog,
            n_vocab=self.n_vocab,
            embedding_dim=L.llama_model_n_embd_out(self.model) if self.is_embedding else 0,
            tasks=frozenset({Task.EMBEDDINGS}) if self.is_embedding else frozenset({Task.CHAT, Task.COMPLETION}),
            extra={
                "backend": f"llama-cpp-python {L.__version__}",
                "architecture": arch,
                "file_type": ftype.decode() if ftype else self.metadata.get("general.file_type"),
                "n_params": L.llama_model_n_params(self.model),
                "size_bytes": L.llama_model_size(self.model),
                "threads": self.n_threads,
                "threads_batch": self.n_threads_batch,
                "n_ctx_train": L.llama_model_n_ctx_train(self.model),
                "n_ctx_per_seq": self.n_ctx_seq,
                "kv_cells": L.llama_n_ctx(self.ctx),
                "kv_unified": self.kv_unified,
                "kv_compact": self.compact and self.kv_unified,
                "kv_layout": {"chosen": "unified" if self.kv_unified else "streams", **self.kv_layout},
                "n_seq_max": L.llama_n_seq_max(self.ctx),
                "n_batch": self.n_batch,
                "n_ubatch": L.llama_n_ubatch(self.ctx),
                "prefill_chunk": self.prefill_chunk,
                "flash_attn": self.flash_attn,
                "cache_type": self.cache_type,
                "kv_bytes_per_token": self.cell_bytes,
                "lora": self.adapters.describe() if self.adapters else None,
                "draft": ({"model": self.opts["draft"], "n_draft": self.n_draft, "max_batch": self.draft_max_batch}
                          if self.drafter is not None else None),
                "tasks": ["embeddings"] if self.is_embedding else ["chat", "completion"],
                "pooling": POOLING_NAMES.get(pooling, "none") if self.is_embedding else None,
                "chat_template": self.template_source,
                "cache_seqs": self.n_cache_seqs,
                "prefix_cache": (f"shared cells of the unified pool ({self.n_cache_seqs} entries), RAM snapshots "
                                 "beyond" if self.n_cache_seqs else "llama_state_seq snapshots in RAM"),
                "repack": self.repack,
                "repack_source": self.repack_source,
            },
        )
        return self.info

    def _repack(self, version: str) -> bool:
        """Weight repacking (the fast path) unless the user said no, or this host's probe crashed with it."""
        choice = self.opts.get("repack", "auto")
        if choice != "auto":
            self.repack_source = "option"
            return choice == "true"
        from .probe import repack_safe

        self.repack_source = "probe"
        return repack_safe(version)

    def _make_context(self, pooling: int) -> None:
        L = self._L
        n_ctx_train = L.llama_model_n_ctx_train(self.model)
        n_ctx = self.opts.get("n_ctx", n_ctx_train)
        self.n_threads = self.opts.get("n_threads", physical_cores())
        self.n_threads_batch = self.opts.get("n_threads_batch", self.n_threads)
        self.cache_type = self.opts.get("cache_type", "f16")
        head_dim = L.llama_model_n_embd(self.model) // max(1, L.llama_model_n_head(self.model))
        self.cell_bytes = round(L.llama_model_n_layer(self.model) * 2 * L.llama_model_n_head_kv(self.model) * head_dim
                                * CACHE_TYPES[self.cache_type])
        self.n_ctx_opt, self._pooling, self.adapt = n_ctx, pooling, None
        self.plain_kv = not (L.llama_model_n_swa(self.model) or L.llama_model_is_recurrent(self.model)
                             or L.llama_model_is_hybrid(self.model))  # one KV cache: .kvcache.restream applies
        self._build_context(pooling, n_ctx, (layout.given(self) or (True, None))[0])  # measured after the load

    def _build_context(self, pooling: int, n_ctx: int, unified: bool, stream_cells: int | None = None) -> None:
        """The serving context with a KV layout (freeing one built before: the layout probe builds both); streams of
        ``stream_cells`` each (default ``n_ctx``: :mod:`.adapt` runs short traffic in smaller ones)."""
        L = self._L
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = self.mem = None
        n_ctx_train = L.llama_model_n_ctx_train(self.model)
        self.kv_unified = unified
        if self.adapters is not None:
            self.adapters.active = None  # a new context has no adapter set
        max_batch = self.config.max_batch
        if max_batch > L.llama_max_parallel_sequences():
            raise ConfigError(
                f"max_batch {max_batch} exceeds llama.cpp's {L.llama_max_parallel_sequences()} parallel sequences",
                param="max_batch",
            )
        cp = L.llama_context_default_params()
        if self.is_embedding:  # a whole input must fit one micro-batch (non-causal attention needs it)
            self.n_batch = self.opts.get("n_batch", n_ctx)
            cp.n_ubatch = self.opts.get("n_ubatch", self.n_batch)
            cp.embeddings = True
            cp.pooling_type = pooling
        else:
            self.n_batch = self.opts.get("n_batch", max(512, max_batch + self.prefill_chunk))
            cp.n_ubatch = self.opts.get("n_ubatch", min(self.n_batch, 512))
        if self.n_batch < max_batch + self.prefill_chunk and not self.is_embedding:
            raise ConfigError(
                f"n_batch ({self.n_batch}) must hold max_batch + prefill_chunk ({max_batch} + {self.prefill_chunk})",
                param="n_batch",
            )
        # Unified: one pool of KV cells shared by all sequences, each of which may grow to n_ctx; by default
        # room for max_batch full sequences, capped at the model's trained context (or n_ctx if larger).
        # Separate streams: each sequence gets n_ctx cells of its own.
        if self.kv_unified:
            cells = self.opts.get("kv_cells", min(n_ctx * max_batch, max(n_ctx_train, n_ctx)))
            if cells < n_ctx:
                raise ConfigError(f"kv_cells ({cells}) must be >= n_ctx ({n_ctx})", param="kv_cells")
        else:
            if "kv_cells" in self.opts:
                raise ConfigError("kv_cells applies to a unified KV pool (kv_unified=true)", param="kv_cells")
            cells = (stream_cells or n_ctx) * max_batch
        self.stream_cells = None if self.kv_unified else (stream_cells or n_ctx)  # cells a sequence's stream holds
        # Prefix-cache entries as cells of their own sequence ids (unified pool only: across streams a copy would
        # copy whole buffers).
        n_cache = self.opts.get("cache_seqs", 16) if self.kv_unified and not self.is_embedding else 0
        n_cache = max(0, min(n_cache, L.llama_max_parallel_sequences() - max_batch))
        cp.n_ctx = cells
        cp.n_batch = self.n_batch
        cp.n_seq_max = max_batch + n_cache
        cp.kv_unified = self.kv_unified
        cp.n_threads = self.n_threads
        cp.n_threads_batch = self.n_threads_batch
        # KV cache type (K and V alike): llama.cpp reads a quantized V cache only inside flash attention, so a
        # quantized cache turns flash attention on (an explicit flash_attn=off with one is refused)
        self.flash_attn = self.opts.get("flash_attn", "auto")
        if self.cache_type in ("q8_0", "q4_0"):
            if self.flash_attn == "off":
                raise ConfigError(f"cache_type={self.cache_type} needs flash attention (llama.cpp reads a quantized "
                                  "V cache only there); drop flash_attn=off", param="cache_type")
            self.flash_attn = "on"
        cp.type_k = cp.type_v = getattr(L, f"GGML_TYPE_{self.cache_type.upper()}")
        cp.flash_attn_type = FLASH[self.flash_attn]
        cp.no_perf = True
        LogTap.recent.clear()
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not create a context (n_ctx={n_ctx}, cache_type={self.cache_type}): "
                              f"{LogTap.tail()}")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_ctx_seq = min(n_ctx, L.llama_n_ctx_seq(self.ctx))
        self.batch = Batch(self.n_batch)
        self.free_ids = list(range(max_batch))  # add_sequence takes the lowest
        self.cache_ids = list(range(max_batch + n_cache - 1, max_batch - 1, -1))
        self.n_cache_seqs = n_cache
        self._entries: dict[int, KVHandle] = {}  # cache sequence id -> its handle, oldest first
        self.demoted = 0
        self._members_changed = False  # sequences came or went since the last step's idle check
        self.book = CellBook()
        self._reset_compaction(self.opts.get("kv_compact", True))
        self.active: dict[int, Sequence] = {}
        self.kv_cells = L.llama_n_ctx(self.ctx)
        self.kv_shares_cells = self.kv_unified

    def thread_counts(self) -> list[int]:
        """Current threads first, then one fewer: on a busy 2-core host 1 thread can beat 2 (issue 3)."""
        if "n_threads" in self.opts or self.n_threads <= 1:
            return []  # the user chose, or nothing to try
        return [self.n_threads, self.n_threads - 1]

    def set_threads(self, n: int) -> None:
        self.n_threads = self.n_threads_batch = n
        self._L.llama_set_n_threads(self.ctx, n, n)
        if self.drafter is not None:
            self._L.llama_set_n_threads(self.drafter.ctx, n, n)
        if self.info is not None:
            self.info.extra.update(threads=n, threads_batch=n)

    def unload(self) -> None:
        L = self._L
        self._close_draft()
        if L is not None:
            if self.ctx:
                L.llama_free(self.ctx)
            if self.model:
                L.llama_model_free(self.model)
        self.ctx = self.model = self.mem = self.vocab = None
        self.adapters = None  # llama.cpp frees a model's adapters with it
        super().unload()

    # -- text --------------------------------------------------------------------------------------
    def _text(self, token: int) -> str | None:
        if token < 0:
            return None
        raw = self._L.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else None

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer (``llama_tokenize``) with the model's BOS/EOS rule; no doubled BOS when the
        text (e.g. a rendered chat template) already starts with it."""
        L = self._L
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
            buf = self._piece_buf
            n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
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
            L = self._L
            flags = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
            found: dict[str, int] = {}
            for t in range(self.n_vocab):
                if L.llama_vocab_get_attr(self.vocab, t) & flags and (text := self._text(t)):
                    found.setdefault(text, t)
            self._special = found
        return dict(self._special)

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
        if self.adapt is not None:
            self._adapt_add(seq)
        if self.kv_unified:  # the shared pool must hold this prompt next to the running sequences (the prefix it
            used = self.book.used()  # may share with one of them or a cached entry in the pool takes no new cell)
            if used + len(seq.tokens) + 1 - self._shareable(seq.tokens, seq.sampling.adapter) > self.kv_cells:
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
        self._seq_rm(seq_id, 0)
        self._members_changed = True
        seq.slot = Slot(seq_id, chain)
        seq.n_cached = 0
        self.active[seq_id] = seq
        self._runs[seq_id] = 0
        if self.adapt is not None:
            self.adapt.added(len(self.active), len(seq.tokens))

    def step(self, feeds: list[Feed]) -> list[int | BaseException | None]:
        if not feeds:
            return []
        if self.adapt is not None:
            self._adapt_step(feeds)
        if self._members_changed and self._entries:  # decoding now: idle cached cells would be scanned every row
            self._members_changed = False
            self._demote_idle()
        if self.kv_unified and self.compact:
            self._compact_scattered()
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
                    self._seq_rm(f.seq.slot.seq_id, f.seq.n_cached)
                raise
            done += group
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out

    def _decode(self, feeds: list[Feed]) -> list[int | list[int] | BaseException | None]:
        drafts = self._drafts(feeds) if self.drafter is not None else None
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
        b = self.batch
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
            b.pos[n : n + k + len(d)] = range(f.seq.n_cached, f.seq.n_cached + k + len(d))
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
        rc = self._L.llama_decode(self.ctx, b.struct)
        if rc != 0:
            self._decode_failed(rc, feeds)
        if self.kv_unified:
            self._count_runs(feeds)
        result: list[int | list[int] | BaseException | None] = []
        append = self.book.append
        for i, (f, start) in enumerate(zip(feeds, starts, strict=True)):
            seq, k = f.seq, len(f.tokens)
            if f.prompt_logprobs >= 0:  # before the mask touches the last row
                f.prompt_out = lg.prompt_entries(self._L, self.ctx, self.n_vocab, f, start, seq.n_cached)
            d = drafts[i] if drafts is not None else ()
            seq.n_cached += k + len(d)
            append(seq.slot.seq_id, k + len(d))
            if d:
                out = self._verify(f, start + k - 1, d)
                if len(out) - 1 < len(d):  # the KV of rejected draft tokens goes
                    seq.n_cached -= len(d) - (len(out) - 1)
                    self._seq_rm(seq.slot.seq_id, seq.n_cached)
                result.append(out)
            elif not (f.sample and k):
                result.append(None)
            elif f.mask is None and f.logprobs < 0:  # the plain path: the native chain alone
                result.append(seq.slot.chain.sample(self.ctx, start + k - 1))
            else:
                result.append(lg.sample(self._L, self.ctx, self.n_vocab, f, start + k - 1, self.penalty_last_n))
        return result

    def _decode_failed(self, rc: int, feeds: list[Feed]) -> None:
        if rc == 1:  # no KV slot: the memory state was restored, nothing was consumed (the scheduler preempts)
            used = self.book.used()
            raise KVCacheFull(
                f"llama.cpp's KV cache is full ({self.kv_cells} cells shared by {len(self.active)} "
                f"sequences holding {used} tokens)."
            )
        # A fatal error may leave part of the batch in memory: drop what each sequence added.
        for f in feeds:
            self._seq_rm(f.seq.slot.seq_id, f.seq.n_cached)
        raise EngineError(f"llama_decode failed with code {rc}: {LogTap.tail()}")

    def remove_sequence(self, seq: Sequence) -> None:
        slot: Slot | None = seq.slot
        if slot is None:
            return
        if self.adapt is not None:
            self.adapt.removed(seq.n_cached, len(self.active) - (slot.seq_id in self.active))
        self._seq_rm(slot.seq_id, 0)
        if slot.chain is not None:
            slot.chain.close()
        self.free_ids.append(slot.seq_id)
        self.active.pop(slot.seq_id, None)
        self._runs.pop(slot.seq_id, None)
        if self.drafter is not None:
            self.drafter.drop(slot.seq_id)
        seq.slot = None
        self._members_changed = True

    # -- embeddings --------------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Embeddings:
        if not self.is_embedding:
            raise InvalidRequest(
                f"Model '{self.info.name}' is not an embedding model (its GGUF has no pooling_type).", param="model"
            )
        return embed_texts(self, texts)
