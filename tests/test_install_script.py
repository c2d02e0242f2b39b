"""``make serve`` on a fresh machine (scripts/install.py): it says what it needs and how long it takes before it starts,
checks the prerequisites before it creates or installs anything, and installs what the README's tour uses."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

from serverproc import REPO

SCRIPT = REPO / "scripts" / "install.py"


def _run(*args: str, path: str, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env["PATH"] = path
    return subprocess.run([sys.executable, str(SCRIPT), "--venv", str(tmp_path / "venv"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_a_compiler_it_stops_before_creating_anything(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _run(path=str(empty), tmp_path=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    head = out.stdout.splitlines()
    assert head[1].startswith("  needs: Python 3.11+ with venv, a C/C++ compiler")
    assert head[2].startswith("  takes: packages ") and "llama.cpp's compile 10-15 minutes on 2 cores" in head[2]
    assert "step 1/4: checking the prerequisites" in out.stdout and "step 2/4" not in out.stdout
    assert "no C++ compiler (c++, g++ or clang++)" in out.stdout and "make serve LLAMACPP=no" in out.stdout
    assert "no cmake on PATH (pip's build fetches the cmake package from PyPI instead)" in out.stdout
    assert not (tmp_path / "venv").exists()


def test_without_llama_cpp_no_compiler_is_needed(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _run("--no-llamacpp", "--check", path=str(empty), tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout
    assert "without llama.cpp" in out.stdout and "compiler" not in out.stdout and "step 1/3" in out.stdout
    assert "no ffmpeg: transcription takes WAV uploads only" in out.stdout


def test_make_serve_installs_what_the_tour_uses():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dry = subprocess.run(["make", "-n", "serve", "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    line = next(ln for ln in dry.splitlines() if "scripts/install.py" in ln)
    wanted = set(line.split("--extras ")[1].split()[0].split(","))
    assert {"llamacpp", "onnx", "mlx", "synth", "whisper", "speech", "tour"} <= wanted <= set(extras)  # speech too
    assert extras["tour"] == ["openai>=1.40"]  # the tour's Python example
    assert "'source /nonexistent/venv/bin/activate' puts octo on PATH" in dry
    script = SCRIPT.read_text()
    assert 'ALL = ["llamacpp", "mlx", "onnx", "whisper", "speech"]' in script  # pyproject's "all", spelled out
    assert extras["all"] == ["octo[llamacpp,mlx,onnx,whisper,speech]"]
