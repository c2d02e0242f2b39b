"""Build synthetic onnxruntime-genai model folders from the synthetic Hugging Face build.

The HF folder from :func:`octo.synth.hf.build_hf` goes through onnxruntime-genai's own model builder, exactly as a
real checkpoint would: ``python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4|fp32 -e cpu``, offline
(``HF_HUB_OFFLINE=1``, input folder only, so it never downloads). The result is a folder with
``genai_config.json``, ``model.onnx`` + ``model.onnx.data`` and the tokenizer files.

Folders are cached next to the HF build: ``synth_dir()/<shape>-s<seed>-float32/onnx-v1/<precision>-cpu``; a
build goes to a temporary sibling folder, gets a ``.complete`` marker and is renamed into place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from octo.synth.folder import COMPLETE, build_folder, die_with_parent
from octo.synth.hf import build_hf
from octo.synth.spec import ModelSpec, get_spec

VERSION = 1
PRECISIONS = ("int4", "int8", "fp32")


def default_dir(spec: ModelSpec | str, seed: int = 0, precision: str = "int4") -> Path:
    from octo.synth.hf import default_dir as hf_dir

    return hf_dir(get_spec(spec), seed, "float32").parent / f"onnx-v{VERSION}" / f"{precision}-cpu"


def build_onnx(shape: ModelSpec | str, seed: int = 0, precision: str = "int4", out: Path | None = None,
               timeout: float | None = None) -> Path:
    """Build (or reuse) the synthetic onnxruntime-genai folder for ``shape``; returns its path.

    ``precision``: ``int4`` or ``int8`` (MatMulNBits, block size 32, the builder's CPU defaults) or ``fp32``.
    Needs ``onnxruntime-genai``, ``onnx``, ``onnx-ir``, ``transformers`` and ``torch`` (the builder's imports).
    """
    spec = get_spec(shape)
    if precision not in PRECISIONS:
        raise ValueError(f"unsupported ONNX precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    out = Path(out) if out is not None else default_dir(spec, seed, precision)
    if (out / COMPLETE).exists():
        return out
    hf = build_hf(spec, seed, dtype="float32")

    def write(tmp: Path) -> dict:
        model_dir, cache_dir = tmp / "model", tmp / "cache"
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(model_dir),
               "-p", precision, "-e", "cpu", "-c", str(cache_dir)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=die_with_parent)
        if proc.returncode != 0 or not (model_dir / "genai_config.json").is_file():
            tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
            raise RuntimeError(f"onnxruntime-genai's model builder failed for {spec.name} {precision} "
                               f"(exit {proc.returncode}):\n{tail}")
        return {"shape": spec.name, "seed": seed, "precision": precision, "execution_provider": "cpu",
                "builder": _builder_version()}

    return build_folder(out, write, subdir="model")


def _builder_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"onnxruntime-genai {version('onnxruntime-genai')}"
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Build a synthetic onnxruntime-genai model folder.")
    p.add_argument("shape", nargs="?", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="int4", choices=PRECISIONS)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    print(build_onnx(a.shape, a.seed, a.precision, a.out))


if __name__ == "__main__":
    main()
