"""llama.cpp's own converter (``convert_hf_to_gguf.py``) for synthetic Hugging Face folders.

The converter ships in the llama.cpp source tree, not in the llama-cpp-python wheel: its sdist (``pip download
--no-deps --no-binary :all: llama-cpp-python==<the installed version>``, served from pip's cache after an install that
built it) holds the tree under ``vendor/llama.cpp``. The converter, its ``conversion`` package and its ``gguf-py``
are extracted once into ``synth_dir()/llama.cpp-<version>`` (``OCTO_LLAMA_CPP_SRC`` names a llama.cpp tree to use
instead), so a GGUF is written by the same llama.cpp version that reads it. The converter needs torch, numpy and
sentencepiece (``pip install 'octo[synth]'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from octo.atomic import build_file
from octo.paths import synth_dir
from octo.synth.folder import die_with_parent

# what the converter needs of the tree (it puts gguf-py first on sys.path, so the package matches the converter)
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        raise RuntimeError("building a synthetic GGUF with llama.cpp's converter needs llama-cpp-python installed "
                           "(its sdist holds the converter of the same llama.cpp)") from None


def converter_tree() -> Path:
    """A llama.cpp source tree with ``convert_hf_to_gguf.py`` (extracted from the sdist once, or
    ``OCTO_LLAMA_CPP_SRC``)."""
    given = os.environ.get("OCTO_LLAMA_CPP_SRC")
    if given:
        tree = Path(given).expanduser()
        if not (tree / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"OCTO_LLAMA_CPP_SRC={given} holds no convert_hf_to_gguf.py")
        return tree
    ver = llama_cpp_version()
    out = synth_dir() / f"llama.cpp-{ver}"
    return build_file(out, lambda tmp: _extract(ver, tmp), done=lambda p: (p / "convert_hf_to_gguf.py").is_file())


def _extract(ver: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, f"llama-cpp-python=={ver}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"pip could not download the llama-cpp-python {ver} sdist (llama.cpp's converter is "
                               f"in it; set OCTO_LLAMA_CPP_SRC to a llama.cpp tree instead): {proc.stderr[-1500:]}")
        dest.mkdir()
        with tarfile.open(found[0]) as tf:
            for m in tf.getmembers():
                parts = m.name.split("/", 3)  # llama_cpp_python-X/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3].startswith(_PARTS):
                    m.name = parts[3]
                    tf.extract(m, dest, filter="data")
    if not (dest / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"the llama-cpp-python {ver} sdist holds no vendor/llama.cpp/convert_hf_to_gguf.py")


# Runs the converter with its BPE pre-tokenizer label given (``pre``): the converter recognises a pre-tokenizer by a
# hash of the ids its tokenizer gives a test string, which only published vocabularies match.
_WITH_PRE = ("import runpy, sys\n"
             "tree, pre = sys.argv[1], sys.argv[2]\n"
             "sys.argv = sys.argv[3:]\n"
             "sys.path[:0] = [tree, tree + '/gguf-py']\n"
             "import conversion.base\n"
             "conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def convert(hf: Path, out: Path, outtype: str = "f16", mmproj: bool = False, timeout: float | None = 600,
            pre: str | None = None) -> None:
    """Run ``convert_hf_to_gguf.py`` on the folder ``hf`` into the file ``out`` (``mmproj``: the projector file of a
    vision-language model, as ``--mmproj`` writes it; ``pre``: the BPE pre-tokenizer's name, for a tokenizer trained
    here, whose vocabulary the converter's fingerprint cannot know)."""
    tree = converter_tree()
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(out), "--outtype", outtype]
    if pre is not None:
        cmd[1:1] = ["-c", _WITH_PRE, str(tree), pre]
    if mmproj:
        cmd.append("--mmproj")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")  # the tree's own gguf-py, as the converter wants
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=die_with_parent)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed on {hf}{' (--mmproj)' if mmproj else ''} "
                           f"(exit {proc.returncode}):\n{tail}")
