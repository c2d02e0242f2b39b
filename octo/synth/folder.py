"""Build a cached folder once, atomically: a temporary sibling is written, marked complete, then renamed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMPLETE = ".complete"


def build_folder(out: Path, write: Callable[[Path], dict[str, Any]], subdir: str | None = None) -> Path:
    """Return ``out`` when it holds a finished build; else run ``write(tmp)`` and move the result into place.

    ``write`` fills the temporary folder and returns the metadata stored in the ``.complete`` marker. With
    ``subdir``, the result is ``tmp/subdir`` (tools that want to create their output folder themselves).
    An interrupted build (no marker) is redone; a concurrent finished build wins the race.
    """
    if (out / COMPLETE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = write(tmp)
        result = tmp / subdir if subdir else tmp
        (result / COMPLETE).write_text(json.dumps(meta) + "\n")
        if out.exists():  # an interrupted or concurrent build
            if (out / COMPLETE).exists():
                return out
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(result, out)
        except OSError:
            if not (out / COMPLETE).exists():  # lost a race to a concurrent build: use its result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
