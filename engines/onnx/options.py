"""Engine options (``-o KEY=VALUE``) of the onnx engine."""

from __future__ import annotations

from octo.errors import ConfigError


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return n


def _non_negative(v: str) -> int:
    n = int(v)
    if n < 0:
        raise ValueError(f"expected an integer >= 0, got {v!r}")
    return n


def _backend(v: str) -> str:
    s = v.strip().lower()
    if s not in ("auto", "session", "generator", "engine"):
        raise ValueError(f"expected auto, session, generator or engine, got {v!r}")
    return s


OPTIONS = {
    "backend": (_backend, "session: octo drives the ONNX decoder with onnxruntime and owns the KV rows "
                          "(continuous batching, any prefix reused); generator: onnxruntime-genai's "
                          "og.Generator, one per batch window; engine: onnxruntime-genai's og.Engine "
                          "(continuous batching with paged-attention builds, CUDA/WebGPU); auto (default): engine "
                          "for paged-attention folders, else session when the folder allows"),
    "threads": (_non_negative, "onnxruntime intra-op threads (default 0: onnxruntime's choice, physical cores)"),
    "n_ctx": (_positive, "context length per sequence (default: min(the model's, 4096))"),
    "prefill_chunk": (_positive, "prompt tokens fed per step while other sequences decode (default 256)"),
    "penalty_last_n": (int, "tokens the repetition/presence/frequency penalties look back on; -1: the whole "
                            "sequence (default 64)"),
}


def parse_options(options: dict[str, str]) -> dict:
    out = {}
    for key, value in options.items():
        if key not in OPTIONS:
            known = ", ".join(sorted(OPTIONS))
            raise ConfigError(f"Unknown onnx engine option {key!r}; known options: {known}.", param=key)
        try:
            out[key] = OPTIONS[key][0](value)
        except ValueError as e:
            raise ConfigError(f"Invalid value for onnx option {key!r}: {e}", param=key) from None
    return out
