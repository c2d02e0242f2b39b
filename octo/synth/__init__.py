"""Synthetic models: real architectures and file formats, fixed-seed random weights, a local tokenizer."""

from __future__ import annotations

from octo.synth.spec import SHAPES, ModelSpec, get_spec

__all__ = ["SHAPES", "ModelSpec", "build_for", "build_hf", "get_spec"]


def __getattr__(name: str):
    if name == "build_hf":
        from octo.synth.hf import build_hf

        return build_hf
    if name == "build_for":
        from octo.synth.build import build_for

        return build_for
    raise AttributeError(name)
