"""Synthetic MLX model folders, converted from the synthetic Hugging Face folder with mlx-lm's own classes.

The weights are exactly the HF folder's (same shape, seed and tokenizer as every other engine's synthetic model):
mlx-lm's model class for the architecture loads ``model.safetensors`` (its ``sanitize`` drops what MLX does not keep,
such as a tied ``lm_head``) and ``save_model`` writes the MLX folder. ``quant="4bit"`` quantizes with
``mlx_lm.utils.quantize_model`` (affine, group size 64) from the float32 weights, so the scales and biases stay
float32: on CPU, MLX's 4-bit matmul is about 9x slower with bfloat16 scales and 45x slower with float16 ones
(``mlx_lm.convert -q`` keeps the source dtype unless told ``--dtype float32``). No torch is needed.

The conversion runs in a child process, so building a model never loads MLX into the caller (the MLX engine
chooses the BLAS library MLX uses before MLX is first loaded) and its peak memory goes away with the child.
Builds are cached under ``synth_dir()/"{shape}-s{seed}-float32"/{"mlx", "mlx-4bit"}``: they go to a temporary
sibling folder that is renamed into place, and a finished folder holds a ``.complete`` marker.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from octo.synth.folder import COMPLETE, build_folder, die_with_parent
from octo.synth.spec import ModelSpec, get_spec

QUANTS = {None: None, "4bit": {"bits": 4, "group_size": 64}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def default_dir(spec: ModelSpec | str, seed: int = 0, quant: str | None = None) -> Path:
    from octo.synth.hf import default_dir as hf_dir

    return hf_dir(spec, seed, "float32").parent / ("mlx" if quant is None else f"mlx-{quant}")


def build_mlx(spec: ModelSpec | str, seed: int = 0, quant: str | None = None, out: Path | None = None) -> Path:
    """Build (or reuse) the synthetic MLX folder for ``spec``; returns its path.

    ``quant``: None (float32) or ``"4bit"`` (affine 4-bit, group size 64, float32 scales and biases).
    """
    from octo.synth.hf import build_hf

    spec = get_spec(spec)
    if quant not in QUANTS:
        raise ValueError(f"unsupported quantization {quant!r}; expected None or one of: 4bit")
    out = Path(out) if out is not None else default_dir(spec, seed, quant)
    if (out / COMPLETE).exists():
        return out
    hf = build_hf(spec, seed=seed, dtype="float32")

    def write(tmp: Path) -> dict:
        cmd = [sys.executable, "-m", "octo.synth.mlx", str(hf), str(tmp)] + (["--quant", quant] if quant else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=die_with_parent)
        if proc.returncode != 0:
            raise RuntimeError(f"MLX conversion of {hf} failed:\n{proc.stderr[-4000:]}")
        return {"shape": spec.name, "seed": seed, "quant": quant}

    return build_folder(out, write)


def _convert(hf: Path, dst: Path, quant: dict | None) -> None:
    import contextlib
    import io

    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(hf, lazy=True)  # mlx-lm's class for config["model_type"], weights sanitized
    mx.eval(model.parameters())
    if quant is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
            model, config = quantize_model(model, config, quant["group_size"], quant["bits"])
    config["torch_dtype"] = config["dtype"] = "float32"
    save_model(dst, model, donate_model=True)
    save_config(config, config_path=dst / "config.json")
    # The tokenizer files are copied as they are (not re-saved through transformers), so every engine's
    # synthetic model carries byte-identical tokenizer files.
    for name in TOKENIZER_FILES:
        if (hf / name).exists():
            shutil.copyfile(hf / name, dst / name)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Convert a Hugging Face folder to an MLX folder (float32 weights).")
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--quant", choices=[q for q in QUANTS if q], default=None)
    args = ap.parse_args(argv)
    _convert(args.src, args.dst, QUANTS[args.quant])


if __name__ == "__main__":
    main()
