"""The synthetic vision-language model (:mod:`octo.synth.vision`) for MLX, written by mlx-vlm's own converter.

``mlx_vlm convert --hf-path HF --mlx-path OUT --dtype float32`` runs on the Hugging Face folder every engine's copy
of ``demo-vision`` comes from, so the MLX folder is what ``mlx-community`` repositories hold: mlx-vlm's tensor
names, its ``config.json``, the processor's and tokenizer's files. The weights stay float32 and unquantized, as the
demo's MLX text model is (on CPU, MLX's bfloat16 and 4-bit matmuls are several times slower). The converter runs
in a child process, so building never loads MLX into the caller (the MLX engine chooses the BLAS MLX uses before
MLX is first loaded). The folder is cached beside the others: ``synth_dir()/"{name}-s{seed}"/"mlx-v{VERSION}"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from octo.synth.folder import COMPLETE, build_folder, die_with_parent


def mlx_dir(name: str = "demo-vision", seed: int = 0) -> Path:
    from octo.paths import synth_dir
    from octo.synth.vision import VERSION

    return synth_dir() / f"{name}-s{seed}" / f"mlx-v{VERSION}"


def mlx_vlm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-vlm")
    except PackageNotFoundError:
        raise RuntimeError("building the synthetic vision model for MLX needs mlx-vlm (pip install 'octo[mlx]')") \
            from None


def build_vision_mlx(name: str = "demo-vision", seed: int = 0, timeout: float = 600) -> Path:
    """Build (or reuse) the MLX folder of the synthetic vision model ``name``; returns its path."""
    from octo.synth.vision import build_vision_hf, get_vision_spec

    spec = get_vision_spec(name)
    out = mlx_dir(name, seed)
    if (out / COMPLETE).exists():
        return out
    ver = mlx_vlm_version()
    hf = build_vision_hf(name, seed)

    def write(tmp: Path) -> dict:
        cmd = [sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", str(hf), "--mlx-path", str(tmp / "mlx"),
               "--dtype", "float32"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=die_with_parent,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if proc.returncode != 0 or not (tmp / "mlx" / "config.json").is_file():
            tail = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
            raise RuntimeError(f"mlx-vlm's converter failed on {hf} (exit {proc.returncode}):\n{tail}")
        return {"shape": spec.name, "seed": seed, "dtype": "float32", "converter": f"mlx-vlm {ver}"}

    return build_folder(out, write, subdir="mlx")
