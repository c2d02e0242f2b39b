"""Ollama's ``images`` (``/api/chat`` messages, ``/api/generate``) through the shared media module (octo.serving.media).

An image is a base64 string (what Ollama's Go API decodes into ``[]byte``; a ``data:`` URL is taken too, as some
clients send one). Ollama places a message's images as its ``chatPrompt`` does (server/prompt.go): image ``k`` at
the ``k``-th ``[img]`` of the message's text, the images beyond its ``[img]`` placeholders right before its text, in
order, with nothing between. A bad image is a 400 whose message starts with where it is (``messages[0].images[1]:``),
since Ollama's error shape is only ``{"error": "..."}``. Truncation (``chat_prompt``) counts an image's positions,
and an image whose message it cuts is left out with that message.
"""

from __future__ import annotations

from typing import Any

from octo.engine import MediaChunk, MediaInput
from octo.errors import ContextLengthExceeded, InvalidRequest
from octo.serving import media
from octo.serving.media import ImageRef

PLACEHOLDER = "[img]"


def content(text: str, images: list[str], where: str, refs: list[ImageRef]) -> str:
    """``text`` with the markers of its ``images`` placed as Ollama places them; each image added to ``refs``."""
    first = len(refs)
    refs += [ImageRef(f"{where}[{k}]", media.base64_url(data)) for k, data in enumerate(images)]
    pieces = text.split(PLACEHOLDER)
    placed = min(len(images), len(pieces) - 1)
    out = [media.marker(first + k) for k in range(placed, len(images))]  # the rest, before the text
    for k, piece in enumerate(pieces):
        out.append(piece)
        if k < len(pieces) - 1:
            out.append(media.marker(first + k) if k < placed else PLACEHOLDER)
    return "".join(out)


def load(handle: Any, refs: list[ImageRef]) -> list[MediaInput]:
    """The request's images, decoded and checked (octo.serving.media); a 400 names the image in its message."""
    try:
        return media.load_images(handle, refs)
    except InvalidRequest as err:
        if err.param and not err.message.startswith(err.param):
            err.message = f"{err.param}: {err.message}"
        raise


class Tokenizer:
    """``tokenize(text)`` of a prompt with images for ``chat_prompt`` (an image its positions; one whose message
    truncation cut, left out), keeping each prompt's media chunks for :meth:`chunks`."""

    def __init__(self, engine: Any, images: list[MediaInput]) -> None:
        self.engine, self.images = engine, images
        self._chunks: dict[str, tuple[MediaChunk, ...]] = {}

    def __call__(self, text: str) -> list[int]:
        tokens, self._chunks[text] = media.tokenize(self.engine, text, self.images, dropped_ok=True)
        return tokens

    def chunks(self, prompt: str) -> tuple[MediaChunk, ...]:
        return self._chunks.get(prompt, ())


def check_fits(tokens: list[int], fitted: list[int], chunks: tuple[MediaChunk, ...]) -> None:
    """A prompt with images is never cut through (Ollama's runner shifts text only): one that does not fit is a 400."""
    if chunks and fitted is not tokens:
        raise ContextLengthExceeded(f"the input with its images ({len(tokens)} tokens) exceeds the context length",
                                    param="messages")
