"""Images through every API against a real `octo serve demo-vision` (the synthetic Gemma 3 on llama.cpp with its
projector), each with its official client: openai (Responses, streamed and not; chat is
tests/test_vision_functional.py), anthropic (image blocks in a user turn and in a tool result, streamed and not,
count_tokens), ollama (``images=`` on chat and generate). On each: greedy output depends on the image (a red and a
blue picture give different first tokens, the same picture the same answer), a stream says what the whole answer
says, a second turn about the same picture reuses its KV, a bad image is a 400 naming it, a remote URL is a 400
naming --allow-image-urls, and a text-only model (--mmproj none) refuses an image naming itself."""

from __future__ import annotations

import base64

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

from serverproc import run_octo  # noqa: E402
from test_vision_functional import IMAGE_TOKENS, MODEL, _bomb, data_url, png  # noqa: E402

RED, BLUE = png((255, 0, 0)), png((0, 0, 255))  # (their first greedy tokens differ on demo-vision)
Q = "What is this?"
GREEDY = {"temperature": 0}  # (the anthropic SDK no longer takes temperature as an argument; the API does)
# a bad image on each API, and the words its 400 says (tests/test_vision_functional.py has every case on chat)
BAD = [(b"hello, this is not an image", "not an image"), (png(size=(300, 300))[:200], "truncated"),
       (_bomb(8000), "--max-image-pixels"), (png(fmt="TIFF"), "Unsupported image format TIFF")]


@pytest.fixture(scope="module")
def server():
    with run_octo(MODEL, timeout=600) as s:
        yield s


@pytest.fixture(scope="module")
def text_only():
    with run_octo(MODEL, "--mmproj", "none", timeout=600) as s:
        yield s


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# -- Responses ------------------------------------------------------------------------------------------------------
def responses_input(raw: bytes | None = None, url: str | None = None) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": Q},
                                         {"type": "input_image", "image_url": url or data_url(raw), "detail": "auto"}]}]


def test_responses(server):
    client = server.openai()

    def ask(raw, n=6, **kw):
        return client.responses.create(model=MODEL, input=responses_input(raw), max_output_tokens=n, temperature=0,
                                       **kw)
    red, blue = ask(RED, 1).output_text, ask(BLUE, 1).output_text
    assert red and blue and red != blue  # the first token depends on the image
    whole = ask(RED)
    assert whole.output_text.startswith(red) and whole.usage.input_tokens_details.image_tokens == IMAGE_TOKENS
    events = list(ask(RED, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.usage.input_tokens == whole.usage.input_tokens
    # a second turn about the same picture, from the stored conversation: its KV comes from the prefix cache
    second = client.responses.create(model=MODEL, previous_response_id=whole.id, input="And its colour?",
                                     max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 1
    assert second.usage.input_tokens_details.image_tokens == IMAGE_TOKENS


def test_responses_bad_images(server):
    client = server.openai()
    for raw, words in BAD:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input=responses_input(raw), max_output_tokens=2)
        assert err.value.body["param"] == "input[0].content[1]" and words in err.value.body["message"], raw[:20]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=responses_input(url="https://example.com/cat.png"))
    assert err.value.body["code"] == "remote_image_url" and "--allow-image-urls" in err.value.body["message"]


# -- Anthropic ------------------------------------------------------------------------------------------------------
def image_block(raw: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(raw)}}


def test_anthropic(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)

    def messages(raw):
        return [{"role": "user", "content": [{"type": "text", "text": Q}, image_block(raw)]}]
    red = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, messages=messages(RED))
    blue = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, messages=messages(BLUE))
    assert red.content[0].text != blue.content[0].text
    whole = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=messages(RED))
    with client.messages.stream(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=messages(RED)) as stream:
        assert stream.get_final_text() == whole.content[0].text
        final = stream.get_final_message()
    counted = client.messages.count_tokens(model=MODEL, messages=messages(RED)).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted > IMAGE_TOKENS
    assert final.usage.cache_read_input_tokens >= counted - 1  # the same picture again: from the prefix cache
    # a screenshot in a tool result (as Claude Code sends them): it changes the answer
    tools = [{"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}]

    def after_tool(raw):
        return client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, tools=tools, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [image_block(raw)]}]}])
    assert after_tool(RED).content[0].text != after_tool(BLUE).content[0].text


def test_anthropic_bad_images(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    for raw, words in BAD:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": Q}, image_block(raw)]}])
        message = err.value.body["error"]["message"]
        assert message.startswith("messages.0.content.1: ") and words in message, message
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "--allow-image-urls" in err.value.body["error"]["message"]


# -- Ollama ---------------------------------------------------------------------------------------------------------
def test_ollama(server):
    client = ollama.Client(host=server.base_url)
    opts = {"temperature": 0, "num_predict": 1}

    def chat(raw, **kw):
        return client.chat(model=MODEL, messages=[{"role": "user", "content": Q, "images": [raw]}],
                           options={**opts, **kw})
    assert chat(RED).message.content != chat(BLUE).message.content
    whole = chat(RED, num_predict=6)
    streamed = client.chat(model=MODEL, messages=[{"role": "user", "content": Q, "images": [RED]}], stream=True,
                           options={**opts, "num_predict": 6})
    assert "".join(c.message.content for c in streamed) == whole.message.content
    assert whole.prompt_eval_count > IMAGE_TOKENS
    red = client.generate(model=MODEL, prompt=Q, images=[RED], options=opts).response
    assert red != client.generate(model=MODEL, prompt=Q, images=[BLUE], options=opts).response
    # a second turn about the picture reuses its KV (Ollama's answer has no cached count: the server's stats)
    before = server.get_json("/v1/cache/stats")["tokens_reused"]
    client.chat(model=MODEL, options=opts, messages=[{"role": "user", "content": Q, "images": [RED]},
                                                     {"role": "assistant", "content": whole.message.content},
                                                     {"role": "user", "content": "And its colour?"}])
    assert server.get_json("/v1/cache/stats")["tokens_reused"] - before >= IMAGE_TOKENS


def test_ollama_bad_images(server):
    client = ollama.Client(host=server.base_url)
    for raw, words in BAD:
        with pytest.raises(ollama.ResponseError) as err:
            client.chat(model=MODEL, messages=[{"role": "user", "content": Q, "images": [raw]}])
        assert err.value.status_code == 400 and err.value.error.startswith("messages[0].images[0]: ")
        assert words in err.value.error, err.value.error
        with pytest.raises(ollama.ResponseError) as err:
            client.generate(model=MODEL, prompt=Q, images=[raw])
        assert err.value.error.startswith("images[0]: ") and words in err.value.error


# -- a text-only model ----------------------------------------------------------------------------------------------
def test_a_text_only_model_refuses_images_on_every_api(text_only):
    named = f"Model '{MODEL}' does not take images"
    with pytest.raises(openai.BadRequestError) as err:
        text_only.openai().responses.create(model=MODEL, input=responses_input(RED))
    assert err.value.body["code"] == "model_not_multimodal" and named in err.value.body["message"]
    assert err.value.body["param"] == "input[0].content[1]"
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic.Anthropic(base_url=text_only.base_url, api_key="none", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [image_block(RED)]}])
    assert err.value.body["error"]["message"].startswith(f"messages.0.content.0: {named}")
    client = ollama.Client(host=text_only.base_url)
    for call in (lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": Q, "images": [RED]}]),
                 lambda: client.generate(model=MODEL, prompt=Q, images=[RED])):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 400 and named in err.value.error
    assert "vision" not in client.show(MODEL).capabilities
    assert text_only.get_json("/v1/models")["data"][0]["capabilities"] == ["completion"]


def test_the_capabilities_say_vision(server):
    assert "vision" in ollama.Client(host=server.base_url).show(MODEL).capabilities
    assert server.get_json(f"/v1/models/{MODEL}")["capabilities"] == ["completion", "vision"]


def test_the_readmes_image_example_runs_as_written(server, tmp_path):
    """The README's openai example, as written (the port aside), with a photo.png beside it."""
    import re
    import subprocess
    import sys

    from serverproc import REPO

    block = re.search(r"```python\n(import base64\nfrom openai import OpenAI\n.*?)```",
                      (REPO / "README.md").read_text(), re.S)
    assert block and "demo-vision" in block.group(1), "the README's image example changed: update this test"
    (tmp_path / "photo.png").write_bytes(RED)
    code = block.group(1).replace("127.0.0.1:8080", f"127.0.0.1:{server.port}")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(IMAGE_TOKENS) and len(out.stdout.split()) > 1, out.stdout
