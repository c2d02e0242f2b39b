"""llama.cpp engine (llama-cpp-python's low-level API): GGUF models, continuous batching, native sampling,
KV prefix reuse, output constraints (masks from octo's shared layer), logprobs and embeddings. ``llama_cpp`` is
imported lazily, so this package imports without it and ``detect()`` says why the engine is unavailable."""

from __future__ import annotations

from octo.hookspecs import hookimpl

from .engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]


@hookimpl
def register_engines(register):
    register(LlamaCppEngine)
