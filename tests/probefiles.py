"""The verdicts the llama.cpp engine's load-time probes cache under ``OCTO_HOME/probe``."""

from __future__ import annotations

import json
from pathlib import Path


def cached_verdict(home: Path, kind: str, disturbed: bool) -> dict | None:
    """The one ``kind`` verdict cached under ``home`` (``layout``, ``adapt``); None when the measurement was disturbed
    by other processes, which is then not followed (only its attempt is recorded, for the next try's time)."""
    files = [f for f in (home / "probe").glob(f"llamacpp-{kind}-*.json")
             if not json.loads(f.read_text()).get("disturbed")]
    if disturbed:
        assert not files
        return None
    assert len(files) == 1, files
    return json.loads(files[0].read_text())
