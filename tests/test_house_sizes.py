"""No module over 600 lines and no function over 60 in the package, the engines and the plugins (issue 34: a reader
takes in a file or a function at once). No allowlist: a file or function that grows past the limit is split."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "octo", REPO / "engines", REPO / "plugins"]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def python_files() -> list[Path]:
    return sorted(p for base in SOURCES if base.is_dir() for p in base.rglob("*.py"))


def long_files(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_FILE_LINES:
            found.append(f"{path.relative_to(root)}: {n} lines")
    return found


def long_functions(paths: list[Path], root: Path = REPO) -> list[str]:
    """Functions (and methods, nested ones too) by ``end_lineno - lineno + 1``: the def line to the last line of
    the body, decorators not counted."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
    return found


def test_the_walk_finds_the_sources():
    paths = python_files()
    names = {p.relative_to(REPO).as_posix() for p in paths}
    assert {"octo/engine.py", "octo/scheduler/engine_loop.py", "engines/llamacpp/__init__.py"} <= names
    assert len(paths) > 100


def test_no_file_is_over_600_lines():
    assert long_files(python_files()) == []


def test_no_function_is_over_60_lines():
    assert long_functions(python_files()) == []


def test_the_checks_name_what_is_too_long(tmp_path):
    """The checks are not vacuous: a long file and a long function are named, the limits themselves pass."""
    long_def = "def f():\n" + "    x = 1\n" * 60 + "    return x\n"
    path = tmp_path / "probe.py"
    path.write_text(long_def + "\n" * (MAX_FILE_LINES - long_def.count("\n") + 1))
    short = tmp_path / "short.py"
    short.write_text("def g():\n" + "    pass\n" * 59)
    assert long_files([path, short], tmp_path) == ["probe.py: 601 lines"]
    assert long_functions([path, short], tmp_path) == ["probe.py:1 f: 62 lines"]
