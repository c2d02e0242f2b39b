"""Synthetic LoRA adapters for the synthetic models: random low-rank A/B, in llama.cpp's and mlx-lm's formats, and
the merged model they stand for (to prove an engine applies an adapter: its logits must equal the merged model's).

One adapter is ``delta_W = scale * B @ A`` on each target projection of every layer, with ``A`` (rank x in) and ``B``
(out x rank) drawn from a fixed seed per tensor, and ``scale = alpha / rank`` (the PEFT / llama.cpp convention).

- GGUF LoRA (llama.cpp's ``convert_lora_to_gguf.py`` layout): ``general.type=adapter``, ``adapter.type=lora``,
  ``adapter.lora.alpha``, tensors ``blk.N.attn_q.weight.lora_a`` (numpy shape (rank, in)) and ``.lora_b`` ((out,
  rank)); for the ``llama`` architecture the rows of ``B`` for q/k get the same RoPE permutation as the weights.
- MLX (mlx-lm's ``load_adapters``): ``adapters.safetensors`` with ``model.layers.N.self_attn.q_proj.lora_a`` ((in,
  rank)) and ``.lora_b`` ((rank, out)), and ``adapter_config.json`` (``fine_tune_type: lora``, ``num_layers``,
  ``lora_parameters``: rank, scale, keys).
- The merged model: the synthetic Hugging Face folder with ``W + scale * B @ A`` written into its weights (float32,
  computed here in numpy, independently of either engine's adapter code), converted to GGUF like any synthetic model.

Everything is cached under the base model's synthetic folder: ``.../lora/<name>.gguf``, ``.../lora/<name>-mlx/`` and
``.../lora/<name>-merged-<ftype>.gguf``, built atomically.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from octo.atomic import build_file
from octo.synth.folder import build_folder
from octo.synth.gguf import quiet_gguf_writer
from octo.synth.spec import ModelSpec, get_spec

VERSION = 1
# HF projection -> (module path inside a layer, GGUF tensor name)
MODULES = {
    "q_proj": ("self_attn.q_proj", "attn_q"),
    "k_proj": ("self_attn.k_proj", "attn_k"),
    "v_proj": ("self_attn.v_proj", "attn_v"),
    "o_proj": ("self_attn.o_proj", "attn_output"),
    "gate_proj": ("mlp.gate_proj", "ffn_gate"),
    "up_proj": ("mlp.up_proj", "ffn_up"),
    "down_proj": ("mlp.down_proj", "ffn_down"),
}


@dataclass(frozen=True)
class LoraSpec:
    """One synthetic adapter: rank, alpha (scale = alpha / rank), its seed, the projections it targets, and how strongly
    it moves the weights (``strength``: the std of ``B`` times sqrt(rank))."""

    rank: int = 8
    alpha: float = 16.0
    seed: int = 1
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "up_proj")
    strength: float = 0.5

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(MODULES)
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be among {', '.join(MODULES)}; got {', '.join(self.targets)}")
        if self.rank < 1:
            raise ValueError("rank must be >= 1")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def name(self) -> str:
        return f"r{self.rank}-a{self.alpha:g}-s{self.seed}-{'+'.join(self.targets)}-x{self.strength:g}-v{VERSION}"


def _shapes(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(out, in) of a projection."""
    h, f, kv = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "gate_proj": (f, h),
            "up_proj": (f, h), "down_proj": (h, f)}[module]


def lora_weights(spec: ModelSpec | str, lora: LoraSpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF weight name (``model.layers.N.self_attn.q_proj.weight``) -> (A (rank, in), B (out, rank)), float32."""
    spec = get_spec(spec)
    out = {}
    for i in range(spec.num_hidden_layers):
        for module in lora.targets:
            name = f"model.layers.{i}.{MODULES[module][0]}.weight"
            n_out, n_in = _shapes(spec, module)
            rng = np.random.default_rng([lora.seed, zlib.crc32(name.encode())])
            a = rng.standard_normal((lora.rank, n_in), dtype=np.float32) * np.float32(1 / np.sqrt(n_in))
            b = rng.standard_normal((n_out, lora.rank), dtype=np.float32)
            b *= np.float32(lora.strength / np.sqrt(lora.rank))
            out[name] = (a, b)
    return out


def lora_dir(spec: ModelSpec | str, seed: int = 0) -> Path:
    from octo.synth.hf import default_dir

    return default_dir(get_spec(spec), seed, "float32").parent / "lora"


def build_gguf_lora(spec: ModelSpec | str, seed: int = 0, lora: LoraSpec = LoraSpec(), out: Path | None = None) -> Path:
    """The adapter as a GGUF LoRA file for the synthetic GGUF of ``spec`` (base seed ``seed``)."""
    spec = get_spec(spec)
    out = Path(out) if out is not None else lora_dir(spec, seed) / f"{lora.name}.gguf"
    return build_file(out, lambda tmp: _write_gguf_lora(spec, lora, tmp))


def _write_gguf_lora(spec: ModelSpec, lora: LoraSpec, out: Path) -> None:
    import gguf

    from octo.synth.gguf import permute

    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}[spec.arch]
    quiet_gguf_writer()
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"octo synthetic LoRA for {spec.name}")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
    for name, (a, b) in lora_weights(spec, lora).items():
        layer = int(name.split(".")[2])
        module = name.split(".")[-2]
        if spec.arch == "llama" and module in ("q_proj", "k_proj"):  # the weights' RoPE row permutation (gguf.py)
            b = permute(b, spec.num_attention_heads if module == "q_proj" else spec.num_key_value_heads)
        base = f"blk.{layer}.{MODULES[module][1]}.weight"
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_mlx_lora(spec: ModelSpec | str, seed: int = 0, lora: LoraSpec = LoraSpec(), out: Path | None = None) -> Path:
    """The adapter as an mlx-lm adapter folder (``adapters.safetensors`` + ``adapter_config.json``)."""
    from safetensors.numpy import save_file

    spec = get_spec(spec)
    out = Path(out) if out is not None else lora_dir(spec, seed) / f"{lora.name}-mlx"

    def write(tmp: Path) -> dict:
        tensors = {}
        for name, (a, b) in lora_weights(spec, lora).items():
            prefix = name.removesuffix(".weight")
            tensors[prefix + ".lora_a"] = np.ascontiguousarray(a.T)  # mlx-lm's LoRALinear: x @ lora_a @ lora_b
            tensors[prefix + ".lora_b"] = np.ascontiguousarray(b.T)
        save_file(tensors, str(tmp / "adapters.safetensors"))
        config = {"fine_tune_type": "lora", "num_layers": spec.num_hidden_layers,
                  "lora_parameters": {"rank": lora.rank, "scale": lora.scale, "dropout": 0.0,
                                      "keys": [MODULES[m][0] for m in lora.targets]}}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"shape": spec.name, "lora": lora.name}

    return build_folder(out, write)


def build_merged_gguf(spec: ModelSpec | str, seed: int = 0, lora: LoraSpec = LoraSpec(), ftype: str = "f32",
                      out: Path | None = None) -> Path:
    """The base model with the adapter merged into its weights (``W + scale * B @ A``), as a GGUF of ``ftype``
    (``f32`` or ``f16``), built from a merged copy of the synthetic Hugging Face folder."""
    from octo.synth.gguf import convert_hf

    spec = get_spec(spec)
    out = Path(out) if out is not None else lora_dir(spec, seed) / f"{lora.name}-merged-{ftype}.gguf"
    if out.exists():
        return out
    hf = build_merged_hf(spec, seed, lora)
    return build_file(out, lambda tmp: convert_hf(hf, spec, tmp, ftype))


def build_merged_hf(spec: ModelSpec | str, seed: int = 0, lora: LoraSpec = LoraSpec()) -> Path:
    """The synthetic Hugging Face folder with the adapter merged into its float32 weights."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from octo.synth.hf import build_hf

    spec = get_spec(spec)
    hf = build_hf(spec, seed, dtype="float32")
    out = lora_dir(spec, seed) / f"{lora.name}-merged-hf"

    def write(tmp: Path) -> dict:
        for f in hf.iterdir():
            if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("."):
                shutil.copyfile(f, tmp / f.name)
        deltas = lora_weights(spec, lora)
        tensors = {}
        with safe_open(str(hf / "model.safetensors"), framework="np") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = st.get_tensor(key).astype(np.float32)
                if key in deltas:
                    a, b = deltas[key]
                    t = t + np.float32(lora.scale) * (b.astype(np.float64) @ a.astype(np.float64)).astype(np.float32)
                tensors[key] = np.ascontiguousarray(t)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return {"shape": spec.name, "seed": seed, "lora": lora.name, "merged": True}

    return build_folder(out, write)
