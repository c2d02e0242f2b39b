"""The parameters of the llama.cpp engine's serving context (``llama_context_params``) for a KV layout.

The engine builds a context at load and again whenever its KV layout changes (:mod:`.adapt`, :mod:`.layout`): one
unified pool of cells shared by every sequence, or a stream of cells per sequence. :func:`plan` turns the options and
the layout into the parameters, checking what llama.cpp would reject late or silently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from octo.errors import ConfigError

FLASH = {"auto": -1, "off": 0, "on": 1}


@dataclass
class ContextPlan:
    params: Any  # llama_context_params
    n_batch: int
    stream_cells: int | None  # cells a sequence's stream holds (None: the unified pool)
    n_cache: int  # sequence ids for prefix-cache entries (after the max_batch serving ids)
    flash_attn: str


def default_flash_attn(L: Any, opts: dict[str, Any], unified: bool) -> str:
    """llama.cpp's ``auto`` (on), but ``off`` for a model loaded into a stream per sequence (``unified`` false: the
    layout its load serves with, given or cached; it keeps it in every context it builds, so that KV snapshots move
    between them, the layout probe's included) where the model computes on the CPU.

    On the CPU, llama.cpp's flash-attention kernel takes a step of under 64 new tokens one query row at a time: over a
    2,000-token context a decode step costs 1.8x, and a 57-token step 4.6x, what it costs without it (docs/engines.md,
    "Flash attention on the CPU"). Without it, every query attends to all the cells in use up to the last one, so in the
    unified pool (shared with other sequences and prefix-cache entries) prompt steps grow with the pool: there the
    agent workload ran in 0.67x the wall time but 1.11x the mean time to first token with it off, so the pool keeps
    it. In streams a query's cells are its own sequence's: with it off there, the workload ran in 0.44x the wall time
    and 0.40x the mean time to first token of the same streams with it on (``bench/agent.py --octo-ab``)."""
    on_cpu = not L.llama_supports_gpu_offload() or opts.get("n_gpu_layers", -1) == 0
    return "off" if on_cpu and not unified else "auto"


def plan(L: Any, model: Any, opts: dict[str, Any], *, is_embedding: bool, pooling: int, max_batch: int,
         prefill_chunk: int, n_ctx: int, unified: bool, stream_cells: int | None, n_threads: int,
         n_threads_batch: int, cache_type: str, flash_default: str = "auto") -> ContextPlan:
    """The context of ``max_batch`` sequences of up to ``n_ctx`` tokens in the given layout (streams of
    ``stream_cells`` each, default ``n_ctx``)."""
    if max_batch > L.llama_max_parallel_sequences():
        raise ConfigError(
            f"max_batch {max_batch} exceeds llama.cpp's {L.llama_max_parallel_sequences()} parallel sequences",
            param="max_batch",
        )
    cp = L.llama_context_default_params()
    if is_embedding:  # a whole input must fit one micro-batch (non-causal attention needs it)
        n_batch = opts.get("n_batch", n_ctx)
        cp.n_ubatch = opts.get("n_ubatch", n_batch)
        cp.embeddings = True
        cp.pooling_type = pooling
    else:
        n_batch = opts.get("n_batch", max(512, max_batch + prefill_chunk))
        cp.n_ubatch = opts.get("n_ubatch", min(n_batch, 512))
    if n_batch < max_batch + prefill_chunk and not is_embedding:
        raise ConfigError(
            f"n_batch ({n_batch}) must hold max_batch + prefill_chunk ({max_batch} + {prefill_chunk})",
            param="n_batch",
        )
    # Unified: one pool of KV cells shared by all sequences, each of which may grow to n_ctx; by default
    # room for max_batch full sequences, capped at the model's trained context (or n_ctx if larger).
    # Separate streams: each sequence gets n_ctx cells of its own.
    if unified:
        cells = opts.get("kv_cells", min(n_ctx * max_batch, max(L.llama_model_n_ctx_train(model), n_ctx)))
        if cells < n_ctx:
            raise ConfigError(f"kv_cells ({cells}) must be >= n_ctx ({n_ctx})", param="kv_cells")
    else:
        if "kv_cells" in opts:
            raise ConfigError("kv_cells applies to a unified KV pool (kv_unified=true)", param="kv_cells")
        cells = (stream_cells or n_ctx) * max_batch
    # Prefix-cache entries as cells of their own sequence ids (unified pool only: across streams a copy would
    # copy whole buffers).
    n_cache = opts.get("cache_seqs", 16) if unified and not is_embedding else 0
    n_cache = max(0, min(n_cache, L.llama_max_parallel_sequences() - max_batch))
    cp.n_ctx = cells
    cp.n_batch = n_batch
    cp.n_seq_max = max_batch + n_cache
    cp.kv_unified = unified
    cp.n_threads = n_threads
    cp.n_threads_batch = n_threads_batch
    # KV cache type (K and V alike): llama.cpp reads a quantized V cache only inside flash attention, so a
    # quantized cache turns flash attention on (an explicit flash_attn=off with one is refused)
    flash_attn = opts.get("flash_attn")
    if cache_type in ("q8_0", "q4_0"):
        if flash_attn == "off":
            raise ConfigError(f"cache_type={cache_type} needs flash attention (llama.cpp reads a quantized "
                              "V cache only there); drop flash_attn=off", param="cache_type")
        flash_attn = "on"
    elif flash_attn is None:
        flash_attn = flash_default
    cp.type_k = cp.type_v = getattr(L, f"GGML_TYPE_{cache_type.upper()}")
    cp.flash_attn_type = FLASH[flash_attn]
    cp.no_perf = True
    return ContextPlan(cp, n_batch, None if unified else (stream_cells or n_ctx), n_cache, flash_attn)
