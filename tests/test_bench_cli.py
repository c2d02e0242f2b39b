"""``octo bench``: no traceback without matplotlib (the chart is optional), its report under OCTO_HOME (not the current
folder), and each engine's start-up benchmark (what ``octo serve`` measures) beside the long rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from serverproc import REPO


def test_without_matplotlib_octo_bench_reports_under_octo_home_and_skips_the_chart(tmp_path):
    blocker = tmp_path / "blocker" / "matplotlib"  # `import matplotlib` fails as where it is not installed
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "OCTO_HOME": str(tmp_path / "home"), "PYTHONPATH": str(blocker.parent)}
    proc = subprocess.run([sys.executable, "-m", "octo.cli", "bench", "demo", "--engines", "echo", "--batch", "1,2",
                           "--seconds", "0.3", "--prompt", "32"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "octo bench: no chart (matplotlib is not installed" in proc.stderr
    report = tmp_path / "home" / "bench-reports" / "bench-demo.json"
    assert report.is_file() and not any(cwd.iterdir())  # nothing written where the command ran
    data = json.loads(report.read_text())
    echo = data["engines"][0]
    assert [row["batch"] for row in echo["rows"]] == [1, 2] and echo["rows"][0]["prompt_tokens"] == 32
    assert echo["startup"]["score"] > 0 and echo["startup"]["error"] is None  # the start-up benchmark beside them
    assert data["winner"] == data["startup_winner"] == "echo"
    assert "Start-up benchmark (what `octo serve` measures" in proc.stdout and "None" not in proc.stdout


def test_out_names_the_folder(tmp_path):
    env = {**os.environ, "OCTO_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "octo.cli", "bench", "demo", "--engines", "echo", "--batch", "1",
                           "--seconds", "0.2", "--prompt", "16", "--out", str(tmp_path / "reports")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "reports" / "bench-demo.json").is_file()
