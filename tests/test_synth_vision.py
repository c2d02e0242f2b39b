"""The synthetic vision-language model (octo.synth.vision): a Hugging Face folder in the layout of Google's Gemma 3
checkpoints that transformers loads and runs (its processor included), and the catalog's demo-vision."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install 'octo[synth]')")


@pytest.fixture(scope="module")
def hf():
    from octo.synth.vision import build_vision_hf

    return build_vision_hf("demo-vision")


def test_the_folder_holds_what_a_gemma_3_checkpoint_holds(hf):
    from safetensors import safe_open

    for name in ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json", "chat_template.json",
                 "preprocessor_config.json", "processor_config.json", "special_tokens_map.json"):
        assert (hf / name).is_file(), name
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and config["mm_tokens_per_image"] == 16
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in names


def test_the_tokenizer_is_trained_the_same_every_time():
    from octo.synth.vision import SPECIALS, train_tokenizer

    raw = train_tokenizer(0)
    assert raw == train_tokenizer(0)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=raw)
    assert [sp.id_to_piece(i) for i in range(4 + len(SPECIALS))] == ["<pad>", "<eos>", "<bos>", "<unk>", *SPECIALS]


def test_transformers_loads_and_runs_it_and_the_answer_depends_on_the_image(hf):
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(hf)
    model = Gemma3ForConditionalGeneration.from_pretrained(hf)
    content = [{"type": "image"}, {"type": "text", "text": "What?"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    assert "<start_of_image>" in text
    outs = []
    for color in ((255, 0, 0), (0, 0, 255)):
        inputs = proc(text=text, images=Image.new("RGB", (80, 60), color), return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        outs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    assert outs[0] != outs[1]


def test_the_catalog_serves_demo_vision_on_llamacpp():
    from octo.models.catalog import load_catalog

    entry = load_catalog().get("demo-vision")
    assert entry.task == "chat" and entry.variants["default"]["llamacpp"].uri == "synth://demo-vision"
