"""LoRA adapters on llama.cpp: loaded once with the model, one adapter (or none) active per forward pass.

llama.cpp keeps the adapter set on the *context* (``llama_set_adapters_lora``), not per sequence: every token of one
``llama_decode`` goes through the same set. So a step whose feeds ask for different adapters is run as one
``llama_decode`` per adapter (the base model, without adapter, counts as one), each group sampled right after its
own decode (the next decode overwrites the logits). Sequences of the same adapter still batch together, and a step
where every sequence uses the same adapter (the usual case) is a single decode, as without LoRA. Switching the set
is skipped when it does not change.

The adapter's own scaling applies as llama.cpp defines it: ``scale * alpha / rank`` with ``scale`` 1.0 here (the
GGUF's ``adapter.lora.alpha``), which is what merging ``W + alpha / rank * B @ A`` into the weights gives.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from octo.errors import ConfigError, EngineError, InvalidRequest

from .native import LogTap


class Adapters:
    """The adapters of one loaded model, by name, and the one active on the context."""

    def __init__(self, L: Any, model: Any, paths: dict[str, str]) -> None:
        self._L = L
        self.ptrs: dict[str, Any] = {}
        self.meta: dict[str, dict[str, str]] = {}
        self.active: str | None = None  # what the context has now (None: no adapter)
        self.switches = 0
        for name, path in paths.items():
            p = Path(path).expanduser()
            if not p.is_file():
                raise ConfigError(f"LoRA adapter '{name}': file not found: {path}", param="lora")
            LogTap.recent.clear()
            ptr = L.llama_adapter_lora_init(model, str(p).encode())
            if not ptr:
                raise ConfigError(f"LoRA adapter '{name}' ({path}) could not be loaded by llama.cpp (not a GGUF LoRA "
                                  f"adapter, or made for another model): {LogTap.tail() or 'no details'}",
                                  param="lora")
            self.ptrs[name] = ptr
            self.meta[name] = _adapter_meta(L, ptr)

    def __contains__(self, name: str | None) -> bool:
        return name is None or name in self.ptrs

    def names(self) -> list[str]:
        return list(self.ptrs)

    def check(self, name: str | None, model: str) -> None:
        if name not in self:
            known = ", ".join(self.ptrs) or "none"
            raise InvalidRequest(f"Model '{model}' has no LoRA adapter '{name}' (loaded: {known}).", param="model")

    def apply(self, ctx: Any, name: str | None) -> None:
        """Make ``name`` (None: no adapter) the context's adapter set, unless it already is."""
        if name == self.active:
            return
        L = self._L
        if name is None:
            rc = L.llama_set_adapters_lora(ctx, None, 0, None)
        else:
            arr = (L.llama_adapter_lora_p_ctypes * 1)(self.ptrs[name])
            rc = L.llama_set_adapters_lora(ctx, arr, 1, (ctypes.c_float * 1)(1.0))
        if rc != 0:
            self.active = ...  # unknown: set it again next time
            raise EngineError(f"llama.cpp could not switch to LoRA adapter {name!r} (code {rc}).")
        self.active = name
        self.switches += 1

    def describe(self) -> dict[str, Any]:
        return {name: {"alpha": m.get("adapter.lora.alpha"), "type": m.get("adapter.type")}
                for name, m in self.meta.items()}


def _adapter_meta(L: Any, ptr: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    buf = ctypes.create_string_buffer(1024)
    for i in range(L.llama_adapter_meta_count(ptr)):
        if L.llama_adapter_meta_key_by_index(ptr, i, buf, len(buf)) < 0:
            continue
        key = buf.value.decode("utf-8", "replace")
        if L.llama_adapter_meta_val_str_by_index(ptr, i, buf, len(buf)) >= 0:
            out[key] = buf.value.decode("utf-8", "replace")
    return out


def groups(feeds: list[Any]) -> dict[str | None, list[int]]:
    """Feed indexes by the adapter their sequence uses, in first-seen order."""
    out: dict[str | None, list[int]] = {}
    for i, f in enumerate(feeds):
        out.setdefault(f.seq.sampling.adapter, []).append(i)
    return out

