"""Thin helpers over llama-cpp-python's ctypes bindings: options, the log hook, GGUF checks and metadata, a batch.

Everything here imports ``llama_cpp`` lazily, inside functions, so the engine package imports without it, and only
its ctypes bindings (:func:`bindings`).
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octo.errors import ConfigError
from octo.options import (
    auto_bool,
    boolean,
    choice,
    non_negative_int,
    parse_engine_options,
    positive_int,
    probability,
)
from octo.plugins import installed_version

log = logging.getLogger("octo.engines.llamacpp")

GGUF_MAGIC = b"GGUF"


# -- the bindings ---------------------------------------------------------------------------------
class _Package(types.ModuleType):
    """``llama_cpp`` while only its ctypes bindings are loaded: the package's own ``__init__`` (its high-level
    ``Llama`` class, chat formats with jinja2, numpy) runs the first time anything else of it is asked for."""

    _lock = threading.RLock()  # (re-entered: the package's __init__ reads its own attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__all__":
            raise AttributeError(name)
        with self._lock:
            if self.__dict__.get("_octo_lazy"):
                self.__dict__["_octo_lazy"] = False
                self.__spec__.loader.exec_module(self)  # the real package, into this module object
        return object.__getattribute__(self, name)


def bindings() -> Any:
    """llama-cpp-python's ctypes bindings (``llama_cpp.llama_cpp``: every ``llama_*`` function and struct the engine
    calls) without the rest of its package, whose ``import llama_cpp`` also imports its Python ``Llama`` class, chat
    formats, jinja2 and numpy: 0.12-0.17 s against 0.02-0.03 s here, on the worker's path to a model's load. A later
    ``import llama_cpp`` (octo's synthetic GGUF builder) gets the whole package at its first use."""
    low = sys.modules.get("llama_cpp.llama_cpp")
    if low is not None:
        return low
    with _Package._lock:  # (two engine threads loading at once make one package)
        return _load_bindings()


def _load_bindings() -> Any:
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("llama-cpp-python is not installed")
        pkg = _Package("llama_cpp")
        pkg.__dict__.update(__spec__=spec, __loader__=spec.loader, __file__=spec.origin, __package__="llama_cpp",
                            __path__=list(spec.submodule_search_locations), _octo_lazy=True,
                            __version__=version())
        sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as low

    return low


def version() -> str:
    """The llama-cpp-python version (its metadata, or the imported package's ``__version__``)."""
    return installed_version("llama_cpp", "llama_cpp_python") or "0"


# -- engine options (-o KEY=VALUE) -----------------------------------------------------------------
def _flash(v: str) -> str:
    s = v.strip().lower()
    s = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(s, s)
    if s not in ("auto", "on", "off"):
        raise ValueError(f"expected auto, on or off, got {v!r}")
    return s


# KV cache element types: (ggml type name, bytes per element: a q8_0 block holds 32 values in 34 bytes, q4_0 in 18)
CACHE_TYPES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


_cache_type = choice(*CACHE_TYPES)


def parse_lora(v: str) -> dict[str, str]:
    """``lora``: adapters as a JSON object ``{"name": "path"}`` (what the registry passes for ``--lora`` and the
    models file) or ``name=path`` pairs separated by ``;``."""
    import json

    s = v.strip()
    if s.startswith("{"):
        data = json.loads(s)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in data.items()):
            raise ValueError("expected a JSON object of adapter name -> path")
        pairs = data
    else:
        pairs = {}
        for item in filter(None, (x.strip() for x in s.split(";"))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"expected NAME=PATH, got {item!r}")
            pairs[name.strip()] = path.strip()
    for name in pairs:
        if not name or ":" in name or "/" in name:
            raise ValueError(f"adapter name {name!r} must be non-empty without ':' or '/'")
    return pairs


OPTIONS = {
    "n_ctx": (positive_int, "context length per sequence (default: the model's, from GGUF metadata)"),
    "n_threads": (positive_int, "decode threads (default: physical cores)"),
    "n_threads_batch": (positive_int, "prompt/batch threads (default: n_threads)"),
    "n_batch": (positive_int, "tokens per llama_decode call (default: max(512, max_batch + prefill_chunk))"),
    "n_ubatch": (positive_int, "physical micro-batch (default: min(n_batch, 512))"),
    "prefill_chunk": (positive_int, "the most prompt tokens one step feeds (default 512, llama-server's n_ubatch)"),
    "flash_attn": (_flash, "auto | on | off (default auto, but off in per-sequence streams on the CPU; on when "
                           "cache_type quantizes the KV cache)"),
    "cache_type": (_cache_type, "KV cache element type: f16 (default), q8_0, q4_0 or f32 (K and V both; a quantized "
                   "V cache needs flash attention, which is then turned on)"),
    "lora": (parse_lora, "LoRA adapters (GGUF) a request picks by model name base:NAME: {\"NAME\": \"PATH\"} or "
             "NAME=PATH;NAME=PATH (what --lora passes)"),
    "draft": (str, "speculative decoding: a GGUF draft model with the same vocabulary (what --draft passes)"),
    "mmproj": (str, "the projector (mmproj GGUF) of a vision-language model: images in prompts (default: the one "
               "mmproj*.gguf beside the model's file; none: text only)"),
    "n_draft": (positive_int, "with draft: tokens the draft proposes per step (default 4)"),
    "draft_p_min": (probability, "with draft: a sequence stops drafting at a token the draft gives less probability "
                    "(default 0.75, as llama-server's --draft-p-min; 0: always n_draft)"),
    "draft_max_batch": (positive_int, "with draft: speculate only while at most this many sequences decode "
                        "(default 4)"),
    "kv_unified": (auto_bool, "KV layout: true (one pool shared by all sequences), false (a stream of n_ctx cells per "
                   "sequence) or auto (default: the faster on an agent-shaped probe run while the model is idle, "
                   "cached per host; "
                   "OCTO_LLAMACPP_KV_UNIFIED sets the default)"),
    "kv_adapt": (auto_bool, "with the unified pool: run bursts of short concurrent sequences in per-sequence streams "
                 "of the same memory (pool / max_batch cells each), back in the pool when a sequence outgrows one: "
                 "auto (default: on with --max-batch 16 or more until a probe run while idle says otherwise, else when "
                 "that probe finds streams faster for short traffic; cached per host), "
                 "true, false"),
    "kv_compact": (boolean, "unified pool: rewrite a sequence's cells as one run once decoding beside others has "
                   "scattered them (default true; ggml's CPU attention is slower over scattered cells)"),
    "kv_cells": (positive_int, "cells in the unified KV pool (default min(n_ctx * max_batch, max(n_ctx_train, "
                 "n_ctx)))"),
    "cache_seqs": (non_negative_int, "prefix-cache entries kept as shared cells of the unified pool (default 16; "
                   "0: RAM snapshots only)"),
    "repack": (auto_bool, "repack quantized weights into llama.cpp's extra CPU buffer types (AMX, AVX): auto "
               "(default: on unless a once-per-host probe crashes), true, false (llama-server's --no-repack)"),
    "use_mmap": (boolean, "memory-map the GGUF (default true)"),
    "n_gpu_layers": (int, "layers offloaded to a GPU backend if llama.cpp has one (default: llama.cpp's, all)"),
    "penalty_last_n": (int, "tokens the repetition/presence/frequency penalties look back on (default 64)"),
}


def parse_options(options: dict[str, str]) -> dict:
    return parse_engine_options("llamacpp", OPTIONS, options)


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # macOS
        allowed = None
    if sys.platform == "darwin":
        import subprocess

        try:
            return int(subprocess.check_output(["sysctl", "-n", "hw.physicalcpu"], text=True).strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            return os.cpu_count() or 1
    cores = set()
    try:
        for cpu in allowed or range(os.cpu_count() or 1):
            base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip()))
    except OSError:
        return len(allowed) if allowed else (os.cpu_count() or 1)
    return max(1, len(cores))


# -- llama.cpp log ---------------------------------------------------------------------------------
class LogTap:
    """Routes llama.cpp's log to Python logging and keeps the recent lines for error messages."""

    _callback = None  # keep the ctypes callback alive for the life of the process
    recent: collections.deque = collections.deque(maxlen=40)

    @classmethod
    def install(cls) -> None:
        if cls._callback is not None:
            return
        llama_cpp = bindings()

        # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
        levels = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
        last = [logging.DEBUG]

        @llama_cpp.llama_log_callback
        def _cb(level, text, _user):
            line = text.decode("utf-8", "replace")
            cls.recent.append(line)
            lvl = last[0] if level == 5 else levels.get(level, logging.DEBUG)
            last[0] = lvl
            if line.strip() and log.isEnabledFor(lvl):
                log.log(lvl, "%s", line.rstrip())

        cls._callback = _cb
        llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))

    @classmethod
    def install_mtmd(cls, mtmd: Any) -> None:
        """libmtmd's log (a projector's load, its encodes) into the same hook."""
        cls.install()
        mtmd.mtmd_helper_log_set(cls._callback, ctypes.c_void_p(0))

    @classmethod
    def tail(cls, n: int = 6) -> str:
        lines = [s.strip() for s in list(cls.recent) if s.strip()]
        return " | ".join(lines[-n:])


def read_metadata(L, model) -> dict[str, str]:
    """A loaded model's GGUF key/value metadata as strings."""
    out = {}
    buf = ctypes.create_string_buffer(1 << 16)
    for i in range(L.llama_model_meta_count(model)):
        if L.llama_model_meta_key_by_index(model, i, buf, len(buf)) < 0:
            continue
        key = buf.value.decode("utf-8", "replace")
        if L.llama_model_meta_val_str_by_index(model, i, buf, len(buf)) >= 0:
            out[key] = buf.value.decode("utf-8", "replace")
    return out


def check_gguf(path: str) -> Path:
    """A clear ConfigError for a missing, non-GGUF or truncated file, before llama.cpp reads it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"GGUF file not found: {path}")
    with open(p, "rb") as f:
        head = f.read(24)
    if head[:4] != GGUF_MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (bad magic {head[:4]!r}).")
    if len(head) < 24:
        raise ConfigError(f"{path} is a truncated GGUF file ({len(head)} bytes).")
    return p


# -- a reusable llama_batch backed by numpy arrays -----------------------------------------------
@dataclass
class Batch:
    """A ``llama_batch`` whose arrays are numpy buffers, so a step fills them with slice assignments."""

    capacity: int

    def __post_init__(self) -> None:
        import numpy as np

        llama_cpp = bindings()
        n = self.capacity
        self.token = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.n_seq = np.ones(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32 * n)(*[ctypes.cast(base + 4 * i, i32) for i in range(n)])
        b = llama_cpp.llama_batch()
        b.n_tokens = 0
        b.token = self.token.ctypes.data_as(i32)
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(i32)
        b.n_seq_id = self.n_seq.ctypes.data_as(i32)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = b
