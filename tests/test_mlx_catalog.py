"""The MLX engine on catalog artifacts: an MLX folder (4-bit, float32 scales) published as a Hugging Face repository
on the local hub stand-in, resolved from a catalog entry, fetched through huggingface_hub and loaded; and a plain
``org/name`` id handed to the engine. Greedy output equals the same folder loaded from disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")

from hub_standin import HubStandin  # noqa: E402
from octo.engines.mlx import MLXEngine  # noqa: E402

from octo.engine import EngineConfig  # noqa: E402
from octo.models.catalog import DEFAULT_ENGINE_FORMATS, Catalog  # noqa: E402
from octo.models.download import fetch  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))
REPO_ID = "mlx-community/Tiny-Synthetic-4bit"


@pytest.fixture(scope="module")
def folder() -> Path:
    from octo.synth.mlx import build_mlx

    return build_mlx("tiny", quant="4bit")


@pytest.fixture
def hub(folder, tmp_path, monkeypatch):
    with HubStandin() as standin:
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}
        files["README.md"] = b"# a model card the engine does not need\n"
        standin.add_repo(REPO_ID, files)
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield standin


def _greedy(engine: MLXEngine, n: int = 16) -> list[int]:
    from test_mlx import generate

    return generate(engine, engine.tokenize("The old lighthouse stood at the edge of the harbor"), n)


def test_catalog_artifact_fetched_and_loaded(hub, folder, tmp_path):
    path = tmp_path / "models.yaml"
    entry = {
        "id": "tiny-mlx",
        "task": "chat",
        "default_variant": "4bit",
        "variants": {"4bit": {"mlx": f"hf://{REPO_ID}"}},
    }
    path.write_text(yaml.safe_dump({"models": [entry]}))
    artifact = Catalog.load(path).resolve("tiny-mlx", DEFAULT_ENGINE_FORMATS).artifacts["mlx"]
    local = fetch(artifact, progress=False)
    assert MLXEngine.artifact_format(str(local)) == "mlx" and not (local / "README.md").exists()
    remote = MLXEngine(EngineConfig())
    remote.load(str(local), "tiny-mlx")
    assert remote.info.extra["quantization"]["bits"] == 4
    disk = MLXEngine(EngineConfig())
    disk.load(str(folder), "tiny")
    assert _greedy(remote) == _greedy(disk)
    remote.unload()
    disk.unload()


def test_hugging_face_id_loads_directly(hub, folder):
    e = MLXEngine(EngineConfig())
    e.load(f"hf://{REPO_ID}", "tiny")
    assert e.info.n_vocab == 4096
    disk = MLXEngine(EngineConfig())
    disk.load(str(folder), "tiny")
    assert _greedy(e) == _greedy(disk)
