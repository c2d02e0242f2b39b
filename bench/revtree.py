"""A git revision of this repository checked out beside it, servable with ``python -m octo.cli.main`` from its folder.

The revision goes into a git worktree under ``.cache/revisions/<sha>`` (git-ignored) with ``octo/engines`` linked to
its ``engines/`` folder; a server started with that folder as its working directory imports that revision's octo
(``python -m`` puts the working directory first on ``sys.path``, ahead of the editable install of this checkout).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_sha(rev: str) -> str:
    return subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=REPO, text=True).strip()


def worktree(rev: str) -> Path:
    """The folder of ``rev``'s worktree, created on first use."""
    sha = short_sha(rev)
    path = REPO / ".cache" / "revisions" / sha
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.check_call(["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    link = path / "octo" / "engines"
    if not link.exists():
        link.symlink_to(path / "engines", target_is_directory=True)
    return path
