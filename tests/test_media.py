"""octo.serving.media: data URLs, Pillow's checks and decoding, the limits, the parts joined as llama-server joins
them, and the rendered prompt cut at its images."""

from __future__ import annotations

import base64
import hashlib
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from octo.engine import ModelInfo
from octo.errors import InvalidRequest
from octo.serving import media
from octo.serving.media import ImageRef, MediaLimits

LIMITS = MediaLimits()


def encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def test_a_data_url_gives_its_bytes_and_the_digest_is_of_those_bytes():
    raw = encoded(Image.new("RGB", (5, 4), (1, 2, 3)))
    assert media.url_bytes(url(raw), "p", LIMITS) == raw
    assert media.url_bytes(url(raw, "image/png;name=x.png"), "p", LIMITS) == raw  # parameters before ;base64
    img = media.decode_image(raw, "p", LIMITS)
    assert (img.width, img.height, img.digest) == (5, 4, hashlib.sha256(raw).hexdigest())
    assert img.data == bytes([1, 2, 3]) * 20


def test_the_byte_limit_is_checked_before_decoding():
    raw = encoded(Image.effect_noise((200, 200), 50))
    small = MediaLimits(max_bytes=len(raw) - 1)
    with pytest.raises(InvalidRequest, match="--max-image-mb") as err:
        media.url_bytes(url(raw), "messages[0].content[0]", small)
    assert err.value.param == "messages[0].content[0]" and err.value.code == "image_too_large"
    assert media.url_bytes(url(raw), "p", MediaLimits(max_bytes=len(raw))) == raw


@pytest.mark.parametrize("make", [
    lambda: Image.new("RGBA", (3, 2), (10, 20, 30, 0)),  # alpha dropped, as llama-server's stb_image does
    lambda: Image.new("P", (3, 2), 7),
    lambda: Image.new("L", (3, 2), 99),
])
def test_any_mode_becomes_rgb(make):
    img = make()
    out = media.decode_image(encoded(img), "p", LIMITS)
    assert out.data == img.convert("RGB").tobytes() and len(out.data) == 3 * 3 * 2


def test_an_animated_gif_gives_its_first_frame_and_jpeg_webp_bmp_are_read():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    raw = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    first = media.decode_image(raw, "p", LIMITS).data[:3]
    assert first[0] > 200 and first[2] < 50
    for fmt in ("JPEG", "WEBP", "BMP"):
        assert media.decode_image(encoded(Image.new("RGB", (4, 4)), fmt), "p", LIMITS).width == 4


def test_a_model_without_images_and_too_many_images_are_refused():
    refs = [ImageRef(f"messages[0].content[{i}]", "data:,") for i in range(3)]
    text_only = SimpleNamespace(name="m", info=ModelInfo("m", 100), engine_name="llamacpp")
    with pytest.raises(InvalidRequest, match="Model 'm' does not take images.*--mmproj") as err:
        media.load_images(text_only, refs)
    assert err.value.param == "messages[0].content[0]"
    vision = SimpleNamespace(name="v", info=ModelInfo("v", 100, media=frozenset({"image"})),
                             media_limits=MediaLimits(max_images=2))
    with pytest.raises(InvalidRequest, match="3 images; at most 2 .*--max-images") as err:
        media.load_images(vision, refs)
    assert err.value.param == "messages[0].content[2]"


def test_parts_join_as_llama_server_joins_them():
    m = media.marker
    assert media.join_parts(["a", "b"]) == "a\nb"
    assert media.join_parts(["a", 0, "b"]) == f"a{m(0)}b"
    assert media.join_parts([3, "a", "b", 4, 5]) == f"{m(3)}a\nb{m(4)}{m(5)}"


def test_the_prompt_is_cut_at_its_images_and_a_lost_image_is_an_error():
    seen = []

    class Engine:
        def tokenize_media(self, parts):
            seen.append(parts)
            return [1, 2, 3], []

    a, b = (media.decode_image(encoded(Image.new("RGB", (2, 2), c)), "p", LIMITS) for c in ((1, 1, 1), (2, 2, 2)))
    m = media.marker
    media.tokenize(Engine(), f"x{m(0)}y{m(1)}", [a, b])
    assert seen[-1] == ["x", a, "y", b]
    media.tokenize(Engine(), f"{m(1)}y{m(0)}", [a, b])  # each image where its marker is, in any order
    assert seen[-1] == [b, "y", a]
    for prompt in (f"x{m(0)}y", f"x{m(0)}y{m(0)}", f"x{m(0)}y{m(2)}"):  # one lost, one twice, one not sent
        with pytest.raises(InvalidRequest, match="of the request's 2 images"):
            media.tokenize(Engine(), prompt, [a, b])
    media.tokenize(Engine(), f"x{m(1)}", [a, b], dropped_ok=True)  # (Ollama's truncation cut the first)
    assert seen[-1] == ["x", b]
    media.tokenize(Engine(), "x<__octo_media_0__>", [])  # a client's text cannot place an image: the token is secret
    assert seen[-1] == ["x<__octo_media_0__>"]
