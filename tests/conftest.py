import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Synthetic models built by tests are cached here between runs (git ignores .cache/).
os.environ.setdefault("OCTO_HOME", str(REPO / ".cache" / "octo-test"))
# llama.cpp's KV layout is timed at load by default (engines/llamacpp/layout.py); tests that depend on a layout
# (shared cells, KV-pressure preemption) would depend on a timing. The suite pins the unified pool; tests of the
# probe and of streams set the layout themselves.
os.environ.setdefault("OCTO_LLAMACPP_KV_UNIFIED", "true")

from serverproc import run_octo  # noqa: E402


@pytest.fixture(scope="module", params=["thread", "process"])
def echo_server(request):
    """A real `octo serve test-model --engine echo` process shared by a test module; every test that uses it runs
    with the model in the gateway (echo's default) and in an engine worker process (what native engines get)."""
    with run_octo("test-model", "--engine", "echo", "--isolation", request.param) as server:
        yield server


@pytest.fixture
def octo_server():
    """Factory: `with octo_server("MODEL", "--engine", "echo", ...) as server:`."""
    return run_octo


@pytest.fixture
def forbid(monkeypatch):
    """``forbid(obj, name)``: the test fails if ``obj.name`` is called (a probe that must not run, ...)."""

    def _forbid(obj, name: str) -> None:
        def boom(*args, **kwargs):
            raise AssertionError(f"{name} was called")

        monkeypatch.setattr(obj, name, boom)

    return _forbid
