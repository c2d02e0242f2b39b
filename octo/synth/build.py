"""Build a synthetic model for one engine's format: ``build_for("demo", "llamacpp")``."""

from __future__ import annotations

from pathlib import Path

from octo.synth.spec import get_spec

# Per engine: the format each synthetic model is served in (small and exact for the demo).
DEFAULT_QUANT = {"llamacpp": "f16", "mlx": None, "onnx": "int4"}


def build_for(name: str, engine: str, quant: str | None = "default", seed: int = 0) -> Path:
    """The synthetic model ``name`` (a shape from ``octo.synth.SHAPES``) in ``engine``'s format, cached."""
    if engine in ("whisper", "faster-whisper", "whispercpp"):  # the same weights in each engine's format
        from octo.synth.speech import build_whisper_ct2, build_whisper_ggml
        from octo.synth.whisper import build_whisper, parse_name

        shape, steady = parse_name(name)  # whisper-SHAPE or whisper-SHAPE-steady
        builder = {"whisper": build_whisper, "faster-whisper": build_whisper_ct2, "whispercpp": build_whisper_ggml}
        return builder[engine](shape, seed, steady=steady)
    from octo.synth.vision import SHAPES as VISION_SHAPES

    if name in VISION_SHAPES:  # a vision-language model, by each ecosystem's own converter
        if engine == "mlx":  # mlx-vlm's convert
            from octo.synth.vision_mlx import build_vision_mlx

            return build_vision_mlx(name, seed)
        if engine != "llamacpp":
            raise ValueError(f"no synthetic builder for '{name}' on engine '{engine}' (known: llamacpp, mlx)")
        from octo.synth.vision import build_vision_gguf  # the GGUF and its projector, by llama.cpp's converter

        return build_vision_gguf(name, seed)
    spec = get_spec(name)
    if quant == "default":
        quant = DEFAULT_QUANT.get(engine)
    if engine == "llamacpp":
        from octo.synth.gguf import build_gguf

        return build_gguf(spec, seed, quant or "f16")
    if engine == "mlx":
        from octo.synth.mlx import build_mlx

        return build_mlx(spec, seed, quant)
    if engine in ("onnx", "onnxruntime"):
        from octo.synth.onnx import build_onnx

        return build_onnx(spec, seed, quant or "int4")
    if engine == "echo":
        from octo.synth.hf import build_hf

        return build_hf(spec, seed)
    raise ValueError(f"no synthetic builder for engine '{engine}' (known: llamacpp, mlx, onnx, echo)")


def main(argv: list[str]) -> int:
    """``python -m octo.synth.build NAME ENGINE``: build (or find) the model and print ``{"path": ...}`` as the last
    line of stdout, or ``{"error": ...}`` with exit status 1. A server builds its synthetic models this way
    (``octo.models.download``), so that the builders' libraries (PyTorch, transformers, MLX, Triton) never load into
    the gateway: they would stay there for its whole life, and some print leak reports at its exit."""
    import json

    name, engine = argv
    try:
        path = build_for(name, engine)
    except Exception as exc:  # noqa: BLE001 - the caller shows the reason
        hint = " (pip install 'octo[synth]')" if isinstance(exc, ImportError) else ""
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}{hint}"}), flush=True)
        return 1
    print(json.dumps({"path": str(path)}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
