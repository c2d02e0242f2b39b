"""Where octo keeps its files: ``OCTO_HOME`` (default ``~/.cache/octo``)."""

from __future__ import annotations

import os
from pathlib import Path


def octo_home() -> Path:
    return Path(os.environ.get("OCTO_HOME") or Path.home() / ".cache" / "octo").expanduser()


def synth_dir() -> Path:
    """Synthetic models built by ``octo.synth`` (one folder per architecture, shape, seed and format)."""
    return octo_home() / "synth"


def bench_dir() -> Path:
    """Cached start-up benchmark results (``OCTO_BENCH_DIR`` overrides)."""
    return Path(os.environ.get("OCTO_BENCH_DIR") or octo_home() / "bench")
