"""Images through the OpenAI API against a real `octo serve demo-vision` (the synthetic Gemma 3, llama.cpp with its
projector), with the official openai SDK: image_url data URLs answered (the answer depends on the image, streamed
and not), several images, a second turn that reuses the image's KV, usage counting image tokens, a 400 naming the
part for each kind of bad image, and a text-only model that refuses images naming the model."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402
from serverproc import run_octo  # noqa: E402

MODEL = "demo-vision"
IMAGE_TOKENS = 16  # demo-vision: 64x64 pixels in 8x8 patches, pooled 2x2


def png(color=(255, 0, 0), size=(80, 60), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def ask(client, *parts, text: str = "What is this?", history: list | None = None, **kw):
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in parts)]
    messages = [*(history or []), {"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **kw)


@pytest.fixture(scope="module")
def server():
    with run_octo(MODEL, timeout=600) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_an_image_is_answered_and_the_answer_depends_on_it(client):
    red, blue = data_url(png((255, 0, 0))), data_url(png((0, 0, 255)))
    r1, r2, r3 = ask(client, red), ask(client, blue), ask(client, red)
    assert r1.choices[0].message.content and r1.choices[0].finish_reason == "length"
    assert r1.choices[0].message.content != r2.choices[0].message.content
    assert r1.choices[0].message.content == r3.choices[0].message.content
    details = r1.usage.prompt_tokens_details
    assert details.image_tokens == IMAGE_TOKENS and r1.usage.prompt_tokens > IMAGE_TOKENS


def test_a_streamed_answer_is_the_same(client):
    url = data_url(png((0, 128, 0)))
    whole = ask(client, url).choices[0].message.content
    chunks = list(ask(client, url, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS


def test_several_images_in_a_message_and_across_turns(client):
    a, b = data_url(png((10, 20, 30))), data_url(png((200, 100, 0)))
    two = ask(client, a, b)
    assert two.usage.prompt_tokens_details.image_tokens == 2 * IMAGE_TOKENS
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": a}}]},
               {"role": "assistant", "content": "A picture."}]
    later = ask(client, b, history=history, text="And this one?")
    assert later.usage.prompt_tokens_details.image_tokens == 2 * IMAGE_TOKENS


def test_a_second_turn_about_the_same_image_reuses_its_kv(client):
    url = data_url(png((90, 40, 160)))
    first = ask(client, url, text="Describe the picture in detail, please.")
    history = [{"role": "user", "content": [{"type": "text", "text": "Describe the picture in detail, please."},
                                            {"type": "image_url", "image_url": {"url": url}}]},
               {"role": "assistant", "content": first.choices[0].message.content}]
    second = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                            messages=[*history, {"role": "user", "content": "What colour is it?"}])
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def _bomb(side: int) -> bytes:
    """A small PNG whose header claims side x side pixels."""
    raw = bytearray(png(size=(8, 8)))
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4:ihdr + 12] = struct.pack(">II", side, side)
    raw[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(raw[ihdr:ihdr + 17])))
    return bytes(raw)


@pytest.mark.parametrize("url, code, words", [
    (data_url(b"hello, this is not an image"), "invalid_image", "not an image"),
    (data_url(png(size=(300, 300))[:200]), "invalid_image", "truncated"),
    (data_url(png(fmt="TIFF"), "image/tiff"), "unsupported_image_format", "Unsupported image format TIFF"),
    (data_url(_bomb(8000)), "image_too_large", "8000x8000 = 64,000,000 pixels; at most 33,554,432"),
    (data_url(_bomb(20000)), "image_too_large", "--max-image-pixels"),  # (past Pillow's own bound too)
    ("http://example.com/cat.png", "remote_image_url", "--allow-image-urls"),
    ("data:image/png;base64,@@@not base64@@@", "invalid_image_url", "base64"),
    ("data:image/png,rawbytes", "invalid_image_url", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image", "text/plain"),
    ("cat.png", "invalid_image_url", "data URL"),
])
def test_a_bad_image_is_a_400_naming_its_part(client, url, code, words):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, data_url(png()), url)
    body = err.value.body
    assert body["param"] == "messages[0].content[2]" and body["code"] == code, body
    assert words in body["message"]


def test_malformed_image_parts_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {}}]}])
    assert err.value.body["param"] == "messages[0].content[0].image_url.url"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(png())}}]},
            {"role": "user", "content": "hi"}])
    body = err.value.body
    assert body["param"] == "messages[0].content[0]" and "user and tool messages only" in body["message"]


def test_the_image_limits_are_the_flags():
    with run_octo(MODEL, "--max-images", "1", "--max-image-mb", "0.002", timeout=600) as s:
        client = s.openai()
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, data_url(png()), data_url(png((0, 0, 9))))
        assert err.value.body["param"] == "messages[0].content[2]" and "--max-images" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, data_url(png(size=(64, 64), fmt="BMP"), "image/bmp"))  # 12 KB
        assert err.value.body["code"] == "image_too_large" and "--max-image-mb" in err.value.body["message"]
        assert ask(client, data_url(png())).usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS


def test_a_text_only_model_refuses_an_image_naming_the_model():
    with run_octo(MODEL, "--mmproj", "none", timeout=600) as s:
        with pytest.raises(openai.BadRequestError) as err:
            ask(s.openai(), data_url(png()))
        body = err.value.body
        assert body["code"] == "model_not_multimodal" and body["param"] == "messages[0].content[1]"
        assert f"Model '{MODEL}' does not take images" in body["message"]
        assert s.openai().chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hello"}]).choices[0].message.content is not None
