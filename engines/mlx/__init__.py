"""The MLX engine (mlx-lm): Apple Silicon (Metal) and Linux with ``mlx[cpu]``.

Loads an MLX model folder (``config.json``, ``*.safetensors``, tokenizer files; quantized folders included;
Hugging Face safetensors folders load too, through mlx-lm's per-architecture ``sanitize``).

How the shared scheduler's steps map onto mlx-lm (see :mod:`.batch`): a sequence's prompt chunks run through
the model on its own mlx-lm prompt cache (``make_prompt_cache``); the chunk that samples processes all but
its last token first, so the output layer only ever runs for one position. The sequence then joins the
running decode batch, whose KV lives in mlx-lm's ``BatchKVCache`` (the continuous-batching core of
``BatchGenerator``: ``merge``/``extend`` to join, ``filter`` to leave, ``extract`` to keep a row's KV); each
step is one batched forward pass over every decoding sequence. ``BatchGenerator.next()`` itself is not
called because it returns a sequence's first token only two calls after it joins and applies its own stop
and length rules, while the scheduler needs the token in the step that asks for it.

Constrained decoding and logprobs (:mod:`.sampling`): a feed's ``mask`` is applied to its row after the logits
processors (a masked or logprobs row never takes the batch's shared argmax); ``logprobs`` come from the processed row
(bias and penalties, before the mask and temperature); a chunk that asks for ``prompt_logprobs`` runs the output
layer for every position and reports the raw logits' log-softmax.

Prefix cache: ``kv_save`` snapshots a sequence's KV as an mlx-lm prompt cache (a list of ``KVCache``, and of
``RotatingKVCache`` for sliding-window layers while no position has left the window; sized in bytes for the shared
index); ``kv_restore`` gives a new sequence the first ``n`` tokens of one (the ``trim_prompt_cache`` operation, done
by slicing so the saved entry stays intact).

Images (:mod:`.vision`): a vision-language folder's vision tower and projector through mlx-vlm; an image's feed
appends its embeddings to the sequence's own prompt cache, as a prompt chunk does.

Options (``-o KEY=VALUE``): ``blas`` (``auto``, ``bundled`` or a library path; see :mod:`.runtime`),
``dtype`` (``auto``: float parameters, quantization scales included, upcast to float32 on CPU; ``keep``; or
``float32``/``float16``/``bfloat16``),
``n_ctx`` (default: the model's ``max_position_embeddings``), ``penalty_last_n`` (default 64),
``vision`` (``auto``: a vision-language folder's images through mlx-vlm, see :mod:`.vision`; ``off``: its text model
alone),
``prefill_chunk`` (default 512), ``kv_cells`` (default: no bound, each sequence's KV grows in memory as it needs;
N: the sequences' KV together holds at most N tokens, and the scheduler preempts and resumes under that bound,
as with llama.cpp's shared pool).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

from octo.engine import Detection, Engine, Feed, KVHandle, MediaChunk, MediaInput, ModelInfo, Sequence, Task
from octo.errors import ConfigError, EngineError, InvalidRequest
from octo.hookspecs import hookimpl
from octo.options import parse_engine_options, positive_int

from . import lora, runtime, vision
from .batch import DecodeBatch, cache_nbytes, cuttable, prefix_view, snapshot_cache
from .sampling import SAMPLING_PARAMS, RowSampler, prompt_entries, sample_rows, set_logprobs

log = logging.getLogger("octo.engines.mlx")
_OPTIONS = {"blas": str, "dtype": str, "n_ctx": positive_int, "penalty_last_n": positive_int,
            "prefill_chunk": positive_int, "kv_cells": positive_int, "cache_type": str, "lora": str, "vision": str}
_CACHE_TYPES = ("f16", "q8_0", "q4_0")
_DTYPES = ("auto", "keep", "float32", "float16", "bfloat16")


class _Slot:
    """Per-sequence state: sampler, and its own prompt cache while it is outside the decode batch."""

    __slots__ = ("sampler", "cache", "broken")

    def __init__(self, sampler: RowSampler) -> None:
        self.sampler = sampler
        self.cache: list[Any] | None = None
        self.broken = False


class MLXEngine(Engine):
    name = "mlx"
    aliases = ("mlx-lm", "mlx_lm")
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    formats = frozenset({"mlx"})
    option_names = frozenset(_OPTIONS)
    batching = "continuous"
    sampling_params = SAMPLING_PARAMS
    supports_masks = True
    supports_logprobs = True
    supports_prompt_logprobs = True
    prefill_chunk = 512
    media_kinds = frozenset({"image"})  # a vision-language folder's, through mlx-vlm (.vision)

    def __init__(self, config=None) -> None:
        super().__init__(config)
        opts = parse_engine_options("mlx", _OPTIONS, self.config.options)
        self.blas = opts.get("blas", "auto")
        self.dtype = opts.get("dtype", "auto")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"Option 'dtype' must be one of {', '.join(_DTYPES)}, got '{self.dtype}'.", param="dtype")
        self.n_ctx_option = opts.get("n_ctx")
        # cache_type (the name llama.cpp's engine uses): mlx-lm quantizes a KV cache only as QuantizedKVCache (kv_bits),
        # which has no batched form: its BatchKVCache, which this engine's continuous batch decodes on, holds plain
        # keys/values (mlx-lm's own BatchGenerator takes no kv_bits either). f16 is the unquantized cache, in the
        # model's compute dtype.
        cache_type = opts.get("cache_type", "f16").lower()
        if cache_type not in _CACHE_TYPES:
            raise ConfigError(f"Option 'cache_type' must be one of {', '.join(_CACHE_TYPES)}, got '{cache_type}'.",
                              param="cache_type")
        if cache_type != "f16":
            raise ConfigError(f"cache_type={cache_type} is not supported by the mlx engine: mlx-lm's quantized KV "
                              "cache (QuantizedKVCache, kv_bits) cannot join the BatchKVCache its continuous batch "
                              "decodes on; use the llamacpp engine for a quantized KV cache.", param="cache_type")
        self.penalty_last_n = opts.get("penalty_last_n", 64)
        self.prefill_chunk = opts.get("prefill_chunk", type(self).prefill_chunk)
        self.kv_cells = opts.get("kv_cells", 0)
        self.vision_option = opts.get("vision", "auto").lower()
        if self.vision_option not in ("auto", "off"):
            raise ConfigError(f"Option 'vision' must be auto or off, got '{self.vision_option}'.", param="vision")
        self.vision: vision.Vision | None = None
        self.lora_paths = lora.parse(opts["lora"]) if "lora" in opts else {}
        self.adapters: dict[str, dict] = {}  # LoRA adapters by name (.lora), loaded with the model
        self.router: lora.Router | None = None
        self._live: set[Sequence] = set()  # sequences holding KV, for kv_room
        self.model = None
        self.codec = None
        self.batch: DecodeBatch | None = None

    # -- discovery -------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        try:
            reason = runtime.unavailable_reason()
            if reason:
                return Detection(False, reason)
            reason = f"mlx {cls.version()} on {runtime.device_description()}"
            if sys.platform.startswith("linux"):
                reason += f"; BLAS: {runtime.blas_hint()}"
            return Detection(True, reason)
        except Exception as exc:  # noqa: BLE001 - detect never raises
            return Detection(False, f"MLX cannot be used here: {type(exc).__name__}: {exc}")

    @classmethod
    def version(cls) -> str:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            base = f"{pkg_version('mlx')}+mlx-lm.{pkg_version('mlx-lm')}"
        except PackageNotFoundError:
            return "0"
        try:  # images go through mlx-vlm (.vision): cached measurements and KV are of both
            return f"{base}+mlx-vlm.{pkg_version('mlx-vlm')}"
        except PackageNotFoundError:
            return base

    @classmethod
    def prepare(cls) -> None:
        """mlx-lm's tokenizer module imports transformers' AutoTokenizer (and with it torch where installed):
        about 1.7 s, most of this engine's load on a CPU. Importing those ahead loads no MLX code, so the BLAS
        choice of ``load`` (``-o blas``) stays open; the same BLAS is used either way (measured)."""
        try:
            if importlib.util.find_spec("transformers") is not None:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
        except Exception:  # noqa: BLE001 - load reports whatever really fails
            pass

    @classmethod
    def prepare_own_process(cls) -> None:
        """In a worker started for MLX alone: the same imports without torch (``runtime.hide_torch``), as ``load``
        makes them in an engine worker of its own."""
        runtime.hide_torch()
        cls.prepare()

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        p = Path(path)
        if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return "mlx"
        return None

    # -- life cycle ------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        reason = runtime.unavailable_reason()
        if reason:
            raise ConfigError(f"The mlx engine is unavailable: {reason}.")
        path = self._resolve(artifact)
        if self.config.own_process:
            runtime.hide_torch()
        try:
            mx = runtime.import_mlx(self.blas)
        except OSError as exc:
            raise ConfigError(f"Option 'blas': {exc}", param="blas") from None
        from mlx.utils import tree_flatten, tree_map

        from .text import TextCodec

        model, tokenizer, config = runtime.load_folder(path)
        compute = self._compute_dtype(mx)
        if compute is not None:  # upcast float parameters (quantization scales included); packed weights stay
            model.update(
                tree_map(lambda p: p.astype(compute) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters())
            )
            mx.eval(model.parameters())
        if self.lora_paths:
            self.router, self.adapters = lora.load_adapters(model, self.lora_paths, compute)
        text_cfg = config.get("text_config") or {}
        n_vocab = int(config.get("vocab_size") or text_cfg.get("vocab_size") or 0)
        self.model = model
        self.codec = TextCodec(tokenizer, n_vocab)
        self.batch = DecodeBatch(model)
        self.vision = vision.load(path, config, model, self.codec, compute, self.vision_option)
        dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
        self.info = self._model_info(name, config, tokenizer, n_vocab, dtypes, mx.__version__)
        return self.info

    def _model_info(self, name: str, config: dict, tokenizer: Any, n_vocab: int, dtypes: list, mlx_version: str):
        text_cfg = config.get("text_config") or {}
        n_ctx_model = int(config.get("max_position_embeddings") or text_cfg.get("max_position_embeddings") or 4096)
        info = ModelInfo(
            name=name,
            n_ctx=min(self.n_ctx_option or n_ctx_model, n_ctx_model, self.kv_cells or n_ctx_model),
            eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
            n_vocab=n_vocab or self.codec.n_vocab,
            extra={
                "device": runtime.device_description(),
                "blas": runtime.blas_in_use(),
                "mlx": mlx_version,
                "mlx_lm": _pkg_version("mlx-lm"),
                "model_type": config.get("model_type"),
                "dtypes": dtypes,
                "quantization": config.get("quantization"),
                "batching": "mlx-lm BatchKVCache continuous batch, one batched forward per step",
                "prefix_cache": "mlx-lm prompt caches (KVCache), trimmed on restore",
                "prefill_chunk": self.prefill_chunk,
                "penalty_last_n": self.penalty_last_n,
                "lora": self.adapters or None,
            },
        )
        if self.vision is not None:
            info.media = frozenset({"image"})
            info.extra.update(self.vision.describe())
        return info

    def _compute_dtype(self, mx):
        """``dtype=auto``: float32 on CPU, where MLX's bfloat16/float16 matmuls (and 4-bit matmuls with
        bfloat16/float16 scales: 9x/45x) are much slower; the model's own dtypes on the GPU."""
        if self.dtype == "keep" or (self.dtype == "auto" and mx.default_device().type != mx.DeviceType.cpu):
            return None
        return mx.float32 if self.dtype == "auto" else getattr(mx, self.dtype)

    def _resolve(self, artifact: str) -> Path:
        ref = artifact.removeprefix("hf://")
        path = Path(ref).expanduser()
        if path.exists():
            if not self.artifact_format(str(path)):
                raise ConfigError(f"'{artifact}' is not an MLX model folder (config.json and *.safetensors).")
            return path
        if ref.count("/") == 1 and not ref.startswith((".", "/")):  # a Hugging Face repository id
            return _download(ref)
        raise ConfigError(f"Model folder not found: '{artifact}'.")

    def unload(self) -> None:
        if self.batch is not None:
            self.batch.clear()
        self.model = self.codec = self.batch = self.vision = None
        self.info = None
        try:
            import mlx.core as mx

            mx.clear_cache()
        except Exception:  # noqa: BLE001
            pass

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.codec.tokenize(text, special)

    def token_bytes(self, token: int) -> bytes:
        return self.codec.token_bytes(token)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.codec.render_chat(messages, add_generation_prompt, tools)

    def chat_template(self) -> str | None:
        return self.codec.chat_template() if self.codec is not None else None

    def special_tokens(self) -> dict[str, int]:
        return self.codec.special_tokens() if self.codec is not None else {}

    # -- media (.vision) ----------------------------------------------------------------------------------------------
    def tokenize_media(self, parts: list[str | MediaInput]) -> tuple[list[int], list[MediaChunk]]:
        if self.vision is None:
            raise InvalidRequest(f"Model '{self.info.name}' takes no images.", param="messages")
        return self.vision.tokenize(parts)

    def encode_media(self, chunk: MediaChunk) -> Any:
        return self.vision.encode(chunk)

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        lora.check(self.adapters, seq.sampling.adapter, self.info.name)
        seq.slot = _Slot(RowSampler(seq.sampling, self.info.n_vocab, self.penalty_last_n))
        seq.n_cached = 0
        self._live.add(seq)

    def kv_room(self) -> int | None:
        return self.kv_cells - sum(s.n_cached for s in self._live) if self.kv_cells else None

    def kv_drop(self, seq: Sequence) -> None:
        if self.batch is not None and seq in self.batch:
            self.batch.leave(seq)
        seq.slot.cache = None
        seq.n_cached = 0

    def remove_sequence(self, seq: Sequence) -> None:
        self._live.discard(seq)
        if self.batch is not None and seq in self.batch:
            try:
                self.batch.leave(seq)
            except Exception:  # noqa: BLE001 - a broken batch: drop it, its rows fail at their next step
                log.exception("removing a sequence from the MLX decode batch failed; resetting the batch")
                for other in self.batch.clear():
                    if other.slot is not None:
                        other.slot.broken = True
        seq.slot = None

    def step(self, feeds: list[Feed]) -> list[int | None]:
        import mlx.core as mx

        batch = self.batch
        for f in feeds:
            if f.seq.slot is None or f.seq.slot.broken:
                raise EngineError(f"Sequence {f.seq.id} has no usable KV state (a previous step failed).")
        decoding = {f.seq.id: i for i, f in enumerate(feeds)
                    if f.sample and len(f.tokens) == 1 and f.media is None and f.seq in batch}
        # A batch row without a one-token feed this step leaves the batch, keeping its KV.
        for seq in [s for s in batch.rows if s.id not in decoding]:
            seq.slot.cache = batch.leave(seq, keep=True)
        for f in feeds:
            f.seq.n_cached += len(f.tokens)
        pending: list[tuple[list[int], Any, list]] = []  # (feed indexes, sampled tokens, rows kept for logprobs)
        prompts: list[tuple[Feed, int, Any]] = []  # (feed, its first position, raw logits) for prompt logprobs
        if batch.rows:
            idx = [decoding[s.id] for s in batch.rows]
            if self.router is not None:  # each row's adapter (.lora)
                self.router.set([s.sampling.adapter for s in batch.rows])
            logits = batch.forward([feeds[i].tokens[0] for i in idx])
            tokens, kept = sample_rows([feeds[i] for i in idx], logits)
            mx.async_eval(tokens)
            pending.append((idx, tokens, kept))
            for i in idx:
                if feeds[i].prompt_logprobs >= 0:
                    feeds[i].prompt_out = []  # a decode feed: its next token is not known yet
        # prompt chunks (none in a decode-only step: no call, no loop)
        joining = self._prefill(feeds, decoding, pending, prompts) if len(decoding) < len(feeds) else ()
        out: list[int | None] = [None] * len(feeds)
        if pending:
            mx.eval([t for _, t, _ in pending])
            for idx, tokens, kept in pending:
                toks = tokens.tolist()
                for i, tok in zip(idx, toks, strict=True):
                    out[i] = int(tok)
                if kept:
                    set_logprobs([feeds[i] for i in idx], kept, toks)
        else:
            mx.eval([[c.state for c in f.seq.slot.cache] for f in feeds if f.seq.slot.cache])
        for f, first, rows in prompts:
            f.prompt_out = prompt_entries(f, first, rows)
        for seq in joining:
            batch.join(seq, seq.slot.cache)
            seq.slot.cache = None
        return out

    def _prefill(self, feeds: list[Feed], decoding: dict[int, int], pending: list, prompts: list) -> list[Sequence]:
        """The feeds that are not batch decodes, one at a time on their own caches (a prompt chunk, or a sequence's
        first decode): their sampled tokens into ``pending``, prompt logprobs' raw rows into ``prompts``; returns the
        sequences that join the batch once the step is evaluated."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        model = self.model
        joining: list[Sequence] = []
        for i, f in enumerate(feeds):
            if f.seq.id in decoding:
                continue
            slot = f.seq.slot
            if self.router is not None:
                self.router.set([f.seq.sampling.adapter])
            if slot.cache is None:
                slot.cache = make_prompt_cache(model)
            toks = f.tokens
            if f.media is not None:  # an image's rows of embeddings (.vision)
                logits = self.vision.feed(model, f, slot.cache)
            elif f.prompt_logprobs >= 0:  # the output layer runs for every position of the chunk
                first = f.seq.n_cached - len(toks)
                every = model(mx.array(toks, dtype=mx.uint32)[None], cache=slot.cache)
                prompts.append((f, first, every[0, : max(0, min(len(toks), len(f.seq.tokens) - 1 - first))]))
                logits = every[:, -1, :]
            else:
                if f.sample and len(toks) > 1:  # the output layer runs for the last position only
                    model(mx.array(toks[:-1], dtype=mx.uint32)[None], cache=slot.cache)
                    toks = toks[-1:]
                logits = model(mx.array(toks, dtype=mx.uint32)[None], cache=slot.cache)[:, -1, :]
            if not f.sample:
                mx.async_eval([c.state for c in slot.cache])
                continue
            tok, kept = sample_rows([f], logits)
            mx.async_eval(tok)
            pending.append(([i], tok, kept))
            joining.append(f.seq)
        return joining

    # -- prefix cache ----------------------------------------------------------------------------
    def kv_save(self, seq: Sequence) -> KVHandle | None:
        import mlx.core as mx

        slot = seq.slot
        if slot is None or slot.broken or seq.n_cached <= 0:
            return None
        in_batch = seq in self.batch
        source = self.batch.cache if in_batch else slot.cache
        # only caches that keep every position can be cut to a shorter prefix (no recurrent state; a sliding window's
        # only while nothing has left the window: .batch.whole)
        if not source or not cuttable(source):
            return None
        cache = self.batch.snapshot(seq) if in_batch else snapshot_cache(source)
        if cache is None or cache[0].offset != seq.n_cached:
            return None
        mx.eval([(c.keys, c.values) for c in cache])
        return KVHandle(tuple(seq.tokens[: seq.n_cached]), cache_nbytes(cache), cache)

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        if handle.data is None:
            raise ValueError("the KV handle was freed")
        n = min(n_tokens, len(handle.tokens))
        if tuple(seq.tokens[:n]) != handle.tokens[:n]:
            raise ValueError("cached prefix does not match the sequence")
        seq.slot.cache = prefix_view(handle.data, n)
        seq.n_cached = n

    def kv_free(self, handle: KVHandle) -> None:
        handle.data = None


def _download(repo_id: str) -> Path:
    """The files mlx-lm needs from a hub repository (``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE`` read now:
    huggingface_hub reads them once, at import)."""
    from huggingface_hub import snapshot_download

    env = os.environ
    cache = env.get("HF_HUB_CACHE") or str(Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    offline = env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(
            snapshot_download(
                repo_id,
                cache_dir=cache,
                endpoint=(env.get("HF_ENDPOINT") or "").rstrip("/") or None,
                local_files_only=offline,
                allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:  # noqa: BLE001 - hub errors: not found, offline, unreachable
        raise ConfigError(f"Cannot fetch '{repo_id}' from the Hugging Face hub: {type(exc).__name__}: {exc}") from None


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


@hookimpl
def register_engines(register):
    register(MLXEngine)
