"""The synthetic Qwen2.5-VL (octo.synth.qwen_vl, ``demo-vision-qwen``): a Hugging Face folder in the layout of Qwen's
checkpoints that transformers loads and runs, and the GGUF pair llama.cpp's converter writes from it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'octo[synth]')")


@pytest.fixture(scope="module")
def hf():
    from octo.synth.vision import build_vision_hf

    return build_vision_hf("demo-vision-qwen")


def test_the_folder_holds_what_a_qwen2_5_vl_checkpoint_holds(hf):
    from safetensors import safe_open

    from octo.synth.qwen_vl import VISION_TOKENS

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.json",
                 "preprocessor_config.json", "generation_config.json"):
        assert (hf / name).is_file(), name
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [8, 12, 12]}
    assert sum(config["rope_scaling"]["mrope_section"]) * 2 == config["hidden_size"] // config["num_attention_heads"]
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert {n.split(".")[0] for n in names} == {"visual", "model"} and "lm_head.weight" not in names  # tied, as 3B
    assert "visual.patch_embed.proj.weight" in names and "visual.merger.mlp.2.weight" in names
    tok = json.loads((hf / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert set(VISION_TOKENS) <= set(added)
    assert added["<|vision_start|>"] == config["vision_start_token_id"]
    assert added["<|image_pad|>"] == config["image_token_id"]


def test_transformers_runs_it_and_the_answer_depends_on_the_image(hf):
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tok, images = AutoTokenizer.from_pretrained(hf), AutoImageProcessor.from_pretrained(hf)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf)
    content = [{"type": "image"}, {"type": "text", "text": "What?"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>What?" in text
    outs = []
    for color in ((255, 0, 0), (0, 0, 255)):
        px = images(images=Image.new("RGB", (80, 60), color), return_tensors="pt")
        n = int(px["image_grid_thw"].prod()) // 4  # 2x2 patches merged into one token
        ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                                 max_new_tokens=6, do_sample=False)
        outs.append(out[0, ids["input_ids"].shape[1]:].tolist())
    assert outs[0] != outs[1]


def test_llama_cpps_converter_writes_a_qwen2vl_gguf_and_its_merger_projector():
    pytest.importorskip("llama_cpp", reason="the converter comes from the llama-cpp-python sdist")
    import gguf

    from octo.synth.vision import build_vision_gguf, gguf_paths

    build_vision_gguf("demo-vision-qwen")
    model, proj = gguf_paths("demo-vision-qwen")

    def field(path, key):
        return gguf.GGUFReader(str(path)).fields[key].contents()

    assert field(model, "general.architecture") == "qwen2vl" and field(model, "tokenizer.ggml.pre") == "qwen2"
    assert field(model, "qwen2vl.rope.dimension_sections") == [8, 12, 12, 0]
    assert field(proj, "clip.projector_type") == "qwen2.5vl_merger" and field(proj, "clip.vision.n_wa_pattern") == 2


def test_the_catalog_serves_demo_vision_qwen_on_llamacpp():
    from octo.models.catalog import load_catalog

    entry = load_catalog().get("demo-vision-qwen")
    assert entry.task == "chat" and entry.variants["default"]["llamacpp"].uri == "synth://demo-vision-qwen"
