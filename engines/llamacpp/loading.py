"""What the llama.cpp engine's load reads and reports: the GGUF model itself (weight repacking decided by the option
or this host's probe, :mod:`.probe`) and ``ModelInfo.extra`` (what ``/v1/engines`` shows of the load)."""

from __future__ import annotations

import threading
from typing import Any

from octo.errors import ConfigError, EngineError

from .native import LogTap, check_gguf, version

POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def load_model(L: Any, artifact: str, opts: dict[str, Any]) -> tuple[str, Any, bool, str]:
    """(the GGUF's path, the llama_model, weights repacked?, how that was chosen) for ``artifact``."""
    path = check_gguf(artifact)
    LogTap.install()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    if "n_gpu_layers" in opts:  # else llama.cpp's default: everything on a GPU backend if there is one
        mp.n_gpu_layers = opts["n_gpu_layers"]
    mp.use_mmap = opts.get("use_mmap", True)
    repack, source = repack_choice(opts, version())
    mp.use_extra_bufts = repack
    LogTap.recent.clear()
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ConfigError(
            f"llama.cpp could not load {artifact} (corrupt or truncated GGUF, or an "
            f"unsupported architecture): {LogTap.tail() or 'no details'}"
        )
    return str(path), model, repack, source


def backends(spec: Any) -> str:
    """The compute backends a llama-cpp-python install ships (its ``lib/libggml-*.so`` files, read without loading
    them): "CPU", or with GPU offload "GPU offload: CUDA, Vulkan"."""
    from pathlib import Path

    names = set()
    for folder in spec.submodule_search_locations or ():
        for lib in (Path(folder) / "lib").glob("*ggml-*"):
            names.add(lib.name.split("ggml-", 1)[1].split(".", 1)[0])
    gpus = sorted(GPU_BACKENDS[n] for n in names if n in GPU_BACKENDS)
    return f"GPU offload: {', '.join(gpus)}" if gpus else "CPU"


GPU_BACKENDS = {"cuda": "CUDA", "metal": "Metal", "vulkan": "Vulkan", "hip": "ROCm", "sycl": "SYCL",
                "opencl": "OpenCL", "musa": "MUSA", "cann": "CANN"}


class EogScan:
    """The end-of-generation token ids (``llama_vocab_is_eog`` of every token: 151,936 calls, 0.08 s of Python for a
    Qwen vocabulary), scanned in a thread of its own while the load goes on (creating the context runs native code
    without the GIL). :meth:`ids` waits for them; :meth:`join` before the model is freed."""

    def __init__(self, L: Any, vocab: Any, n_vocab: int) -> None:
        self._ids: frozenset[int] | None = None
        self._thread = threading.Thread(target=self._scan, args=(L.llama_vocab_is_eog, vocab, n_vocab),
                                        name="octo-eog-scan", daemon=True)
        self._thread.start()

    def _scan(self, is_eog: Any, vocab: Any, n_vocab: int) -> None:
        self._ids = frozenset(t for t in range(n_vocab) if is_eog(vocab, t))

    def join(self) -> None:
        self._thread.join()

    def ids(self) -> frozenset[int]:
        self._thread.join()
        if self._ids is None:
            raise EngineError("llama.cpp: reading the vocabulary's end-of-generation tokens failed")
        return self._ids


def special_tokens(L: Any, vocab: Any, n_vocab: int) -> dict[str, int]:
    """Control and user-defined tokens by their text (llama.cpp's token attributes; the first id of a text)."""
    flags = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
    found: dict[str, int] = {}
    for t in range(n_vocab):
        if L.llama_vocab_get_attr(vocab, t) & flags:
            raw = L.llama_vocab_get_text(vocab, t)
            if raw:
                found.setdefault(raw.decode("utf-8", "replace"), t)
    return found


def repack_choice(opts: dict[str, Any], version: str) -> tuple[bool, str]:
    """Weight repacking (the fast path) unless the user said no, or this host's probe crashed with it (on AMX hosts
    llama.cpp's repack segfaults), and where the choice came from."""
    choice = opts.get("repack", "auto")
    if choice != "auto":
        return choice == "true", "option"
    from .probe import repack_safe

    return repack_safe(version), "probe"


def describe(engine: Any, arch: str, pooling: int) -> dict[str, Any]:
    """``ModelInfo.extra`` of a loaded :class:`.engine.LlamaCppEngine` (its public attributes and parts)."""
    L, model, ctx = engine.lib, engine.model, engine.ctx
    ftype = L.llama_ftype_name(L.llama_model_ftype(model))
    spec, n_cache = engine.spec, engine.n_cache_seqs
    return {
        "backend": f"llama-cpp-python {version()}",
        "architecture": arch,
        "file_type": ftype.decode() if ftype else engine.metadata.get("general.file_type"),
        "n_params": L.llama_model_n_params(model),
        "size_bytes": L.llama_model_size(model),
        "threads": engine.n_threads,
        "threads_batch": engine.n_threads_batch,
        "n_ctx_train": L.llama_model_n_ctx_train(model),
        "n_ctx_per_seq": engine.n_ctx_seq,
        "kv_cells": L.llama_n_ctx(ctx),
        "kv_unified": engine.kv_unified,
        "kv_compact": engine.cells.compact and engine.kv_unified,
        "kv_layout": engine.layout.describe(),
        "n_seq_max": L.llama_n_seq_max(ctx),
        "n_batch": engine.n_batch,
        "n_ubatch": L.llama_n_ubatch(ctx),
        "prefill_chunk": engine.prefill_chunk,
        "flash_attn": engine.flash_attn,
        "cache_type": engine.cache_type,
        "kv_bytes_per_token": engine.cell_bytes,
        "lora": engine.adapters.describe() if engine.adapters else None,
        "draft": ({"model": engine.opts["draft"], "n_draft": spec.n_draft, "max_batch": spec.max_batch}
                  if spec is not None else None),
        "tasks": ["embeddings"] if engine.is_embedding else ["chat", "completion"],
        "pooling": POOLING_NAMES.get(pooling, "none") if engine.is_embedding else None,
        "chat_template": engine.template_source,
        "cache_seqs": n_cache,
        "prefix_cache": (f"shared cells of the unified pool ({n_cache} entries), RAM snapshots beyond" if n_cache
                         else "llama_state_seq snapshots in RAM"),
        "repack": engine.repack,
        "repack_source": engine.repack_source,
    }
