"""The model catalog and name resolution: catalog entries, local paths, Hugging Face ids, every error."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import yaml
from hub_standin import HubStandin, gguf_bytes

from octo.errors import ConfigError, ModelNotFound
from octo.models.catalog import DEFAULT_ENGINE_FORMATS, Catalog, load_catalog, parse_hf, uri_kind

F = DEFAULT_ENGINE_FORMATS
REQUIRED = {
    "demo",
    "smollm-360m",
    "qwen-2.5-0.5b",
    "qwen-2.5-1.5b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "phi-4-mini",
    "gemma-4b",
    "qwen-2.5-vl-3b",
    "mistral-7b",
    "whisper-tiny",
    "whisper-base",
    "whisper-small",
    "whisper-medium",
    "whisper-large-v3",
}


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubStandin() as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield standin


# -- the packaged catalog --------------------------------------------------------------------------
def test_packaged_catalog_has_the_required_models(catalog):
    ids = set(catalog.names())
    assert REQUIRED <= ids
    tasks = {e.id: e.task for e in catalog.entries}
    assert [i for i, t in tasks.items() if t == "embeddings"], "an embedding model"
    assert all(tasks[f"whisper-{s}"] == "transcription" for s in ("tiny", "base", "small", "medium", "large-v3"))
    for entry in catalog.entries:
        for variant in entry.variants:
            for engine, art in catalog.artifacts(entry, variant).items():
                kind = uri_kind(art.uri)
                assert kind in ("hf", "url", "synth"), (entry.id, engine, art.uri)
                if kind == "hf":
                    parse_hf(art.uri)  # well formed
                if engine == "whisper" and kind != "synth":  # OpenAI's checkpoints carry their SHA-256 in the URL
                    assert art.uri.startswith("https://openaipublic.azureedge.net/main/whisper/models/")


def test_whisper_entries_are_openais_own_checkpoints(catalog):
    whisper = pytest.importorskip("whisper", reason="openai-whisper is not installed")
    entries = [e for e in catalog.entries if e.id.startswith("whisper-")]
    assert len(entries) >= 9
    for entry in entries:
        for name in (entry.id, *entry.aliases):
            art = catalog.resolve(name, F).artifacts["whisper"]
            assert art.uri == whisper._MODELS[name.removeprefix("whisper-")], name


def test_demo_is_synthetic_for_every_text_engine(catalog):
    resolved = catalog.resolve("demo", F)
    assert resolved.task == "chat" and resolved.name == "demo"
    assert set(resolved.artifacts) == {"echo", "llamacpp", "mlx", "onnx"}
    assert {a.uri for a in resolved.artifacts.values()} == {"synth://demo"}
    assert {a.format for a in resolved.artifacts.values()} == {"synth"}


def test_alias_and_default_variant(catalog):
    r = catalog.resolve("gemma-4b", F)
    assert (r.name, r.variant, r.task) == ("gemma-4b:4bit", "4bit", "chat")
    assert r.artifacts["llamacpp"].uri.endswith("google_gemma-3-4b-it-Q4_K_M.gguf")
    assert r.artifacts["llamacpp"].format == "gguf" and r.artifacts["mlx"].format == "mlx"
    assert "gemma-4b" in r.aliases and "google/gemma-3-4b-it" in r.aliases
    same = catalog.resolve("Google/Gemma-3-4B-IT:8BIT", F)  # aliases and variants are case-insensitive
    assert same.name == "gemma-4b:8bit" and same.artifacts["llamacpp"].uri.endswith("Q8_0.gguf")
    assert "Google/Gemma-3-4B-IT:8BIT" in same.aliases


def test_vision_models_bring_their_projector_and_their_vlm_folders(catalog):
    """gemma-4b and qwen-2.5-vl-3b: each GGUF with its repository's projector (downloaded beside it, where the llama.cpp
    engine finds it); MLX folders whose downloads include the processor's configs (mlx-vlm reads them)."""
    from fnmatch import fnmatch

    expect = {
        "gemma-4b:4bit": "hf://bartowski/google_gemma-3-4b-it-GGUF/mmproj-google_gemma-3-4b-it-f16.gguf",
        "gemma-4b:8bit": "hf://bartowski/google_gemma-3-4b-it-GGUF/mmproj-google_gemma-3-4b-it-f16.gguf",
        "qwen-2.5-vl-3b:4bit": "hf://ggml-org/Qwen2.5-VL-3B-Instruct-GGUF/mmproj-Qwen2.5-VL-3B-Instruct-Q8_0.gguf",
        "qwen-2.5-vl-3b:8bit": "hf://ggml-org/Qwen2.5-VL-3B-Instruct-GGUF/mmproj-Qwen2.5-VL-3B-Instruct-Q8_0.gguf",
        "qwen-2.5-vl-3b:fp16": "hf://ggml-org/Qwen2.5-VL-3B-Instruct-GGUF/mmproj-Qwen2.5-VL-3B-Instruct-f16.gguf",
    }
    for name, mmproj in expect.items():
        gguf = catalog.resolve(name, F).artifacts["llamacpp"]
        assert gguf.mmproj == mmproj and gguf.uri.rsplit("/", 1)[0] == mmproj.rsplit("/", 1)[0], name
    r = catalog.resolve("Qwen/Qwen2.5-VL-3B-Instruct", F)
    assert r.name == "qwen-2.5-vl-3b:4bit" and r.artifacts["mlx"].uri == "hf://mlx-community/Qwen2.5-VL-3B-Instruct-4bit"
    for name in ("gemma-4b:4bit", "gemma-4b:8bit", "gemma-4b:fp16", "qwen-2.5-vl-3b:fp16"):
        mlx = catalog.resolve(name, F).artifacts["mlx"]
        assert mlx.uri.startswith("hf://mlx-community/") and mlx.mmproj is None
        for f in ("preprocessor_config.json", "processor_config.json", "chat_template.json", "model.safetensors"):
            assert any(fnmatch(f, p) for p in mlx.allow_patterns), (name, f)
    assert all(a.mmproj is None for e in catalog.entries if e.id not in ("gemma-4b", "qwen-2.5-vl-3b")
               for v in e.variants for a in catalog.artifacts(e, v).values())


def test_only_engines_that_load_the_format_get_an_artifact(catalog):
    r = catalog.resolve("phi-4-mini:4bit", {"llamacpp": frozenset({"gguf"}), "onnx": frozenset({"onnx"})})
    assert set(r.artifacts) == {"llamacpp", "onnx"}
    onnx = r.artifacts["onnx"]
    assert onnx.subfolder == "cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4"
    assert onnx.allow_patterns and all(p.startswith(onnx.subfolder + "/") for p in onnx.allow_patterns)
    assert catalog.resolve("phi-4-mini:4bit", {"mlx": frozenset({"gguf"})}).artifacts == {}


def test_mlx_folders_download_only_what_mlx_lm_needs(catalog):
    art = catalog.resolve("mistral-7b:fp16", F).artifacts["mlx"]
    assert art.uri == "hf://mistralai/Mistral-7B-Instruct-v0.3"
    assert "model*.safetensors" in art.allow_patterns and "*.safetensors" not in art.allow_patterns


def test_unknown_variant_lists_the_known_ones_and_never_falls_back(catalog):
    with pytest.raises(ModelNotFound) as err:
        catalog.resolve("qwen-2.5-0.5b:3bit", F)
    assert err.value.status == 404
    assert "3bit" in err.value.message and "known variants: 4bit (the default), 8bit, fp16." in err.value.message
    with pytest.raises(ModelNotFound, match="known variants: fp16"):
        catalog.resolve("whisper-tiny:4bit", F)
    with pytest.raises(ModelNotFound) as err:  # no "(default: default)"
        catalog.resolve("demo:8bit", F)
    assert err.value.message == "Model 'demo' has no variant '8bit'; known variants: default."


def test_unknown_model_suggests_the_closest_names(catalog):
    with pytest.raises(ModelNotFound) as err:
        catalog.resolve("qwen-2.5-0.5", F)
    assert err.value.status == 404 and "qwen-2.5-0.5b" in err.value.message
    with pytest.raises(ModelNotFound, match="Closest names: .*whisper-small"):
        catalog.resolve("whisper-smal", F)
    with pytest.raises(ModelNotFound, match="not found"):
        catalog.resolve("completely-unrelated-xyz", F)
    with pytest.raises(ModelNotFound):
        catalog.resolve("  ", F)


# -- local paths -----------------------------------------------------------------------------------
def test_local_gguf_file(catalog, tmp_path):
    path = tmp_path / "my-model.gguf"
    path.write_bytes(gguf_bytes("llama", 8192))
    r = catalog.resolve(str(path), F)
    assert (r.name, r.task, r.context_length, r.variant) == (str(path), "chat", 8192, None)
    assert set(r.artifacts) == {"llamacpp"} and r.artifacts["llamacpp"].uri == str(path.resolve())
    assert "my-model" in r.aliases


def test_local_gguf_embedding_model(catalog, tmp_path):
    path = tmp_path / "embed.gguf"
    path.write_bytes(gguf_bytes("nomic-bert", 2048, pooling=True))
    r = catalog.resolve(str(path), F)
    assert (r.task, r.context_length) == ("embeddings", 2048)


def test_local_folders(catalog, tmp_path):
    mlx = tmp_path / "mlx-model"
    mlx.mkdir()
    (mlx / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (mlx / "model.safetensors").write_bytes(b"\0" * 16)
    r = catalog.resolve(str(mlx), F)
    assert set(r.artifacts) == {"mlx"} and r.context_length == 4096 and r.artifacts["mlx"].format == "mlx"

    onnx = tmp_path / "phi-onnx" / "cpu-int4"
    onnx.mkdir(parents=True)
    (onnx / "genai_config.json").write_text(json.dumps({"model": {"context_length": 131072}}))
    r = catalog.resolve(str(onnx), F)
    assert set(r.artifacts) == {"onnx"} and r.context_length == 131072
    with pytest.raises(ModelNotFound, match="subfolders; pass one of: .*cpu-int4"):
        catalog.resolve(str(onnx.parent), F)


def test_local_whisper_checkpoint(catalog, tmp_path):
    path = tmp_path / "tiny.pt"
    with zipfile.ZipFile(path, "w") as z:  # torch.save writes a zip archive
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    r = catalog.resolve(str(path), F)
    assert (r.task, set(r.artifacts)) == ("transcription", {"whisper"})


def test_unsupported_or_missing_paths_say_what_was_expected(catalog, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelNotFound, match="not a supported model file: expected a .gguf file") as err:
        catalog.resolve(str(text), F)
    assert err.value.status == 404
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")  # named .gguf: what is wrong is the file, not its kind
    with pytest.raises(ModelNotFound, match=r"fake.gguf' is named .gguf but is not a GGUF file \(it does not start "
                                            r"with GGUF's magic bytes\): a damaged or partial download"):
        catalog.resolve(str(fake), F)
    with pytest.raises(ModelNotFound, match="not a supported model folder"):
        catalog.resolve(str(tmp_path), F)
    with pytest.raises(ModelNotFound, match="No such file"):
        catalog.resolve(str(tmp_path / "absent.gguf"), F)
    with pytest.raises(ModelNotFound, match="No such file"):
        catalog.resolve("./absent-folder/model", F)


def test_real_synthetic_artifacts_are_detected(catalog):
    """The project's own synthetic builds (same formats as the real thing) resolve by format."""
    from octo.synth.hf import build_hf

    r = catalog.resolve(str(build_hf("tiny")), F)
    assert set(r.artifacts) == {"mlx"} and r.task == "chat" and r.context_length
    pytest.importorskip("gguf")
    from octo.synth.gguf import build_gguf

    r = catalog.resolve(str(build_gguf("tiny")), F)
    assert set(r.artifacts) == {"llamacpp"} and r.task == "chat" and r.context_length
    assert catalog.resolve(str(build_gguf("tiny", pooling="mean")), F).task == "embeddings"


# -- Hugging Face ids ------------------------------------------------------------------------------
def test_hf_id_format_detection(catalog, hub):
    hub.add_repo(
        "someone/Tiny-GGUF",
        {
            "Tiny-Q4_K_M.gguf": gguf_bytes(),
            "Tiny-Q8_0.gguf": gguf_bytes(),
            "Tiny-f16.gguf": gguf_bytes(),
            "mmproj-Tiny-f16.gguf": gguf_bytes(),
            "README.md": b"hi",
        },
    )
    r = catalog.resolve("someone/Tiny-GGUF", F)
    assert r.name == "someone/Tiny-GGUF" and set(r.artifacts) == {"llamacpp"}
    assert r.artifacts["llamacpp"].uri == "hf://someone/Tiny-GGUF/Tiny-Q4_K_M.gguf"
    assert r.artifacts["llamacpp"].mmproj == "hf://someone/Tiny-GGUF/mmproj-Tiny-f16.gguf"  # as llama-server -hf
    assert catalog.resolve("someone/Tiny-GGUF:Q8_0", F).artifacts["llamacpp"].uri.endswith("Tiny-Q8_0.gguf")
    assert catalog.resolve("someone/Tiny-GGUF:fp16", F).artifacts["llamacpp"].uri.endswith("/Tiny-f16.gguf")
    with pytest.raises(ModelNotFound, match="no variant 'Q5_K_M'; known variants: f16, Q4_K_M, Q8_0"):
        catalog.resolve("someone/Tiny-GGUF:Q5_K_M", F)

    hub.add_repo("someone/Tiny-4bit", {"config.json": b"{}", "model.safetensors": b"\0", "tokenizer.json": b"{}"})
    r = catalog.resolve("someone/Tiny-4bit", F)
    assert set(r.artifacts) == {"mlx"} and r.artifacts["mlx"].uri == "hf://someone/Tiny-4bit"
    with pytest.raises(ModelNotFound, match="no variant '8bit'"):
        catalog.resolve("someone/Tiny-4bit:8bit", F)

    hub.add_repo(
        "someone/Tiny-onnx",
        {f"{d}/{f}": b"{}" for d in ("cpu-int4", "gpu-int4", "cpu-fp32") for f in ("genai_config.json", "model.onnx")},
    )
    r = catalog.resolve("someone/Tiny-onnx", F)
    assert r.artifacts["onnx"].subfolder == "cpu-fp32"  # a CPU build is preferred, then by name
    assert catalog.resolve("someone/Tiny-onnx:4bit", F).artifacts["onnx"].subfolder == "cpu-int4"
    assert catalog.resolve("hf://someone/Tiny-onnx:gpu", F).artifacts["onnx"].subfolder == "gpu-int4"

    hub.add_repo("someone/docs", {"README.md": b"hi"})
    with pytest.raises(ModelNotFound, match="has no supported model files: expected a .gguf"):
        catalog.resolve("someone/docs", F)


def test_hf_file_uri_and_missing_repo(catalog, hub):
    r = catalog.resolve("hf://someone/Other-GGUF/x-Q4_0.gguf", F)  # a file URI needs no listing
    assert r.artifacts["llamacpp"].uri == "hf://someone/Other-GGUF/x-Q4_0.gguf"
    assert hub.requests == []
    with pytest.raises(ModelNotFound, match="repository 'Qwen/Qwen2.5-0.5B-Instrct' not found") as err:
        catalog.resolve("Qwen/Qwen2.5-0.5B-Instrct", F)
    assert err.value.status == 404 and "Closest names: Qwen/Qwen2.5-0.5B-Instruct" in err.value.message


def test_hf_id_offline_uses_the_local_cache(catalog, hub, monkeypatch):
    from octo.models.download import fetch

    hub.add_repo("someone/Cached-GGUF", {"c-Q4_K_M.gguf": gguf_bytes(), "c-Q8_0.gguf": gguf_bytes()})
    fetch(catalog.resolve("someone/Cached-GGUF:Q8_0", F).artifacts["llamacpp"], progress=False)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = catalog.resolve("someone/Cached-GGUF", F)  # only the downloaded file is known offline
    assert r.artifacts["llamacpp"].uri == "hf://someone/Cached-GGUF/c-Q8_0.gguf"
    with pytest.raises(ModelNotFound, match="octo pull someone/Never-GGUF") as err:
        catalog.resolve("someone/Never-GGUF", F)
    assert err.value.code == "model_not_downloaded"


# -- catalog validation ----------------------------------------------------------------------------
GOOD = {
    "id": "m",
    "task": "chat",
    "default_variant": "4bit",
    "variants": {"4bit": {"llamacpp": "hf://org/repo/m-Q4_K_M.gguf"}},
}


def _write(tmp_path: Path, *entries) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": list(entries)}))
    return path


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"task": "painting"}, "entry 'm' (models[1]), field 'task'"),
        ({"default_variant": "8bit"}, "entry 'm' (models[1]): default_variant '8bit' is not one of the variants"),
        (
            {"variants": {"4bit": {"mlx": "hf://org/repo/m.gguf"}}},
            "variants.4bit.mlx: engine 'mlx' loads mlx, not gguf",
        ),
        ({"variants": {"4bit": {"llamacpp": "hf://org/repo"}}}, "variants.4bit.llamacpp: cannot tell the format"),
        ({"variants": {"4bit": {"llamacpp": "hf://org"}}}, "field 'variants.4bit.llamacpp.uri'"),
        ({"variants": {"4bit": {"llamacpp": "ftp://x/y.gguf"}}}, "unknown scheme"),
        (
            {"variants": {"4bit": {"llamacpp": {"uri": "hf://o/r/f.gguf", "colour": 1}}}},
            "field 'variants.4bit.llamacpp.colour'",
        ),
        ({"id": "bad:name"}, "entry 'bad:name' (models[1]), field 'id'"),
        ({"aliases": ["first"]}, "name 'first' of entry 'm' is already used by entry 'first'"),
        ({"context_length": -1}, "field 'context_length'"),
        (
            {"variants": {"4bit": {"llamacpp": {"uri": "hf://o/r/f.gguf", "mmproj": "projector.gguf"}}}},
            "variants.4bit.llamacpp: mmproj must be the file name of a projector beside the GGUF",
        ),
        (
            {"variants": {"4bit": {"llamacpp": {"uri": "hf://o/r/f.gguf", "mmproj": "sub/mmproj-f16.gguf"}}}},
            "mmproj must be the file name of a projector beside the GGUF",
        ),
        (
            {"variants": {"4bit": {"mlx": {"uri": "hf://o/r", "mmproj": "mmproj-f16.gguf"}}}},
            "variants.4bit.mlx: mmproj (a projector beside the GGUF) only applies to a hf:// GGUF file",
        ),
    ],
)
def test_bad_catalog_names_the_entry_and_field(tmp_path, change, expected):
    first = {**GOOD, "id": "first"}
    path = _write(tmp_path, first, {**GOOD, **change})
    with pytest.raises(ConfigError) as err:
        Catalog.load(path)
    assert expected in err.value.message and str(path) in err.value.message


def test_unreadable_catalogs(tmp_path):
    with pytest.raises(ConfigError, match="Cannot read"):
        Catalog.load(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Catalog.load(bad)
    bad.write_text("- just a list")
    with pytest.raises(ConfigError, match="expected a mapping"):
        Catalog.load(bad)


def test_local_paths_in_a_catalog_are_relative_to_it(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "m.gguf").write_bytes(gguf_bytes())
    path = _write(tmp_path, {**GOOD, "variants": {"4bit": {"llamacpp": "weights/m.gguf"}}})
    r = Catalog.load(path).resolve("m", F)
    assert r.artifacts["llamacpp"].uri == str(tmp_path / "weights" / "m.gguf")


def test_load_catalog_is_cached_and_follows_edits(tmp_path):
    path = _write(tmp_path, GOOD)
    assert load_catalog(path) is load_catalog(path)
    import os

    path.write_text(yaml.safe_dump({"models": [{**GOOD, "id": "renamed"}]}))
    os.utime(path, (1, 1))
    assert load_catalog(path).names() == ["renamed"]


# -- octo models ---------------------------------------------------------------------------------------
def test_octo_models_lists_catalog_and_engines(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from octo.cli import models as cli_models
    from octo.cli.models import EngineState, models

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(
        cli_models,
        "engine_states",
        lambda: {
            "llamacpp": EngineState(frozenset({"gguf"}), True, ""),
            "mlx": EngineState(frozenset({"mlx"}), False, "mlx is not installed"),
            "echo": EngineState(frozenset({"any"}), True, ""),
        },
    )
    monkeypatch.setenv("COLUMNS", "200")
    out = CliRunner().invoke(models, []).output
    gemma = next(line for line in out.splitlines() if line.startswith("gemma-4b "))
    assert "4bit*" in gemma and "llamacpp, (mlx)" in gemma  # (brackets): not usable here
    assert gemma.rstrip().endswith("gemma-3-4b (+3)"), gemma  # the first alias, and how many more
    assert "mlx            not usable: mlx is not installed" in out
    monkeypatch.setenv("COLUMNS", "80")  # the terminal's width: no line longer
    narrow = CliRunner().invoke(models, []).output.splitlines()
    assert max(map(len, narrow)) <= 80 and any(line.endswith("…") for line in narrow)
    data = json.loads(CliRunner().invoke(models, ["--json"]).output)
    gemma = next(m for m in data["models"] if m["id"] == "gemma-4b")
    arts = gemma["variants"]["4bit"]
    assert arts["llamacpp"]["usable"] and not arts["mlx"]["usable"] and not arts["llamacpp"]["downloaded"]
    assert data["engines"]["mlx"] == {"formats": ["mlx"], "usable": False, "reason": "mlx is not installed"}


@pytest.mark.parametrize(("model", "projector"), [
    ("V-Q4_K_M.gguf", "mmproj-V-Q8_0.gguf"),  # llama-server -hf: the quantisation closest in bits
    ("V-Q8_0.gguf", "mmproj-V-Q8_0.gguf"),
    ("V-f16.gguf", "mmproj-V-f16.gguf"),
    ("sub/V-Q4_K_M.gguf", "sub/mmproj-V-f16.gguf"),  # only beside the model
    ("other/V-Q4_K_M.gguf", None),
])
def test_a_gguf_repositorys_projector_is_the_one_llama_server_picks(model, projector):
    from octo.models.formats import best_mmproj

    files = ["V-Q4_K_M.gguf", "V-Q8_0.gguf", "V-f16.gguf", "mmproj-V-Q8_0.gguf", "mmproj-V-f16.gguf",
             "sub/V-Q4_K_M.gguf", "sub/mmproj-V-f16.gguf", "other/V-Q4_K_M.gguf"]
    assert best_mmproj(files, model) == projector
