"""Images on MLX through a real `octo serve demo-vision --engine mlx` (the synthetic Gemma 3 written by mlx-vlm's
converter), with the official openai SDK: the engine worker serves the vision model without torch, the answer
depends on the image (streamed and not), usage counts the image's tokens as the GGUF's projector does, and a second
turn about the same image reuses its KV."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install 'octo[mlx]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402
from serverproc import run_octo  # noqa: E402

MODEL = "demo-vision"
IMAGE_TOKENS = 16  # demo-vision: 64x64 pixels in 8x8 patches, pooled 2x2


def data_url(color, size=(80, 60)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def ask(client, *urls, text: str = "What is this?", history: list | None = None, **kw):
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    messages = [*(history or []), {"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **kw)


@pytest.fixture(scope="module")
def server():
    with run_octo(MODEL, "--engine", "mlx", timeout=600) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_the_mlx_worker_serves_the_vision_model_without_torch(server):
    body = server.get_json("/v1/engines")
    assert body["active"] == "mlx"
    entry = server.get_json("/v1/models")["data"][0]
    assert entry["id"] == MODEL and entry["isolation"] == "process"
    maps = Path(f"/proc/{entry['worker']['pid']}/maps").read_text()
    assert "libmlx" in maps and "libtorch" not in maps  # mlx-vlm's processor runs without torch too


def test_an_image_is_answered_and_the_answer_depends_on_it(client):
    red, blue = data_url((255, 0, 0)), data_url((0, 0, 255))
    r1, r2, r3 = ask(client, red), ask(client, blue), ask(client, red)
    assert r1.choices[0].message.content and r1.choices[0].finish_reason == "length"
    assert r1.choices[0].message.content != r2.choices[0].message.content
    assert r1.choices[0].message.content == r3.choices[0].message.content
    assert r1.usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS and r1.usage.prompt_tokens > IMAGE_TOKENS
    two = ask(client, red, blue)
    assert two.usage.prompt_tokens_details.image_tokens == 2 * IMAGE_TOKENS


def test_a_streamed_answer_is_the_same(client):
    url = data_url((0, 128, 0))
    whole = ask(client, url).choices[0].message.content
    chunks = list(ask(client, url, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS


def test_a_second_turn_about_the_same_image_reuses_its_kv(client):
    url = data_url((90, 40, 160))
    first = ask(client, url, text="Describe the picture in detail, please.")
    history = [{"role": "user", "content": [{"type": "text", "text": "Describe the picture in detail, please."},
                                            {"type": "image_url", "image_url": {"url": url}}]},
               {"role": "assistant", "content": first.choices[0].message.content}]
    second = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                            messages=[*history, {"role": "user", "content": "What colour is it?"}])
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
