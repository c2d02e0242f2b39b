"""LoRA adapters on the MLX engine: mlx-lm's adapter folders (``adapter_config.json`` + ``adapters.safetensors``, what
``mlx_lm.lora`` trains and ``load_adapters`` reads), several per model, chosen per sequence.

mlx-lm's own ``LoRALinear`` wraps a projection with *one* adapter (``y = linear(x) + scale * (x @ lora_a) @
lora_b``) for the whole model. Here each targeted projection is wrapped once by :class:`MultiLoRALinear`, which holds
every loaded adapter's ``lora_a``/``lora_b``/``scale`` and adds, to each batch row, the term of the adapter that row's
sequence uses (none for the base model). The rows' adapters come from one :class:`Router` the engine sets before each
forward pass (a prompt chunk: its sequence's adapter; a decode step: one per batch row). So sequences of different
adapters decode in the same batched forward pass; a pass whose rows share one adapter adds just that term.

The option takes the same form as llama.cpp's: ``-o lora='{"NAME": "FOLDER"}'`` or ``NAME=FOLDER;NAME=FOLDER`` (what
``--lora`` and the models file pass). Only ``fine_tune_type: lora`` adapters load (DoRA and full fine-tunes are
refused by name).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from octo.errors import ConfigError, InvalidRequest

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([ab])$")


class Router:
    """The adapter of each batch row for the next forward pass: None (no adapter anywhere), one name for every row,
    or a list with one name (or None) per row."""

    __slots__ = ("rows", "masks")

    def __init__(self) -> None:
        self.rows: Any = None
        self.masks: dict[str, Any] = {}  # mixed rows: adapter -> (rows,) 1/0 mask, made once per forward pass

    def set(self, adapters: list[str | None]) -> None:
        first = adapters[0] if adapters else None
        if all(a == first for a in adapters):
            self.rows = first
            return
        import mlx.core as mx

        self.rows = list(adapters)
        self.masks = {name: mx.array([1.0 if a == name else 0.0 for a in adapters], dtype=mx.float32)
                      for name in set(adapters) if name is not None}


class _Terms:
    """Adapter name -> (lora_a, lora_b, scale) of one projection (a plain object: not model parameters)."""

    def __init__(self) -> None:
        self.by_name: dict[str, tuple[Any, Any, float]] = {}


def _multi_class():
    import mlx.nn as nn

    class MultiLoRALinear(nn.Module):
        def __init__(self, base: Any, router: Router) -> None:
            super().__init__()
            self.base = base
            object.__setattr__(self, "_router", router)
            object.__setattr__(self, "_terms", _Terms())

        def __call__(self, x):
            y = self.base(x)
            rows = self._router.rows
            if rows is None:
                return y
            terms = self._terms.by_name
            if isinstance(rows, str):
                t = terms.get(rows)
                return y if t is None else y + (t[2] * ((x @ t[0]) @ t[1])).astype(y.dtype)
            for name, mask in self._router.masks.items():
                t = terms.get(name)
                if t is not None:
                    mask = mask.astype(y.dtype).reshape(-1, *[1] * (y.ndim - 1))
                    y = y + mask * (t[2] * ((x @ t[0]) @ t[1])).astype(y.dtype)
            return y

    return MultiLoRALinear


def load_adapters(model: Any, paths: dict[str, str], dtype: Any = None) -> tuple[Router, dict[str, dict]]:
    """Wrap ``model``'s targeted projections and load every adapter folder of ``paths``; returns the router and a
    description per adapter (rank, scale, layers, keys)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    multi = _multi_class()
    router = Router()
    layers = model.layers
    info: dict[str, dict] = {}
    for name, folder in paths.items():
        root = Path(folder).expanduser()
        cfg_path, weights = root / "adapter_config.json", root / "adapters.safetensors"
        if not cfg_path.is_file() or not weights.is_file():
            raise ConfigError(f"LoRA adapter '{name}': {folder} is not an mlx-lm adapter folder (adapter_config.json "
                              "and adapters.safetensors).", param="lora")
        cfg = json.loads(cfg_path.read_text())
        kind = cfg.get("fine_tune_type", "lora")
        if kind != "lora" or cfg.get("use_dora"):
            raise ConfigError(f"LoRA adapter '{name}': fine_tune_type '{kind}' is not served (only lora).",
                              param="lora")
        params = cfg.get("lora_parameters") or {}
        scale = float(params.get("scale", 20.0))
        tensors = mx.load(str(weights))
        pairs: dict[tuple[int, str], dict[str, Any]] = {}
        for key, value in tensors.items():
            m = _KEY.search(key)
            if m is None:
                raise ConfigError(f"LoRA adapter '{name}': unexpected tensor {key}.", param="lora")
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
        for (layer, path), ab in sorted(pairs.items()):
            if layer >= len(layers) or set(ab) != {"a", "b"}:
                raise ConfigError(f"LoRA adapter '{name}': layer {layer} {path} does not match the model.",
                                  param="lora")
            modules = dict(layers[layer].named_modules())
            target = modules.get(path)
            if target is None:
                raise ConfigError(f"LoRA adapter '{name}': the model has no module {path} in layer {layer}.",
                                  param="lora")
            if not isinstance(target, multi):
                target = multi(target, router)
                layers[layer].update_modules(tree_unflatten([(path, target)]))
            a, b = ab["a"], ab["b"]
            if dtype is not None:
                a, b = a.astype(dtype), b.astype(dtype)
            if a.shape[1] != b.shape[0] or a.ndim != 2 or b.ndim != 2:
                raise ConfigError(f"LoRA adapter '{name}': lora_a {a.shape} and lora_b {b.shape} of {path} do not fit.",
                                  param="lora")
            target._terms.by_name[name] = (a, b, scale)
        mx.eval([t for ab in pairs.values() for t in ab.values()])
        info[name] = {"rank": params.get("rank"), "scale": scale, "layers": len({k[0] for k in pairs}),
                      "keys": sorted({k[1] for k in pairs})}
    return router, info


def parse(value: str) -> dict[str, str]:
    """The ``lora`` option: a JSON object ``{"NAME": "FOLDER"}`` or ``NAME=FOLDER`` pairs separated by ``;``."""
    s = value.strip()
    try:
        pairs = json.loads(s) if s.startswith("{") else dict(
            (k.strip(), v.strip()) for k, _, v in (item.partition("=") for item in s.split(";") if item.strip()))
    except ValueError as exc:
        raise ConfigError(f"Option 'lora': {exc}", param="lora") from None
    if not isinstance(pairs, dict) or not pairs or not all(
            isinstance(k, str) and k and ":" not in k and "/" not in k and isinstance(v, str) and v
            for k, v in pairs.items()):
        raise ConfigError("Option 'lora' must map adapter names (without ':' or '/') to adapter folders: "
                          '{"NAME": "FOLDER"} or NAME=FOLDER;NAME=FOLDER.', param="lora")
    return pairs


def check(adapters: dict[str, dict], name: str | None, model: str) -> None:
    if name is not None and name not in adapters:
        known = ", ".join(adapters) or "none (--lora NAME=FOLDER)"
        raise InvalidRequest(f"Model '{model}' has no LoRA adapter '{name}' (loaded: {known}).", param="model")
