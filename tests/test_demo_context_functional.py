"""The demo model has a context real models have (32,768 positions), in every engine's build, so that a chat client's
first message fits: Open WebUI's default chat sends its 36 built-in tool definitions with every message, about
17,800 of the demo's tokens. Such a request answers on /api/chat (the ollama client) and on /v1/chat/completions (the
openai SDK) against a real `octo serve demo` (ONNX, the engine this host's benchmark picks most often and the
quickest to prefill it); with a smaller ``num_ctx`` Ollama's route still answers (truncated), the OpenAI route's 400
stays for a prompt past the context."""

from __future__ import annotations

import json

import pytest
from serverproc import run_octo

TOOLS = 36


def tools() -> list[dict]:
    """36 function tools shaped like Open WebUI's built-in ones: a description and a few typed, described
    parameters each."""
    out = []
    for i in range(TOOLS):
        props = {f"argument_{j}": {"type": ("string", "integer", "boolean")[j % 3],
                                   "description": f"The {j}th setting of tool {i}: what it selects."}
                 for j in range(5)}
        out.append({"type": "function", "function": {
            "name": f"builtin_tool_{i}",
            "description": f"Built-in tool number {i}: searches the user's notes, chats, knowledge bases and files "
                           "for what the question needs, and returns the matching passages with their sources.",
            "parameters": {"type": "object", "properties": props, "required": ["argument_0"]}}})
    return out


def test_every_engine_builds_the_demo_with_a_32k_context():
    from octo.synth.spec import get_spec

    assert get_spec("demo").max_position_embeddings == 32768
    pytest.importorskip("transformers", reason="the synthetic builders need the synth extra")
    from octo.synth.build import build_for

    hf = build_for("demo", "echo")  # the Hugging Face folder every other format is built from
    assert json.loads((hf / "config.json").read_text())["max_position_embeddings"] == 32768
    try:
        from octo.models.formats import gguf_metadata

        gguf = build_for("demo", "llamacpp")
        assert gguf_metadata(gguf)["qwen2.context_length"] == 32768
    except ImportError:
        pass


@pytest.fixture(scope="module")
def demo():
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the onnx extra)")
    with run_octo("demo", "--engine", "onnx", timeout=600) as server:
        yield server


def test_open_webuis_default_chat_fits_the_demo_on_both_routes(demo):
    import ollama

    question = [{"role": "user", "content": "What is in my notes about the trip?"}]
    c = ollama.Client(host=demo.base_url, timeout=600)
    r = c.chat(model="demo:latest", messages=question, tools=tools(), options={"num_predict": 4})
    assert r.done and 16_000 < r.prompt_eval_count < 32_768, r.prompt_eval_count
    assert c.ps().models[0].context_length == 32768
    oa = demo.openai(timeout=600)
    chat = oa.chat.completions.create(model="demo", messages=question, tools=tools(), max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert 16_000 < chat.usage.prompt_tokens < 32_768 and chat.choices[0].finish_reason == "length"  # whole
    # a smaller window: Ollama's route cuts the prompt to fit and answers
    small = c.chat(model="demo", messages=question, tools=tools(), options={"num_predict": 2, "num_ctx": 8192})
    assert small.done and small.prompt_eval_count < 8192
