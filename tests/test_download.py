"""Downloads through huggingface_hub against a local hub stand-in: cache reuse, resume, offline errors, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import socket

import pytest
import yaml
from click.testing import CliRunner
from hub_standin import HubStandin, gguf_bytes

from octo.errors import ConfigError, ModelNotFound
from octo.models.catalog import DEFAULT_ENGINE_FORMATS, Artifact, Catalog, load_catalog
from octo.models.download import ArtifactNotDownloaded, fetch, is_downloaded, repo_files

MLX_FILES = {
    "config.json": b'{"model_type": "qwen2"}',
    "model.safetensors": os.urandom(4096),
    "tokenizer.json": b"{}",
    "README.md": b"readme",
    "original/consolidated.pth": b"pth",
}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubStandin() as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("OCTO_HOME", str(tmp_path / "octo"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield standin


def _gets(hub: HubStandin, since: int = 0) -> list[str]:
    return [path for method, path, _ in hub.requests[since:] if method == "GET" and "/resolve/" in path]


def test_single_file_is_downloaded_once_into_the_hf_cache(hub, tmp_path):
    data = gguf_bytes() + os.urandom(1000)
    hub.add_repo("org/M-GGUF", {"M-Q4_K_M.gguf": data, "M-Q8_0.gguf": b"other"})
    art = Artifact("llamacpp", "hf://org/M-GGUF/M-Q4_K_M.gguf", "gguf")
    assert not is_downloaded(art)
    path = fetch(art, progress=False)
    assert path.read_bytes() == data and str(path).startswith(str(tmp_path / "hf" / "hub"))
    assert _gets(hub) == ["/org/M-GGUF/resolve/main/M-Q4_K_M.gguf"]  # only the file the engine needs
    assert is_downloaded(art)
    seen = len(hub.requests)
    assert fetch(art, progress=False) == path
    assert hub.requests[seen:] == []  # the second pull makes no request at all


def test_hf_token_is_sent(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
    hub.add_repo("org/Private-GGUF", {"P-Q4_K_M.gguf": gguf_bytes()})
    fetch(Artifact("llamacpp", "hf://org/Private-GGUF/P-Q4_K_M.gguf", "gguf"), progress=False)
    resolve = [a for (_, p, _), a in zip(hub.requests, hub.authorizations, strict=True) if "/resolve/" in p]
    assert resolve and all(a == "Bearer hf_standin_token" for a in resolve)


def test_folder_download_fetches_only_the_allowed_files(hub, tmp_path):
    hub.add_repo("org/M-4bit", MLX_FILES)
    art = _artifact(tmp_path, "hf://org/M-4bit", "mlx")
    path = fetch(art, progress=False)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (path / "model.safetensors").read_bytes() == MLX_FILES["model.safetensors"]
    assert not any("README" in g or ".pth" in g for g in _gets(hub))
    assert is_downloaded(art)
    seen = len(hub.requests)
    assert fetch(art, progress=False) == path and hub.requests[seen:] == []


def test_onnx_subfolder(hub, tmp_path):
    files = {
        f"{d}/{f}": d.encode() + f.encode()
        for d in ("cpu-int4", "gpu-int4")
        for f in ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json")
    }
    hub.add_repo("org/M-onnx", files)
    art = _artifact(tmp_path, "hf://org/M-onnx", "onnx", subfolder="cpu-int4")
    path = fetch(art, progress=False)
    assert path.name == "cpu-int4" and (path / "model.onnx.data").read_bytes() == b"cpu-int4model.onnx.data"
    assert _gets(hub) and not any("gpu" in g for g in _gets(hub))


def test_resume_after_a_broken_transfer(hub):
    # > 2 x huggingface_hub's 10 MiB chunk, so a chunk lands on disk before the connection drops.
    big = os.urandom(24 * 1024 * 1024)
    hub.add_repo("org/Big-GGUF", {"Big-Q8_0.gguf": big})
    hub.break_once.add("/org/Big-GGUF/resolve/main/Big-Q8_0.gguf")
    path = fetch(Artifact("llamacpp", "hf://org/Big-GGUF/Big-Q8_0.gguf", "gguf"), progress=False)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(big).digest()
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("Big-Q8_0.gguf")]
    assert ranges[0] is None and ranges[1] is not None and int(ranges[1][6:-1]) > 0  # "bytes=N-"


def test_url_artifact_resumes_a_partial_file_and_checks_its_sha256(hub, tmp_path):
    data = os.urandom(300_000)
    digest = hashlib.sha256(data).hexdigest()
    url = hub.add_file(f"main/whisper/models/{digest}/tiny.pt", data)
    art = Artifact("whisper", url, "whisper", source="whisper-tiny")
    dest = tmp_path / "octo" / "downloads" / url.split("//")[1].replace(":", "_")
    dest.parent.mkdir(parents=True)
    dest.with_name("tiny.pt.part").write_bytes(data[:100_000])  # an earlier, interrupted attempt
    assert not is_downloaded(art)
    assert fetch(art, progress=False) == dest and dest.read_bytes() == data
    assert [r for m, p, r in hub.requests if m == "GET"] == ["bytes=100000-"]
    assert not dest.with_name("tiny.pt.part").exists() and is_downloaded(art)
    seen = len(hub.requests)
    assert fetch(art, progress=False) == dest and hub.requests[seen:] == []

    bad = hub.add_file(f"main/whisper/models/{'0' * 64}/base.pt", data)
    with pytest.raises(ConfigError, match="SHA-256 mismatch"):
        fetch(Artifact("whisper", bad, "whisper"), progress=False)
    assert not list(dest.parent.parent.rglob("base.pt*"))
    with pytest.raises(ModelNotFound, match="not found"):
        fetch(Artifact("whisper", f"{hub.url}/files/absent.pt", "whisper"), progress=False)


def test_offline_with_the_artifact_cached_touches_no_network(hub, monkeypatch, tmp_path):
    hub.add_repo("org/M-GGUF", {"M-Q4_K_M.gguf": gguf_bytes()})
    hub.add_repo("org/M-4bit", MLX_FILES)
    file_art = Artifact("llamacpp", "hf://org/M-GGUF/M-Q4_K_M.gguf", "gguf")
    folder_art = _artifact(tmp_path, "hf://org/M-4bit", "mlx")
    paths = [fetch(file_art, progress=False), fetch(folder_art, progress=False)]
    hub.stop()  # nothing to talk to any more
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert [fetch(file_art), fetch(folder_art)] == paths
    assert repo_files("org/M-4bit") == ["config.json", "model.safetensors", "tokenizer.json"]


def test_offline_without_the_artifact_names_it_and_the_pull_command(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    art = load_catalog().resolve("qwen-2.5-0.5b:8bit", DEFAULT_ENGINE_FORMATS).artifacts["llamacpp"]
    with pytest.raises(ArtifactNotDownloaded) as err:
        fetch(art)
    msg = err.value.message
    assert art.uri in msg and "octo pull qwen-2.5-0.5b:8bit --engine llamacpp" in msg and "HF_HUB_OFFLINE" in msg
    assert err.value.status == 404 and hub.requests == []
    url_art = load_catalog().resolve("whisper-tiny", DEFAULT_ENGINE_FORMATS).artifacts["whisper"]
    with pytest.raises(ArtifactNotDownloaded, match="octo pull whisper-tiny --engine whisper"):
        fetch(url_art)


def test_unreachable_hub_without_cache(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ArtifactNotDownloaded, match="cannot be reached.*octo pull m --engine llamacpp"):
        fetch(Artifact("llamacpp", "hf://org/M-GGUF/M-Q4_K_M.gguf", "gguf", source="m"), progress=False)
    with pytest.raises(ArtifactNotDownloaded, match="unreachable"):
        repo_files("org/M-GGUF")


def test_missing_repository_or_file_is_404(hub):
    hub.add_repo("org/M-GGUF", {"M-Q4_K_M.gguf": gguf_bytes()})
    with pytest.raises(ModelNotFound, match="no such file") as err:
        fetch(Artifact("llamacpp", "hf://org/M-GGUF/M-Q5_K_M.gguf", "gguf"), progress=False)
    assert err.value.status == 404
    with pytest.raises(ModelNotFound, match="repository not found"):
        fetch(Artifact("llamacpp", "hf://org/Nope-GGUF/x.gguf", "gguf"), progress=False)
    with pytest.raises(ModelNotFound, match="repository not found"):
        fetch(Artifact("mlx", "hf://org/Nope", "mlx", ("*.json",)), progress=False)
    with pytest.raises(ModelNotFound, match="no files match"):
        fetch(Artifact("mlx", "hf://org/M-GGUF", "mlx", ("*.safetensors",)), progress=False)


def test_progress_bars(hub, capfd, monkeypatch):
    # huggingface_hub draws its bars on a terminal only; TQDM_POSITION=-1 forces them on for this test.
    monkeypatch.setenv("TQDM_POSITION", "-1")
    hub.add_repo("org/M-GGUF", {"M-Q4_K_M.gguf": os.urandom(2_000_000), "M-Q8_0.gguf": os.urandom(1000)})
    fetch(Artifact("llamacpp", "hf://org/M-GGUF/M-Q4_K_M.gguf", "gguf"), progress=True)
    err = capfd.readouterr().err
    assert "M-Q4_K_M.gguf" in err and "100%" in err
    fetch(Artifact("llamacpp", "hf://org/M-GGUF/M-Q8_0.gguf", "gguf"), progress=False)
    assert "M-Q8_0" not in capfd.readouterr().err


def test_synthetic_artifacts_are_built_by_octo_synth_in_a_child_process(tmp_path):
    """A synthetic artifact is built by ``python -m octo.synth.build``: the builder's libraries (PyTorch here) never
    load into the process that asked (a gateway, which would keep them and, for some, print leak reports at exit);
    a build that fails is a ConfigError with the builder's reason."""
    import subprocess
    import sys

    code = ("import sys\nfrom octo.models.download import fetch, is_downloaded\n"
            "from octo.models.resolve import Artifact\n"
            "art = Artifact('whisper', 'synth://whisper-test', 'synth')\n"
            "path = fetch(art, offline=True)\n"
            "print(path.name, path.is_file(), is_downloaded(art), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OCTO_HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["model.pt", "True", "True", "False"], out.stderr[-2000:]
    art = load_catalog().resolve("demo", DEFAULT_ENGINE_FORMATS).artifacts["llamacpp"]
    assert is_downloaded(art)  # nothing to download: a synthetic model counts as here
    with pytest.raises(ConfigError, match="Synthetic model 'whisper-nosuchshape' cannot be built for whisper: "
                                          "ValueError: unknown whisper shape 'nosuchshape'"):
        fetch(Artifact("whisper", "synth://whisper-nosuchshape", "synth"), offline=True)


def test_a_recorded_synthetic_build_is_found_without_a_child(tmp_path, monkeypatch):
    """A build's path is recorded under its name, engine and the builders' digest: a later start finds it there and
    starts no child process (about 0.15 s each, three at every ``octo serve demo`` start); a path that is gone, a
    damaged record or other builders ask the child again."""
    from octo.models import synthetic

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    built = tmp_path / "model.gguf"
    built.write_bytes(b"GGUF")
    children = []
    monkeypatch.setattr(synthetic, "_child_build", lambda name, engine: children.append((name, engine)) or built)
    assert synthetic.build("demo", "llamacpp") == built and len(children) == 1
    assert synthetic.build("demo", "llamacpp") == built and len(children) == 1  # recorded: no child
    assert synthetic.build("demo", "onnx") == built and len(children) == 2  # another engine: its own build
    index = tmp_path / "synth" / "built.json"
    assert sorted(json.loads(index.read_text())) == sorted(f"demo/{e}/{synthetic.builders_digest()}"
                                                         for e in ("llamacpp", "onnx"))
    built.unlink()
    synthetic.build("demo", "llamacpp")  # its files are gone: the child is asked again
    assert len(children) == 3
    built.write_bytes(b"GGUF")
    index.write_text("{not json")
    assert synthetic.build("demo", "llamacpp") == built and len(children) == 4  # a damaged record: built again
    index.unlink()
    os.mkfifo(index)  # a FIFO in its place is never opened for a read that would block the start
    assert synthetic.build("demo", "llamacpp") == built and len(children) == 5
    assert index.is_file()  # (set aside, and the record written again)
    monkeypatch.setattr(synthetic, "_digest", "other-builders")
    assert synthetic.build("demo", "llamacpp") == built and len(children) == 6
    assert list(json.loads(index.read_text())) == ["demo/llamacpp/other-builders"]  # the old digest's entries go
    folder = tmp_path / "onnx-folder"
    (folder / "model").mkdir(parents=True)
    monkeypatch.setattr(synthetic, "_child_build", lambda name, engine: children.append((name, engine)) or folder)
    synthetic.build("demo", "onnx")
    synthetic.build("demo", "onnx")  # a folder without the builders' completion marker is not taken as built
    assert len(children) == 8
    (folder / ".complete").write_text("{}")
    synthetic.build("demo", "onnx")
    assert len(children) == 8


# -- octo pull ---------------------------------------------------------------------------------------
def test_octo_pull(hub, monkeypatch, tmp_path):
    from octo.cli import models as cli_models
    from octo.cli.models import EngineState, pull

    hub.add_repo("org/M-GGUF", {"M-Q4_K_M.gguf": gguf_bytes(), "M-Q8_0.gguf": gguf_bytes("qwen2")})
    hub.add_repo("org/M-4bit", MLX_FILES)
    variants = {"4bit": {"llamacpp": "hf://org/M-GGUF/M-Q4_K_M.gguf", "mlx": "hf://org/M-4bit"}}
    catalog = _catalog(tmp_path, {**_entry_dict("", ""), "variants": variants})
    monkeypatch.setattr(cli_models, "load_catalog", lambda: catalog)
    monkeypatch.setattr(
        cli_models,
        "engine_states",
        lambda: {
            "llamacpp": EngineState(frozenset({"gguf"}), True, ""),
            "mlx": EngineState(frozenset({"mlx"}), False, "not installed"),
        },
    )
    runner = CliRunner()
    result = runner.invoke(pull, ["m", "-q"])
    assert result.exit_code == 0, result.output
    assert "m [llamacpp] hf://org/M-GGUF/M-Q4_K_M.gguf ->" in result.output
    assert not any("M-4bit" in g for g in _gets(hub))  # mlx is not usable here: not pulled by default
    seen = len(hub.requests)
    again = runner.invoke(pull, ["m", "-q"])
    assert "(already downloaded)" in again.output and hub.requests[seen:] == []
    result = runner.invoke(pull, ["m", "--engine", "mlx", "-q"])
    assert result.exit_code == 0 and "[mlx] hf://org/M-4bit" in result.output
    result = runner.invoke(pull, ["m", "--engine", "onnx"])
    assert result.exit_code == 1 and "no artifact for engine onnx; engines with one: llamacpp, mlx" in result.output
    result = runner.invoke(pull, ["m:8bit"])
    assert result.exit_code == 1 and "known variants: 4bit" in result.output
    result = runner.invoke(pull, ["org/M-GGUF:Q8_0", "-q"])  # a Hugging Face id works too
    assert result.exit_code == 0 and "M-Q8_0.gguf" in result.output


def test_octo_pull_gemma_4b_fetches_the_gguf_and_its_projector_beside_it(hub, monkeypatch):
    """The packaged catalog's gemma-4b, from a stand-in of bartowski's repository: `octo pull gemma-4b` downloads the
    Q4_K_M GGUF and the projector the catalog names (none of the other files), into one folder, where the llama.cpp
    engine finds the projector; a GGUF without its projector is not "downloaded"."""
    from octo.engines.llamacpp.vision import find_projector

    from octo.cli import models as cli_models
    from octo.cli.models import EngineState, pull
    from octo.models.pulling import hub_size

    repo = "bartowski/google_gemma-3-4b-it-GGUF"
    files = {"google_gemma-3-4b-it-Q4_K_M.gguf": gguf_bytes("gemma3") + os.urandom(300),
             "google_gemma-3-4b-it-Q8_0.gguf": gguf_bytes("gemma3"),
             "mmproj-google_gemma-3-4b-it-f16.gguf": gguf_bytes("clip") + os.urandom(200),
             "mmproj-google_gemma-3-4b-it-f32.gguf": gguf_bytes("clip"), "README.md": b"card"}
    hub.add_repo(repo, files)
    monkeypatch.setattr(cli_models, "engine_states", lambda: {
        "llamacpp": EngineState(frozenset({"gguf"}), True, ""),
        "mlx": EngineState(frozenset({"mlx"}), False, "not installed")})
    art = load_catalog().resolve("gemma-4b", DEFAULT_ENGINE_FORMATS).artifacts["llamacpp"]
    assert hub_size(art) == len(files["google_gemma-3-4b-it-Q4_K_M.gguf"]) + len(
        files["mmproj-google_gemma-3-4b-it-f16.gguf"])  # what --max-pull-gb checks before a download
    result = CliRunner().invoke(pull, ["gemma-4b", "-q"])
    assert result.exit_code == 0, result.output
    assert "(projector: mmproj-google_gemma-3-4b-it-f16.gguf)" in result.output
    assert sorted(_gets(hub)) == [f"/{repo}/resolve/main/google_gemma-3-4b-it-Q4_K_M.gguf",
                                  f"/{repo}/resolve/main/mmproj-google_gemma-3-4b-it-f16.gguf"]
    path = fetch(art, progress=False)
    projector = find_projector(str(path), None)
    assert projector is not None and projector.read_bytes() == files["mmproj-google_gemma-3-4b-it-f16.gguf"]
    assert projector.parent == path.parent and is_downloaded(art)
    projector.unlink()  # the GGUF alone: not downloaded; a pull brings the projector back
    assert not is_downloaded(art)
    assert fetch(art, progress=False) == path and projector.is_file() and is_downloaded(art)


def test_a_missing_projector_is_named(hub):
    hub.add_repo("org/V-GGUF", {"V-Q4_K_M.gguf": gguf_bytes()})
    art = Artifact("llamacpp", "hf://org/V-GGUF/V-Q4_K_M.gguf", "gguf", mmproj="hf://org/V-GGUF/mmproj-V-f16.gguf")
    with pytest.raises(ModelNotFound, match="hf://org/V-GGUF/mmproj-V-f16.gguf: no such file in the repository"):
        fetch(art, progress=False)


def test_a_hugging_face_id_pulls_the_projector_llama_server_would(hub, monkeypatch):
    from octo.cli import models as cli_models
    from octo.cli.models import EngineState, pull

    hub.add_repo("org/VL-GGUF", {"VL-Q4_K_M.gguf": gguf_bytes(), "VL-f16.gguf": gguf_bytes(),
                                  "mmproj-VL-Q8_0.gguf": gguf_bytes("clip"), "mmproj-VL-f16.gguf": gguf_bytes("clip")})
    monkeypatch.setattr(cli_models, "engine_states",
                        lambda: {"llamacpp": EngineState(frozenset({"gguf"}), True, "")})
    result = CliRunner().invoke(pull, ["org/VL-GGUF:Q4_K_M", "-q"])
    assert result.exit_code == 0 and "(projector: mmproj-VL-Q8_0.gguf)" in result.output, result.output
    assert sorted(_gets(hub)) == ["/org/VL-GGUF/resolve/main/VL-Q4_K_M.gguf",
                                  "/org/VL-GGUF/resolve/main/mmproj-VL-Q8_0.gguf"]


def _entry_dict(uri: str, engine: str, **spec) -> dict:
    art = {"uri": uri, **spec} if spec else uri
    return {"id": "m", "task": "chat", "default_variant": "4bit", "variants": {"4bit": {engine: art}}}


def _catalog(tmp_path, entry: dict) -> Catalog:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [entry]}))
    return Catalog.load(path)


def _artifact(tmp_path, uri: str, engine: str, **spec) -> Artifact:
    """The artifact a catalog entry gives (default allow-patterns filled in)."""
    return _catalog(tmp_path, _entry_dict(uri, engine, **spec)).resolve("m", DEFAULT_ENGINE_FORMATS).artifacts[engine]
