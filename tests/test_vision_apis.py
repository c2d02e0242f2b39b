"""Images through every API shape, in process, with a scripted engine that takes them (the picture engine of
tests/test_media_scheduler.py: its reply echoes the last user turn with each image as ``img:<sha256[:8]>`` where the
image stands): OpenAI chat ``image_url``, Responses ``input_image`` (messages, function call outputs, a stored
conversation and its input items), Anthropic ``image`` blocks (user turns, tool results, count_tokens), Ollama
``images`` (chat, generate, ``[img]`` placement, truncation), each image where its part was and a bad one a 400
naming its part. The same requests against llama.cpp's real model are tests/test_vision_apis_functional.py."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from PIL import Image
from test_media_scheduler import PictureEngine

MODEL = "pic"


def png(color=(255, 0, 0), size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def url(raw: bytes) -> str:
    return "data:image/png;base64," + b64(raw)


def word(raw: bytes) -> str:
    return "img:" + hashlib.sha256(raw).hexdigest()[:8]


def make_app(tmp_path, monkeypatch, engine=None, **config):
    from octo.config import ServerConfig
    from octo.engine import EngineConfig
    from octo.runtime.model import ModelHandle
    from octo.server.app import create_app

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    engine = engine or PictureEngine(EngineConfig())
    engine.load("pic", MODEL)
    return create_app(ServerConfig(model=MODEL, **config), ModelHandle(MODEL, (), "echo", engine, "x"))


@pytest.fixture
async def client(aiohttp_client, tmp_path, monkeypatch):
    return await aiohttp_client(make_app(tmp_path, monkeypatch))


async def post(client, path: str, body: dict, status: int = 200) -> dict:
    r = await client.post(path, json={"model": MODEL, **body})
    out = await r.json()
    assert r.status == status, out
    return out


# -- OpenAI chat --------------------------------------------------------------------------------------------------
async def test_chat_images_stand_where_their_parts_are(client):
    out = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(RED)}}, {"type": "text", "text": "then"},
        {"type": "image_url", "image_url": {"url": url(BLUE), "detail": "low"}}]}]})
    # (no newline next to an image, as llama-server joins parts: the echoed word follows the image at once)
    assert out["choices"][0]["message"]["content"] == f"{word(RED)}then {word(BLUE)}"
    n_red = 3 + 8 % 4  # the picture engine: 3 + width % 4 positions per image
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 2 * n_red


async def test_a_tool_message_may_hold_a_picture_and_models_list_vision(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    out = await post(client, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "take one"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": {"url": url(RED)}}]},
        {"role": "user", "content": "and?"}]})
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 3
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["capabilities"] == ["completion", "vision"]
    bad = await post(client, "/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url(RED)}}]},
        {"role": "user", "content": "x"}]}, 400)
    assert bad["error"]["param"] == "messages[0].content[0]" and "user and tool messages" in bad["error"]["message"]


# -- Responses ----------------------------------------------------------------------------------------------------
def image_item(raw: bytes | None = None, **kw) -> dict:
    return {"type": "input_image", "detail": "auto", **({"image_url": url(raw)} if raw else {}), **kw}


async def test_responses_input_image(client):
    out = await post(client, "/v1/responses", {"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "look"}, image_item(RED)]}]})
    assert out["output"][0]["content"][0]["text"] == f"look {word(RED)}"
    assert out["usage"]["input_tokens_details"]["image_tokens"] == 3
    # a second turn: the stored conversation keeps the picture; a new one is added
    more = await post(client, "/v1/responses", {"previous_response_id": out["id"], "instructions": "be brief",
                                                 "input": [
        {"role": "user", "content": [image_item(BLUE, detail="original"), {"type": "input_text", "text": "and"}]}]})
    assert more["output"][0]["content"][0]["text"] == f"{word(BLUE)}and"
    assert more["usage"]["input_tokens_details"]["image_tokens"] == 6
    assert more["usage"]["input_tokens_details"]["cached_tokens"] > 3  # the first turn's image too
    items = await (await client.get(f"/v1/responses/{more['id']}/input_items?order=asc")).json()
    first = items["data"][0]["content"]
    assert first[0] == {"type": "input_text", "text": "look"}
    assert first[1] == {"type": "input_image", "image_url": None, "file_id": None, "detail": "auto"}
    items = await (await client.get(f"/v1/responses/{more['id']}/input_items?order=asc&"
                                    "include=message.input_image.image_url")).json()
    assert items["data"][0]["content"][1]["image_url"] == url(RED)


async def test_responses_function_call_output_image(client):
    out = await post(client, "/v1/responses", {"input": [
        {"role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [image_item(RED)]},
        {"role": "user", "content": "what is on it?"}],
        "tools": [{"type": "function", "name": "shot", "parameters": {"type": "object"}}]})
    assert out["usage"]["input_tokens_details"]["image_tokens"] == 3


@pytest.mark.parametrize("part, param, code", [
    (image_item(file_id="file-1"), "input[1].content[1].file_id", "unsupported_parameter"),
    (image_item(), "input[1].content[1].image_url", "missing_required_parameter"),
    (image_item(b"not a picture"), "input[1].content[1]", "invalid_image"),
    ({"type": "input_image", "image_url": "https://example.com/a.png"}, "input[1].content[1]", "remote_image_url"),
    (image_item(RED, detail="huge"), "input[1].content[1].detail", "invalid_value"),
])
async def test_responses_bad_images_name_their_part(client, part, param, code):
    look = {"role": "user", "content": [{"type": "input_text", "text": "look"}, part]}
    out = await post(client, "/v1/responses", {"instructions": "x", "input": [{"role": "user", "content": "hi"}, look]},
                     400)  # (messages[2] in the chat request)
    assert (out["error"]["param"], out["error"]["code"]) == (param, code), out


# -- Anthropic ----------------------------------------------------------------------------------------------------
def block(raw: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(raw)}}


async def test_anthropic_image_blocks_and_tool_results(client):
    out = await post(client, "/v1/messages", {"max_tokens": 20, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"}, block(RED)]}]})
    assert out["content"][0]["text"] == f"see {word(RED)}"
    turns = [{"role": "user", "content": "take one"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                 {"type": "text", "text": "here"}, block(BLUE, "image/jpeg")]},  # (a wrong media type: read anyway)
                 {"type": "text", "text": "and this"}, block(RED)]}]
    tools = [{"name": "shot", "input_schema": {"type": "object"}}]
    out = await post(client, "/v1/messages", {"max_tokens": 20, "messages": turns, "tools": tools})
    text = out["content"][0]["text"]  # (the echo model's template has no tool turns: the result is a user turn)
    assert text.index(f"here {word(BLUE)}") < text.index(f"and this {word(RED)}"), text
    count = await post(client, "/v1/messages/count_tokens", {"messages": turns, "tools": tools})
    assert count["input_tokens"] == out["usage"]["input_tokens"] > 6


@pytest.mark.parametrize("content, start", [
    ([{"type": "text", "text": "x"}, block(b"nope")], "messages.0.content.1: The data is not an image"),
    ([{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
     "messages.0.content.0: Remote image URLs are off on this server: start it with --allow-image-urls"),
    ([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}], "'messages[0].content[0].source' is not"),
    ([{**block(RED), "transformations": {"oversized_image": "error"}}],
     "'messages[0].content[0].transformations.oversized_image' is not supported"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": b64(RED)}}],
     "messages[0].content[0].source.media_type"),
])
async def test_anthropic_bad_images_name_their_block(client, content, start):
    out = await post(client, "/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": content}]},
                     400)
    assert out["type"] == "error" and start in out["error"]["message"], out


# -- Ollama -------------------------------------------------------------------------------------------------------
async def test_ollama_images_chat_and_generate(client):
    out = await post(client, "/api/chat", {"stream": False, "messages": [
        {"role": "user", "content": "two [img] pictures", "images": [b64(RED), b64(BLUE)]}]})
    # image 0 at the placeholder, the one beyond the placeholders before the text (Ollama's chatPrompt)
    assert out["message"]["content"] == f"{word(BLUE)}two {word(RED)} pictures"
    assert out["prompt_eval_count"] > 6
    out = await post(client, "/api/generate", {"stream": False, "prompt": "what", "images": [url(RED)]})
    assert out["response"] == f"{word(RED)}what"  # (a data URL is taken too)
    out = await post(client, "/api/generate", {"stream": False, "prompt": "x", "images": ["@@@"]}, 400)
    assert out["error"].startswith("images[0]: Invalid image URL: its data is not valid base64"), out
    out = await post(client, "/api/chat", {"stream": False, "messages": [
        {"role": "user", "content": "x", "images": [b64(b"GIF89a")]}]}, 400)
    assert out["error"].startswith("messages[0].images[0]: The "), out


async def test_ollama_truncation_drops_an_old_image_with_its_message(client):
    old = [{"role": "user", "content": "old " * 30, "images": [b64(RED)]}, {"role": "assistant", "content": "ok"}]
    out = await post(client, "/api/chat", {"stream": False, "options": {"num_ctx": 40}, "messages": [
        *old, {"role": "user", "content": "new", "images": [b64(BLUE)]}]})
    assert out["message"]["content"] == f"{word(BLUE)}new" and out["prompt_eval_count"] < 20


async def test_a_text_only_model_names_itself_on_every_api(aiohttp_client, tmp_path, monkeypatch):
    from octo.engines.echo import EchoEngine

    from octo.engine import EngineConfig

    c = await aiohttp_client(make_app(tmp_path, monkeypatch, EchoEngine(EngineConfig())))
    for path, body, where in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url(RED)}}]}]}, "messages[0].content[0]"),
        ("/v1/responses", {"input": [{"role": "user", "content": [image_item(RED)]}]}, "input[0].content[0]"),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [block(RED)]}]},
         "messages.0.content.0"),
        ("/api/chat", {"stream": False, "messages": [{"role": "user", "content": "x", "images": [b64(RED)]}]},
         "messages[0].images[0]"),
        ("/api/generate", {"stream": False, "prompt": "x", "images": [b64(RED)]}, "images[0]"),
    ]:
        out = await post(c, path, body, 400)
        err = out["error"]
        text = err if isinstance(err, str) else err["message"]
        assert f"Model '{MODEL}' does not take images" in text, (path, out)
        assert where in (text if isinstance(err, str) or "param" not in err else err["param"]), (path, out)
    models = await (await c.get("/v1/models")).json()
    assert models["data"][0]["capabilities"] == ["completion"]


async def test_the_limits_name_the_part_on_every_api(aiohttp_client, tmp_path, monkeypatch):
    c = await aiohttp_client(make_app(tmp_path, monkeypatch, max_images=1, max_image_mb=0.0005))  # 524 bytes
    buf = io.BytesIO()
    noise = hashlib.shake_256(b"noise").digest(32 * 32 * 3)  # (fixed bytes that do not compress)
    Image.frombytes("RGB", (32, 32), noise).save(buf, "PNG")
    big = buf.getvalue()
    assert len(big) > 524 >= len(RED)
    for path, body, where in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url(u)}} for u in (RED, BLUE)]}]}, "messages[0].content[1]"),
        ("/v1/responses", {"input": [{"role": "user", "content": [image_item(RED), image_item(BLUE)]}]},
         "input[0].content[1]"),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [block(RED), block(BLUE)]}]},
         "messages.0.content.1"),
        ("/api/chat", {"stream": False, "messages": [{"role": "user", "content": "x", "images": [b64(RED)]},
                                                     {"role": "user", "content": "y", "images": [b64(BLUE)]}]},
         "messages[1].images[0]"),
    ]:
        out = await post(c, path, body, 400)
        err = out["error"]
        text, param = (err, None) if isinstance(err, str) else (err["message"], err.get("param"))
        assert "--max-images" in text and where in (param or text), (path, out)
    out = await post(c, "/api/generate", {"stream": False, "prompt": "x", "images": [b64(big)]}, 400)
    assert out["error"].startswith("images[0]: The image has") and "--max-image-mb" in out["error"], out
