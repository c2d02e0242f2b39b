"""Images on the MLX engine, through mlx-vlm: the vision tower and projector of a vision-language model folder, the
prompt's tokens cut at its images, their encodes, and their embeddings fed into a sequence's KV.

A folder whose ``config.json`` has a ``vision_config`` is a vision-language model (what ``mlx_vlm convert`` writes and
``mlx-community`` publishes). mlx-lm loads its text model, as for any model (the continuous batch, the prefix cache
and the sampling of :mod:`engines.mlx` are unchanged); mlx-vlm loads the whole folder lazily (``load_model(...,
lazy=True)``), of which only the vision tower and the projector are ever evaluated: the text embeddings its
``get_input_embeddings`` reads are the text model's own (shared), the rest of its language model is never loaded
into memory. The image processor is mlx-vlm's (``load_processor``: the folder's ``preprocessor_config.json``).

Gemma 3 (``model_type: gemma3``) takes images: each image is ``<start_of_image>``, ``mm_tokens_per_image`` positions
and ``<end_of_image>``, as llama.cpp's libmtmd places it (mlx-vlm's own processor adds a blank line on each side, as
transformers' does; octo gives every engine the same prompt for the same request). ``encode`` is mlx-vlm's
``get_input_embeddings`` on the image's positions (the vision tower, the projector and mlx-vlm's scaling of the
image features), on the scheduler's encode thread; ``feed`` appends rows of it to a sequence's prompt cache through
the text model's ``input_embeddings``, with the causal attention mlx-vlm's own generation uses. A folder of another
vision-language architecture is refused at load (``-o vision=off`` serves its text model alone), as is a folder
whose vision part mlx-vlm cannot load or run (a warm-up encode at load).
"""

from __future__ import annotations

import importlib.util
import inspect
import threading
from pathlib import Path
from typing import Any

from octo.engine import Feed, MediaChunk, MediaInput, media_token_ids
from octo.errors import ConfigError, EngineError, InvalidRequest

ARCHITECTURES = ("gemma3",)


def load(path: Path, config: dict, model: Any, codec: Any, compute: Any, option: str) -> Vision | None:
    """The vision part of the folder at ``path`` (None: a text model, or ``vision=off``)."""
    if option == "off" or "vision_config" not in config:
        return None
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path} is a {arch} vision-language model: the mlx engine takes images for "
                          f"{', '.join(ARCHITECTURES)} only; -o vision=off serves its text model alone",
                          param="vision")
    if importlib.util.find_spec("mlx_vlm") is None:
        raise ConfigError(f"{path} is a vision-language model and mlx-vlm is not installed (pip install "
                          "'octo[mlx]'); -o vision=off serves its text model alone", param="vision")
    if "input_embeddings" not in inspect.signature(model.__call__).parameters:
        raise ConfigError(f"mlx-lm's {arch} model takes no input embeddings; -o vision=off serves it as text only",
                          param="vision")
    try:
        return Vision(path, config, model, codec, compute)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever mlx-vlm raises: the load fails, naming it
        raise ConfigError(f"mlx-vlm could not load the vision part of {path}: {type(exc).__name__}: {exc}; "
                          "-o vision=off serves its text model alone", param="vision") from exc


class Vision:
    """The engine's ``vision`` part: mlx-vlm's model (vision tower and projector) and image processor."""

    def __init__(self, path: Path, config: dict, model: Any, codec: Any, compute: Any) -> None:
        import mlx.core as mx
        from mlx.utils import tree_map
        from mlx_vlm.utils import load_model, load_processor

        self.mx, self.codec, self.path = mx, codec, path
        vlm = load_model(Path(path), lazy=True)
        text = getattr(getattr(model, "language_model", None), "model", None)
        if text is None or not hasattr(vlm.language_model.model, "embed_tokens"):
            raise ConfigError(f"mlx-lm's and mlx-vlm's {config.get('model_type')} models differ in layout")
        vlm.language_model.model.embed_tokens = text.embed_tokens  # one copy of the text embeddings
        parts = [vlm.vision_tower, vlm.multi_modal_projector]
        if compute is not None:  # the text model's dtype (float32 on CPU), as engines.mlx upcasts it
            for p in parts:
                p.update(tree_map(lambda a: a.astype(compute) if mx.issubdtype(a.dtype, mx.floating) else a,
                                  p.parameters()))
        mx.eval([p.parameters() for p in parts])
        self.vlm = vlm
        self.image_processor = load_processor(str(path), add_detokenizer=False).image_processor
        self.image_token = int(config["image_token_index"])
        self.begin = int(config["boi_token_index"])
        self.end = int(config["eoi_token_index"])
        self.n_tokens = int(config.get("mm_tokens_per_image") or 256)
        self.nbytes = sum(v.nbytes for p in parts for v in _leaves(p.parameters()))
        self.lock = threading.Lock()
        warm = self.prepare(MediaInput("image", "warm-up", bytes(3 * 32 * 32), 32, 32))
        out = self.encode(MediaChunk("image", "warm-up", 0, self.n_tokens, data=warm))
        if out.shape[0] != self.n_tokens or not mx.all(mx.isfinite(out)).item():
            raise ConfigError(f"mlx-vlm's warm-up encode of {path} gave {out.shape[0]} rows for "
                              f"{self.n_tokens} image positions (or values that are not finite)")

    def describe(self) -> dict[str, Any]:
        return {"media": ["image"], "vision": f"mlx-vlm {_pkg_version('mlx-vlm')}",
                "vision_bytes": self.nbytes, "image_tokens": self.n_tokens, "image_attention": "causal"}

    # -- the serving side ---------------------------------------------------------------------------------------------
    def prepare(self, item: MediaInput) -> Any:
        """The image's pixel values (channels first, float32) by mlx-vlm's image processor."""
        import numpy as np
        from PIL import Image

        try:
            img = Image.frombytes("RGB", (item.width, item.height), item.data)
            out = self.image_processor(images=[img], return_tensors="np")
        except Exception as exc:  # noqa: BLE001 - a bad image is the request's fault
            raise InvalidRequest(f"The image could not be prepared for the model: {exc}", param="messages") from None
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32)

    def tokenize(self, parts: list[str | MediaInput]) -> tuple[list[int], list[MediaChunk]]:
        tokens: list[int] = []
        media: list[MediaChunk] = []
        for p in parts:
            if not isinstance(p, MediaInput):
                tokens += self.codec.tokenize(p, special=True)
                continue
            if p.kind != "image":
                raise InvalidRequest(f"This model takes no {p.kind} input.", param="messages")
            pixels = self.prepare(p)
            tokens.append(self.begin)
            media.append(MediaChunk("image", p.digest, len(tokens), self.n_tokens, data=pixels))
            tokens += media_token_ids(p.digest, self.n_tokens)
            tokens.append(self.end)
        return tokens, media

    # -- the encode thread ----------------------------------------------------------------------------------------
    def encode(self, chunk: MediaChunk) -> Any:
        """The chunk's input embeddings (one row per position), by mlx-vlm's ``get_input_embeddings``."""
        mx = self.mx
        if chunk.data is None:
            raise EngineError("an image chunk without its pixels reached the encoder")
        ids = mx.full((1, chunk.n_tokens), self.image_token, dtype=mx.int32)
        with self.lock:
            out = self.vlm.get_input_embeddings(ids, mx.array(chunk.data), mask=mx.ones(ids.shape))
            rows = out.inputs_embeds[0]
            mx.eval(rows)
        return rows

    # -- the engine thread ------------------------------------------------------------------------------------------
    def feed(self, model: Any, f: Feed, cache: list[Any]) -> Any:
        """Append the feed's rows of its image to ``cache``; the logits of the last position when the feed samples
        (the step has already advanced ``n_cached``)."""
        mx = self.mx
        m, k = f.media, len(f.tokens)
        start = f.seq.n_cached - k - m.pos
        if m.embedding is None or start < 0 or start + k > m.n_tokens:
            raise EngineError(f"sequence {f.seq.id}: an image feed outside its image's positions")
        rows = m.embedding[start:start + k][None]
        ids = mx.full((1, k), self.image_token, dtype=mx.uint32)
        if f.sample and k > 1:  # the output layer runs for the last position only
            model(ids[:, :-1], cache=cache, input_embeddings=rows[:, :-1])
            ids, rows = ids[:, -1:], rows[:, -1:]
        out = model(ids, cache=cache, input_embeddings=rows)
        return out[:, -1, :] if f.sample else None


def _leaves(tree: Any):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)
