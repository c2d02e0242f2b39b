"""Transcription on a fresh machine: without ffmpeg (WAV decoded by octo, other formats a 415 that names ffmpeg; the
speech engines available, their ``detect`` reason saying so) and offline with the synthetic ``demo-whisper``, as the
README's tour does it (``make serve`` serves ``demo``; the curl example loads ``demo-whisper`` on demand)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("whisper")
pytest.importorskip("faster_whisper")
pytest.importorskip("pywhispercpp")

from serverproc import REPO, run_octo  # noqa: E402

from octo.synth.build import build_for  # noqa: E402
from octo.synth.whisper import voiced_clip  # noqa: E402

ENGINES = ("whisper", "faster-whisper", "whispercpp")


@pytest.mark.parametrize("engine", ENGINES)
def test_without_ffmpeg_wav_is_transcribed_and_other_formats_name_ffmpeg(engine, tmp_path):
    empty = tmp_path / "bin"  # PATH without ffmpeg (the server starts its workers by absolute path)
    empty.mkdir()
    wav = voiced_clip(tmp_path / "clip.wav", seconds=2.0).read_bytes()
    model = build_for("whisper-test3", engine)
    with run_octo(str(model), "--engine", engine, "-o", "max_new_tokens=8", env={"PATH": str(empty)}) as s:
        row = next(r for r in s.get_json("/v1/engines")["data"] if r["name"] == engine)
        client = s.openai(max_retries=0)
        text = client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", wav)).text
        with pytest.raises(openai.APIStatusError) as refused:
            client.audio.transcriptions.create(model="whisper-1", file=("clip.mp3", b"ID3\x04" + b"\0" * 4096))
    assert row["available"] and "no ffmpeg on PATH: the server decodes WAV uploads only" in row["reason"], row
    assert isinstance(text, str)
    assert refused.value.status_code == 415
    assert "ffmpeg is not installed on the server" in refused.value.message and "Send WAV" in refused.value.message


def test_the_readmes_transcription_example_works_offline_with_demo_whisper(tmp_path):
    """The README's commands as written (the port aside): the clip, then curl against the server `make serve`
    starts (`octo serve demo`), which loads `demo-whisper` on demand; no network (HF_HUB_OFFLINE)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(python -m octo\.synth\.whisper speech\.wav[^\n]*)\n(curl [^\n]*demo-whisper[^\n]*)\n",
                      readme)
    assert block, "the README's transcription example changed: update this test"
    make_clip, curl = (line.split("  #")[0].strip() for line in block.groups())
    argv = shlex.split(make_clip)
    subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, check=True, capture_output=True)
    env = {"HF_HUB_OFFLINE": "1", "OCTO_BENCH_DIR": str(tmp_path / "bench")}
    with run_octo("demo", "--bench-seconds", "1", env=env) as s:
        out = subprocess.run(shlex.split(curl.replace("127.0.0.1:8080", f"127.0.0.1:{s.port}")), cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        log = s.log()
        # a speech model is OpenAI's (/v1/models), never in Ollama's list, where front-ends offer models to chat
        assert "demo-whisper" in {m["id"] for m in s.get_json("/v1/models")["data"]}
        assert {m["name"] for m in s.get_json("/api/tags")["models"]} >= {"demo:latest"}
        assert not any(m["name"].startswith("demo-whisper") for m in s.get_json("/api/tags")["models"])
    answer = json.loads(out.stdout)
    assert answer.get("text", "").strip(), (out.stdout, log[-3000:])
    assert "octo: 'demo-whisper' ready with" in log
