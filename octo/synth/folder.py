"""Build a cached folder once, atomically: under the folder's lock, a temporary sibling is written, marked
complete, then renamed into place (see ``octo.atomic``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octo.atomic import build_file, remove, temp_path

COMPLETE = ".complete"


def build_folder(out: Path, write: Callable[[Path], dict[str, Any]], subdir: str | None = None) -> Path:
    """Return ``out`` when it holds a finished build; else run ``write(tmp)`` and move the result into place.

    ``write`` fills the temporary folder and returns the metadata stored in the ``.complete`` marker. With
    ``subdir``, the result is ``tmp/subdir`` (tools that want to create their output folder themselves).
    Builds of one folder take turns (a file lock the kernel releases if the builder dies): a second caller
    waits and uses the first one's result. A build killed midway leaves only a temporary sibling, which the
    next build removes; a folder without its marker (an older octo's interrupted build) is rebuilt.
    """
    out = Path(out)

    def make(tmp: Path) -> None:
        work = tmp if subdir is None else temp_path(out)
        work.mkdir()
        try:
            meta = write(work)
            result = work / subdir if subdir else work
            (result / COMPLETE).write_text(json.dumps(meta) + "\n")
            if subdir:
                os.replace(result, tmp)
        finally:
            if subdir:
                remove(work)

    return build_file(out, make, done=lambda p: (p / COMPLETE).exists())


def die_with_parent() -> None:
    """``preexec_fn`` for a builder's child process: it is killed when the builder dies (Linux), so a killed
    build leaves no converter running into a temporary folder that the next build removes."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
