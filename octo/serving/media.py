"""Images in requests, for every API: a data URL decoded, checked with Pillow and hashed; the prompt cut at its images.

An API's image (OpenAI's ``image_url`` content part, Responses' ``input_image``, an Anthropic ``image`` block, an
Ollama ``images`` entry: each API's serving module makes it an :class:`ImageRef`) becomes an
:class:`octo.engine.MediaInput`: the pixels (RGB),
their size and the SHA-256 of the bytes the client sent, which keys the image's positions in the prefix cache. A bad
image is a 400 naming its part (``messages[0].content[1]``): not a data URL, not an image, a truncated file, a format
outside ``FORMATS``, more pixels than ``--max-image-pixels`` (a decompression bomb: checked from the header, before
the pixels are decoded), more bytes than ``--max-image-mb``, or more images than ``--max-images``. A model that takes
no images refuses one with a 400 naming the model. Remote ``http(s)`` URLs never reach this module when the server
fetches them (``--allow-image-urls``: the gateway fetches them and hands a data URL on, octo.server.imagefetch);
otherwise they are a 400 naming that flag: a server that fetches what a request names is an SSRF surface.

A chat message with images is rendered as llama-server renders it: its text parts joined by newlines, each image a
marker in the text (no newline next to one), the template applied to that text, and the rendered prompt cut at the
markers into the parts ``Engine.tokenize_media`` reads. A marker holds a token random per process, so no text a
client sends can place an image, and the image's number in the request, so each lands where its marker is whatever
order a template renders the messages in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octo.engine import MediaChunk, MediaInput
from octo.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_TOKEN = secrets.token_hex(8)
_MARKER = re.compile(rf"<__octo_media_{_TOKEN}_(\d+)__>")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?)(?P<b64>;base64)?,", re.I)


@dataclass(frozen=True)
class MediaLimits:
    """What one request may send (``--max-image-mb``, ``--max-images``, ``--max-image-pixels``)."""

    max_bytes: int = 20 * 2**20
    max_images: int = 16
    max_pixels: int = 32 * 2**20


@dataclass
class ImageRef:
    """An image part as a request names it, before it is decoded: where it is (``param``) and its URL (a data URL or
    a remote one). ``replace`` (where the gateway finds the images to fetch) sets the request's URL to another: the
    data URL of what was fetched."""

    param: str
    url: str
    replace: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    @property
    def remote(self) -> bool:
        return is_remote(self.url)


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def base64_url(data: str, media_type: str = "") -> str:
    """A data URL of base64 ``data`` (an Anthropic base64 source, an Ollama image); one already given as a data URL
    (some Ollama clients send them) stays as it is."""
    return data if data[:5].lower() == "data:" else f"data:{media_type};base64,{data}"


def limits_of(handle: Any) -> MediaLimits:
    return getattr(handle, "media_limits", None) or MediaLimits()


def require_images(handle: Any, refs: list[ImageRef]) -> None:
    """A 400 naming the model when it takes no images, and for more images than the limit."""
    info = handle.info
    if not getattr(info, "takes_images", False):
        raise InvalidRequest(f"Model '{handle.name}' does not take images (a text-only model"
                             f"{_no_projector(handle)}); send text only, or use a vision-language model.",
                             param=refs[0].param, code="model_not_multimodal")
    limit = limits_of(handle).max_images
    if len(refs) > limit:
        raise InvalidRequest(f"The request has {len(refs)} images; at most {limit} are allowed per request "
                             "(--max-images).", param=refs[limit].param)


def _no_projector(handle: Any) -> str:
    return ": its GGUF was loaded without a projector, --mmproj" if getattr(handle, "engine_name", "") == "llamacpp" \
        else ""


def url_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    """The bytes of an image URL: a base64 ``data:`` URL (remote URLs are refused: the gateway fetched those it may)."""
    if is_remote(url):
        raise remote_refused(param)
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidRequest("Invalid image URL: expected a base64 data URL (data:image/png;base64,...).", param=param,
                             code="invalid_image_url")
    if not m.group("b64"):
        raise InvalidRequest("Invalid image URL: the data URL must be base64 encoded (;base64,).", param=param,
                             code="invalid_image_url")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise InvalidRequest(f"Invalid image URL: the data URL holds {mime}, not an image.", param=param,
                             code="invalid_image")
    data = url[m.end():]
    if len(data) * 3 // 4 > limits.max_bytes + 3:  # before decoding it
        raise _too_big(len(data) * 3 // 4, param, limits)
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("Invalid image URL: its data is not valid base64.", param=param,
                             code="invalid_image_url") from None
    if len(raw) > limits.max_bytes:
        raise _too_big(len(raw), param, limits)
    return raw


def remote_refused(param: str) -> InvalidRequest:
    return InvalidRequest("Remote image URLs are off on this server: start it with --allow-image-urls HOST[,HOST...] "
                          "(OCTO_ALLOW_IMAGE_URLS) to fetch images from those hosts, or send the image inline, base64 "
                          "encoded (a data URL: data:image/png;base64,...).", param=param, code="remote_image_url")


def _too_big(n: int, param: str, limits: MediaLimits) -> InvalidRequest:
    return InvalidRequest(f"The image has {n / 2**20:.1f} MiB; at most {limits.max_bytes / 2**20:g} MiB are allowed "
                          "(--max-image-mb).", param=param, code="image_too_large")


def decode_image(raw: bytes, param: str, limits: MediaLimits) -> MediaInput:
    """``raw`` checked and decoded to RGB pixels (the first frame of an animation)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
    except UnidentifiedImageError:
        raise InvalidRequest("The data is not an image (or not one in a format this server reads: "
                             f"{', '.join(FORMATS)}).", param=param, code="invalid_image") from None
    except Image.DecompressionBombError:  # (Pillow's own bound, far above ours)
        raise _too_many_pixels("far more", param, limits) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"The image could not be read: {exc}.", param=param, code="invalid_image") from None
    with img:
        if img.format not in FORMATS:
            raise InvalidRequest(f"Unsupported image format {img.format}; send {', '.join(FORMATS)}.", param=param,
                                 code="unsupported_image_format")
        w, h = img.size
        if w < 1 or h < 1:
            raise InvalidRequest("The image is empty.", param=param, code="invalid_image")
        if w * h > limits.max_pixels:
            raise _too_many_pixels(f"{w}x{h} = {w * h:,}", param, limits)
        try:
            img.seek(0)
            rgb = img.convert("RGB")
            pixels = rgb.tobytes()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise InvalidRequest(f"The image is truncated or corrupt ({exc}).", param=param,
                                 code="invalid_image") from None
    return MediaInput("image", hashlib.sha256(raw).hexdigest(), pixels, w, h)


def _too_many_pixels(what: str, param: str, limits: MediaLimits) -> InvalidRequest:
    return InvalidRequest(f"The image has {what} pixels; at most {limits.max_pixels:,} are allowed "
                          "(--max-image-pixels).", param=param, code="image_too_large")


def load_images(handle: Any, refs: list[ImageRef]) -> list[MediaInput]:
    """Every image of a request, checked against the model and the limits, decoded, in order."""
    require_images(handle, refs)
    limits = limits_of(handle)
    return [decode_image(url_bytes(r.url, r.param, limits), r.param, limits) for r in refs]


def marker(n: int) -> str:
    """The text that stands for image number ``n`` of a request in its messages and rendered prompt."""
    return f"<__octo_media_{_TOKEN}_{n}__>"


def join_parts(parts: list[str | int]) -> str:
    """A message's content parts as one text, as llama-server joins them when a message holds media: text parts
    separated by a newline, an image (its number in the request, an int) as its :func:`marker` with no newline before
    or after it."""
    out: list[str] = []
    last_media = False
    for p in parts:
        if isinstance(p, int):
            out.append(marker(p))
            last_media = True
            continue
        if out and not last_media:
            out.append("\n")
        out.append(p)
        last_media = False
    return "".join(out)


def tokenize(engine: Any, prompt: str, images: list[MediaInput],
             dropped_ok: bool = False) -> tuple[list[int], tuple[MediaChunk, ...]]:
    """The prompt tokens and media chunks of a rendered prompt with ``images`` at their markers. Every image must be
    placed once (``dropped_ok``: an image whose message was cut from the prompt, as Ollama truncates, is left out)."""
    pieces = _MARKER.split(prompt)
    placed = [int(n) for n in pieces[1::2]]
    if len(set(placed)) != len(placed) or any(n >= len(images) for n in placed) or \
            (not dropped_ok and len(placed) != len(images)):
        raise InvalidRequest(f"The model's chat template placed {len(placed)} of the request's {len(images)} images "
                             "(it leaves out the messages that hold the others, or shows one twice).",
                             param="messages")
    parts: list[str | MediaInput] = [pieces[0]]
    for n, text in zip(placed, pieces[2::2], strict=True):
        parts += [images[n], text]
    tokens, chunks = engine.tokenize_media([p for p in parts if not isinstance(p, str) or p])
    return tokens, tuple(chunks)
