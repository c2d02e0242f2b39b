"""Offline, on a machine that has only some of the models named: ``octo serve`` serves what it has and says each
missing model's own problem once (as Ollama comes up with the models it has); with none, it stops listing every
problem once; ``octo pull`` offline says it cannot download, not "run octo pull"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from serverproc import REPO, run_octo

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

CATALOG = """models:
  - id: remote-a
    task: embeddings
    default_variant: default
    variants:
      default:
        llamacpp: hf://octo-test/missing-a/model.gguf
  - id: remote-b
    task: chat
    default_variant: default
    variants:
      default:
        llamacpp: hf://octo-test/missing-b/model.gguf
        mlx: hf://octo-test/missing-b-mlx
"""


@pytest.fixture
def offline(tmp_path):
    catalog = tmp_path / "models.yaml"
    catalog.write_text(CATALOG)
    return {"OCTO_CATALOG": str(catalog), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}


def _reason(model: str) -> str:
    return (f"'{model}' is not downloaded here and downloads are disabled (HF_HUB_OFFLINE). Download it first, with "
            f"network access: octo pull {model}")


def test_the_models_that_are_here_serve_and_each_missing_one_is_said_once(offline):
    from octo.synth.gguf import build_gguf

    tiny = os.path.realpath(build_gguf("tiny", ftype="q8_0"))
    with run_octo(tiny, "remote-a", "remote-b", env=offline) as server:
        log = server.log()
        reply = server.openai().completions.create(model=server.openai().models.list().data[0].id, prompt="x",
                                                   max_tokens=2, extra_body={"ignore_eos": True})
        status, body = server.post_json("/v1/completions", {"model": "remote-b", "prompt": "x"})
    assert reply.choices[0].finish_reason == "length"
    for model in ("remote-a", "remote-b"):
        assert f"octo: not serving '{model}': {_reason(model)}" in log, log[-3000:]
        assert log.count(f"octo pull {model}") == 1, log[-3000:]  # its problem once, not once per engine and log
    assert " ERROR " not in log and "Traceback" not in log
    assert status == 404 and "octo pull remote-b" in body["error"]["message"]  # as for any model not downloaded


def test_with_no_model_here_the_start_stops_with_every_problem_once(offline):
    proc = subprocess.run([sys.executable, "-m", "octo.cli", "serve", "remote-a", "remote-b", "--port", "0"],
                          cwd=REPO, env={**os.environ, **offline}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"Error: no model named could be served:\n  - 'remote-a': {_reason('remote-a')}\n" \
           f"  - 'remote-b': {_reason('remote-b')}" in proc.stderr, proc.stderr
    assert proc.stderr.count("octo pull remote-a") == 1 and proc.stderr.count("octo pull remote-b") == 1
    assert "Servable here" not in proc.stderr and "Traceback" not in proc.stderr


def test_octo_pull_offline_says_it_cannot_download(offline):
    proc = subprocess.run([sys.executable, "-m", "octo.cli", "pull", "remote-a"], cwd=REPO,
                          env={**os.environ, **offline}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("Error: cannot download hf://octo-test/missing-a/model.gguf (engine llamacpp): "
                                   "downloads are disabled (HF_HUB_OFFLINE). Unset HF_HUB_OFFLINE to allow downloads.")
