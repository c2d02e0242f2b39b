"""The dashboard's playground with images, in a real headless Chromium (Playwright, the system's chromium, as
tests/test_dashboard_browser.py) against a real `octo serve` holding demo-vision (llama.cpp with its projector) and
an echo model that takes no images: the image picker shows for the vision model only; an image chosen with the file
picker and one pasted into the message go to the model as image_url data URLs (the greedy reply is the API's own for
the same request; the meta line counts their image tokens), and the second turn reuses the first picture's KV. A
screenshot goes to .cache/screenshots/playground-vision.png."""

from __future__ import annotations

import base64
import json

import pytest
from serverproc import run_octo
from test_dashboard_browser import SHOTS, _playwright, browser, expect  # noqa: F401 (the browser fixture)

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")

from test_vision_functional import IMAGE_TOKENS, png  # noqa: E402

RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = [{"model": "demo-vision"}, {"model": "test-model", "engine": "echo"}]
    path = tmp_path_factory.mktemp("dashv") / "models.yaml"
    path.write_text(json.dumps({"models": models}))
    with run_octo("--models-file", str(path), env={"HF_HUB_OFFLINE": "1"}, timeout=600) as s:
        yield s


def api_reply(server, content: list[dict]) -> str:
    status, body = server.post_json("/v1/chat/completions", {"model": "demo-vision", "max_tokens": 8,
                                                             "temperature": 0,
                                                             "messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_attach_and_paste_images_in_the_playground(browser, server, tmp_path):  # noqa: F811
    red = tmp_path / "red.png"
    red.write_bytes(RED)
    ctx = browser.new_context(viewport={"width": 1360, "height": 1000}, color_scheme="light")
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base_url + "/")
    page.get_by_role("tab", name="Playground").click()
    page.wait_for_selector('#chat-model option[value="demo-vision"]', state="attached")
    page.select_option("#chat-model", "test-model")
    expect(page.locator("#chat-attach")).to_be_hidden()  # a model that takes no images: no picker
    page.select_option("#chat-model", "demo-vision")
    expect(page.locator("#chat-attach")).to_be_visible()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")
    page.set_input_files("#chat-image", str(red))
    expect(page.locator("#chat-images img")).to_have_count(1)
    page.get_by_label("Message").fill("What is this?")
    page.get_by_role("button", name="Send").click()
    meta = page.locator(".msg.assistant .meta").first
    meta.wait_for(timeout=120_000)
    assert f"{IMAGE_TOKENS} image tokens" in meta.inner_text()
    reply = page.locator(".msg.assistant .text").first.inner_text()
    red_url = "data:image/png;base64," + base64.b64encode(RED).decode()
    assert reply == api_reply(server, [{"type": "text", "text": "What is this?"},
                                       {"type": "image_url", "image_url": {"url": red_url}}])
    expect(page.locator(".msg.user img")).to_have_count(1)
    expect(page.locator("#chat-images img")).to_have_count(0)  # sent: the picker is empty again
    # paste a second picture into the message (a clipboard event carrying a PNG file)
    page.evaluate("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "blue.png", { type: "image/png" }));
        const ev = new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true });
        document.getElementById("chat-input").dispatchEvent(ev);
    }""", base64.b64encode(BLUE).decode())
    expect(page.locator("#chat-images img")).to_have_count(1)
    page.get_by_label("Message").fill("And this one?")
    page.get_by_role("button", name="Send").click()
    second = page.locator(".msg.assistant .meta").nth(1)
    second.wait_for(timeout=120_000)
    text = second.inner_text()
    assert f"{2 * IMAGE_TOKENS} image tokens" in text and "prefix cache hit" in text, text  # the first picture's KV
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#chat-form").screenshot(path=str(SHOTS / "playground-vision.png"))
    ctx.close()
    assert not [e for e in errors if "Failed to load resource" not in e], errors
