"""Engine options (``-o KEY=VALUE``) of the onnx engine."""

from __future__ import annotations

from octo.options import choice, non_negative_int, parse_engine_options, positive_int

_backend = choice("auto", "session", "generator", "engine")


OPTIONS = {
    "backend": (_backend, "session: octo drives the ONNX decoder with onnxruntime and owns the KV rows "
                          "(continuous batching, any prefix reused); generator: onnxruntime-genai's "
                          "og.Generator, one per batch window; engine: onnxruntime-genai's og.Engine "
                          "(continuous batching with paged-attention builds, CUDA/WebGPU); auto (default): engine "
                          "for paged-attention folders, else session when the folder allows"),
    "threads": (non_negative_int, "onnxruntime intra-op threads (default 0: onnxruntime's choice, physical cores)"),
    "n_ctx": (positive_int, "context length per sequence (default: the model's with the session backend, else "
                            "min(the model's, 4096))"),
    "prefill_chunk": (positive_int, "prompt tokens fed per step while other sequences decode (default 256)"),
    "penalty_last_n": (int, "tokens the repetition/presence/frequency penalties look back on; -1: the whole "
                            "sequence (default 64)"),
}


def parse_options(options: dict[str, str]) -> dict:
    return parse_engine_options("onnx", OPTIONS, options)
