"""ONNX Runtime GenAI engine: onnxruntime-genai model folders on CPU, with continuous batching over KV rows that
octo owns (plain onnxruntime sessions), or onnxruntime-genai's own ``og.Generator`` batch windows.
``onnxruntime`` / ``onnxruntime_genai`` are imported lazily, so this package imports without them and
``detect()`` says why the engine is unavailable."""

from __future__ import annotations

from octo.hookspecs import hookimpl

from .engine import OnnxEngine

__all__ = ["OnnxEngine"]


@hookimpl
def register_engines(register):
    register(OnnxEngine)
