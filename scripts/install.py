#!/usr/bin/env python3
"""octo's set-up in steps: ``make serve`` and ``make test`` run it to create the virtual environment and install octo.

It says what it needs and about how long it takes before it starts, checks the prerequisites first (a C/C++
compiler for llama.cpp, Python 3.11+ with venv), and shows which step it is in with the time spent, instead of pip's
bare "still running..." lines. pip's own output goes to a log file (``VENV/install.log``), shown when a step fails.

    python3 scripts/install.py [--venv .venv] [--extras llamacpp,onnx,...] [--no-llamacpp] [--check]

Only the standard library: it runs before the environment exists, with whatever ``python3`` the host has.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 11)
# llama-cpp-python is published on PyPI as source only: pip compiles llama.cpp (measured on 2 cores: 14.5 minutes);
# a later set-up on the same machine takes pip's cached wheel (seconds)
LLAMACPP_TIME = "10-15 minutes on 2 cores"
# measured on 2 busy cores with a fast connection and an empty pip cache: 5 minutes, 3.7 GB in the environment
PACKAGES_TIME = "about 5 minutes on a fast connection (about 4 GB: PyTorch for CPU, ONNX Runtime, MLX, ...)"
ALL = ["llamacpp", "mlx", "onnx", "whisper", "speech"]  # pyproject.toml's "all" extra
BEAT_S = 30.0  # a progress line this often (in place on a terminal)


def say(text: str = "") -> None:
    print(text, flush=True)


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def compiler() -> str | None:
    """The C++ compiler pip's build of llama.cpp will find (CXX, else c++, g++, clang++ on PATH)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name.split()[0]):
            return name
    return None


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    first = (out.strip().splitlines() or ["?"])[0]
    found = re.search(r"\d+\.\d+(\.\d+)?", first)
    return found.group(0) if found else first[:40]


def check_prerequisites(python: str, llamacpp: bool) -> list[str]:
    """Problems that would make the set-up fail (empty: none); prints what it found."""
    problems: list[str] = []
    found: list[str] = []
    probe = subprocess.run([python, "-c", "import sys, venv, ensurepip; print('%d.%d.%d' % sys.version_info[:3])"],
                           capture_output=True, text=True)
    version = probe.stdout.strip()
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        problems.append(f"{python} cannot create a virtual environment ({why}): on Debian/Ubuntu "
                        "`sudo apt-get install python3-venv`")
    elif tuple(int(x) for x in version.split(".")[:2]) < MIN_PYTHON:
        problems.append(f"octo needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; {python} is {version} "
                        "(choose another with `make serve PYTHON=python3.12`)")
    else:
        found.append(f"python {version} with venv")
    if llamacpp:
        cxx = compiler()
        if cxx is None:
            problems.append("no C++ compiler (c++, g++ or clang++): pip compiles llama.cpp, PyPI has no wheel of "
                            "llama-cpp-python. Install one (Debian/Ubuntu: `sudo apt-get install build-essential "
                            "cmake`; Fedora: `sudo dnf install gcc-c++ cmake`; macOS: `xcode-select --install`), or "
                            "set up without llama.cpp: `make serve LLAMACPP=no` (the demo then runs on ONNX Runtime "
                            "and MLX)")
        else:
            found.append(f"{cxx} {tool_version([cxx.split()[0], '--version'])}")
        if shutil.which("cmake"):
            found.append(f"cmake {tool_version(['cmake', '--version'])}")
        else:
            found.append("no cmake on PATH (pip's build fetches the cmake package from PyPI instead)")
    say(f"  found: {', '.join(found) or 'nothing usable'}")
    if not shutil.which("ffmpeg"):
        say("  note: no ffmpeg: transcription takes WAV uploads only (mp3, m4a, ogg... need ffmpeg: on Debian/Ubuntu "
            "`sudo apt-get install ffmpeg`)")
    free = shutil.disk_usage(REPO).free / 2**30
    if free < 6:
        say(f"  note: {free:.1f} GB free on this disk; the environment takes about 5 GB")
    return problems


def last_activity(log: Path) -> str:
    """What pip is doing now, from the end of its log ("Building wheel for llama-cpp-python", "Downloading torch")."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if line.startswith(("Collecting", "Downloading", "Building", "Installing", "Using cached", "Obtaining")):
            line = re.sub(r"\s*\(.*?\)\s*$", "", line.replace(": still running...", "").replace(": started", ""))
            return line[:90]
    return ""


def run_step(argv: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``argv`` with its output appended to ``log``, printing the time spent (and pip's current activity) every
    ``BEAT_S`` seconds: in place on a terminal, one line each otherwise. Returns (exit status, seconds)."""
    tty = sys.stdout.isatty()
    started = time.monotonic()
    with open(log, "ab") as out:
        out.write(("\n$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=1.0 if tty else BEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    spent = time.monotonic() - started
                    if tty or spent >= BEAT_S:
                        line = f"    ... {fmt_time(spent)}" + (f" ({a})" if (a := last_activity(log)) else "")
                        print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", flush=True)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
    if tty:
        print("\r\x1b[2K", end="", flush=True)
    return rc, time.monotonic() - started


def fail(step: str, rc: int, log: Path) -> None:
    tail = log.read_text(errors="replace").splitlines()[-30:]
    say(f"\nset-up failed in {step} (exit status {rc}); the end of {log}:\n")
    say("\n".join("  " + line for line in tail))
    sys.exit(rc or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=".venv")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that creates the environment")
    ap.add_argument("--extras", default="llamacpp,onnx,mlx,synth,whisper,speech,tour", help="octo's pip extras")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out (nothing to compile)")
    ap.add_argument("--check", action="store_true", help="check the prerequisites only (step 1), install nothing")
    args = ap.parse_args()
    venv = Path(args.venv)
    extras: list[str] = []
    for e in filter(None, args.extras.split(",")):  # "all" spelled out, so that llama.cpp can be a step of its own
        extras += ALL if e == "all" else [e]
    extras = list(dict.fromkeys(extras))
    llamacpp = not args.no_llamacpp and "llamacpp" in extras
    others = [e for e in extras if e != "llamacpp"]
    steps = ["checking the prerequisites", f"creating the virtual environment {venv}",
             "installing octo and its engines' Python packages (wheels)"]
    if llamacpp:
        steps.append("compiling llama.cpp (llama-cpp-python has no wheel on PyPI)")
    log = venv / "install.log"
    say(f"octo set-up: {venv} with octo and the engines ({', '.join(extras)})"
        + ("" if llamacpp else ", without llama.cpp"))
    say("  needs: Python 3.11+ with venv" + (", a C/C++ compiler; cmake (else pip fetches it)" if llamacpp else ""))
    say(f"  takes: packages {PACKAGES_TIME}" + (f"; llama.cpp's compile {LLAMACPP_TIME}, seconds when pip's cache "
                                                 "holds a wheel built before" if llamacpp else ""))
    say(f"  log:   {log}")
    n = len(steps)

    say(f"step 1/{n}: {steps[0]}")
    problems = check_prerequisites(args.python, llamacpp)
    if problems:
        say("\ncannot set up octo here:\n" + "\n".join(f"  - {p}" for p in problems))
        sys.exit(2)
    if args.check:
        return

    say(f"step 2/{n}: {steps[1]}")
    py = venv / "bin" / "python"
    if not py.exists():
        rc = subprocess.run([args.python, "-m", "venv", str(venv)]).returncode
        if rc:
            sys.exit(rc)
    venv.mkdir(exist_ok=True)
    rc, _ = run_step([str(py), "-m", "pip", "install", "--disable-pip-version-check", "--upgrade", "pip"], log)
    if rc:
        fail(f"step 2/{n}", rc, log)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-c", "constraints.txt"]

    say(f"step 3/{n}: {steps[2]}; {PACKAGES_TIME.split(' (')[0]} ...")  # (the size is in the header)
    rc, took = run_step([*pip, "-e", f".[{','.join(others)}]" if others else "."], log)
    if rc:
        fail(f"step 3/{n}", rc, log)
    say(f"  done in {fmt_time(took)}")

    if llamacpp:
        say(f"step 4/{n}: {steps[3]}; {LLAMACPP_TIME} ...")
        rc, took = run_step([*pip, "-e", ".[llamacpp]"], log)
        if rc:
            fail(f"step 4/{n}", rc, log)
        say(f"  done in {fmt_time(took)}")
    say(f"octo is installed: {venv}/bin/octo (`source {venv}/bin/activate` puts `octo` on PATH)")


if __name__ == "__main__":
    main()
