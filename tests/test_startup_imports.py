"""What ``octo serve MODEL`` imports before its load request goes to the engine worker, and what the gateway imports
at all: the start-up's critical path (bench/startup.py). A local path or a ``hf://`` URI resolves without the catalog
(yaml, its pydantic schema); the engine plugins, the loader and the HTTP application import without numpy (the worker
imports it, the gateway only for the requests that use it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octo.errors import ModelNotFound
from octo.models.catalog import DEFAULT_ENGINE_FORMATS, load_catalog
from octo.models.resolve import resolve, resolve_direct

REPO = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_load_path_imports_neither_numpy_nor_the_catalog(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    mods = _modules_after(
        "from octo.plugins import engine_registry, load_plugins\n"
        "from octo.models.resolve import resolve\n"
        "import octo.runtime.loader, octo.runtime.registry, octo.runtime.process\n"
        "reg = engine_registry(load_plugins(None))\n"
        f"r = resolve({str(model)!r}, {{n: c.formats for n, c in reg.items()}})\n"
        "assert 'llamacpp' in r.artifacts, r\n")
    assert "octo.engines.llamacpp.engine" in mods or "engines.llamacpp.engine" in mods  # the plugins did load
    assert not {"numpy", "yaml", "octo.models.catalog"} & mods


def test_the_gateway_application_imports_no_numpy():
    mods = _modules_after("import octo.server.app, octo.server.listen, octo.cli.startup\n")
    assert "aiohttp.web" in mods
    assert "numpy" not in mods


@pytest.mark.parametrize("spec", ["./m.gguf", "m.gguf", "~/nowhere/m.gguf", "/no/such/folder/"])
def test_paths_resolve_without_the_catalog_as_the_catalog_does(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    want = got = None
    try:
        want = load_catalog().resolve(spec, DEFAULT_ENGINE_FORMATS)
    except ModelNotFound as exc:
        want = exc.message
    try:
        got = resolve_direct(spec, DEFAULT_ENGINE_FORMATS)
    except ModelNotFound as exc:
        got = exc.message
    assert got == want


def test_names_go_to_the_catalog():
    assert resolve_direct("demo", DEFAULT_ENGINE_FORMATS) is None
    assert resolve("demo", DEFAULT_ENGINE_FORMATS) == load_catalog().resolve("demo", DEFAULT_ENGINE_FORMATS)
    with pytest.raises(ModelNotFound):
        resolve_direct("  ", DEFAULT_ENGINE_FORMATS)
    with pytest.raises(ModelNotFound, match="Hugging Face URI"):
        resolve_direct("hf://only-org", DEFAULT_ENGINE_FORMATS)


def test_a_worker_loads_llama_cpps_bindings_without_the_rest_of_its_package():
    """The llama.cpp engine's preload and load import llama-cpp-python's ctypes bindings only (not its ``Llama``
    class, chat formats, jinja2: 0.1 s of a worker's path to the load); a later ``import llama_cpp`` still gets the
    whole package, at its first use."""
    pytest.importorskip("llama_cpp")
    mods = _modules_after(
        "import sys\n"
        "from octo.engines.llamacpp.engine import LlamaCppEngine\n"
        "LlamaCppEngine.prepare()\n"
        "L = sys.modules['octo.engines.llamacpp.native'].bindings()\n"
        "assert callable(L.llama_backend_init) and L.llama_batch\n"
        "assert sys.modules['llama_cpp'].__version__ == LlamaCppEngine.version()\n")
    assert {"llama_cpp.llama_cpp", "numpy"} <= mods  # the bindings, and numpy for the load's batch
    assert not {"llama_cpp.llama", "llama_cpp.llama_chat_format", "jinja2"} & mods
    mods = _modules_after(
        "from octo.engines.llamacpp.native import bindings\n"
        "bindings()\n"
        "import llama_cpp\n"
        "assert llama_cpp.Llama.__name__ == 'Llama' and llama_cpp.llama_backend_init\n"
        "from llama_cpp import LlamaGrammar\n")
    assert "llama_cpp.llama" in mods


def test_octo_serve_spawns_its_worker_before_asyncio_and_the_server(tmp_path):
    """``octo serve`` starts its engine worker right after parsing its flags: what it imports until then (click, the
    settings) is all that delays the worker; asyncio (40 ms with ssl), aiohttp and the server come after."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    code = ("import json, sys\n"
            "import octo.runtime.prespawn as P\n"
            "def spy(*a, **k):\n"
            "    print(json.dumps(sorted(sys.modules)))\n"
            "    raise SystemExit(0)\n"
            "P.prespawn = spy\n"
            f"sys.argv = ['octo', 'serve', {str(model)!r}, '--engine', 'llamacpp', '--keep-alive', '5m']\n"
            "from octo.cli.main import main\n"
            "main()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OCTO_SPARE_WORKER": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    mods = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "octo.runtime.prespawn" in mods and "click" in mods
    assert not {"asyncio", "aiohttp", "numpy", "pydantic", "octo.server.app", "octo.runtime.supervision"} & mods
