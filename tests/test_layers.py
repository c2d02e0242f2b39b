"""The package's layering is checked, not hoped for (docs/architecture.md).

- `lint-imports` (import-linter, contracts in pyproject.toml): each layer imports only the layers below it, the
  plugin surface and the engines import no layer, aiohttp stays in the server and Ray in the cluster layer.
- No underscore name is imported across modules: a name another module needs is public.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "octo", REPO / "engines", REPO / "plugins"]


def lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    return subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    run = lint_imports()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "broken" not in run.stdout.split("Contracts:")[-1].split("\n")[0] or " 0 broken" in run.stdout


def test_an_upward_import_breaks_the_contract(tmp_path, monkeypatch):
    """The contract is not vacuous: a scheduler module importing the server fails it."""
    probe = REPO / "octo" / "scheduler" / "zz_layer_probe.py"
    probe.write_text("import octo.server.app  # noqa: F401\n")
    try:
        run = lint_imports()
    finally:
        probe.unlink()
    assert run.returncode != 0 and "octo.scheduler.zz_layer_probe" in run.stdout


def is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[:2] == ["octo", "engines"]:
        base = REPO / "engines" / Path(*parts[2:]) if len(parts) > 2 else REPO / "engines"
    else:
        base = REPO / Path(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports() -> list[str]:
    """``from octo.x import _name`` and ``module._name`` where ``module`` is another octo module."""
    found = []
    for base in SOURCES:
        for path in base.rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            modules: set[str] = set()  # local names bound to octo modules
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("octo"):
                    for alias in node.names:
                        if private(alias.name):
                            found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}")
                        elif is_module(f"{node.module}.{alias.name}"):
                            modules.add(alias.asname or alias.name)
                elif isinstance(node, ast.Import):
                    modules.update(a.asname for a in node.names if a.name.startswith("octo.") and a.asname)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                        and node.value.id in modules):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
    return found


SURFACE = {"octo", "octo.engine", "octo.hookspecs", "octo.errors", "octo.plugins", "octo.config", "octo.paths",
           "octo.atomic", "octo.logits", "octo.tokenbytes", "octo.benchload", "octo.options", "octo.chat_template",
           "octo.quarantine"}


def engine_imports() -> list[str]:
    """Imports of octo modules by engines/ and plugins/ outside the plugin surface (and their own package)."""
    found = []
    for base in (REPO / "engines", REPO / "plugins"):
        for path in base.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    if (name.startswith("octo") and name not in SURFACE and not name.startswith("octo.engines")
                            and not name.startswith("octo.synth")):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_engines_and_plugins_import_only_the_plugin_surface():
    assert engine_imports() == []


def test_no_underscore_name_is_imported_across_modules():
    assert private_imports() == []
