"""The name clients see for a model, never a path on the server: a model the operator named by its path (``octo serve
/models/m.gguf``) is shown by its file's stem, which routes back to it like its other names (Ollama's lists, the
"servable here" of a 404)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

PATH_MARKS = ("/", ".", "~")


def public_name(slot: Any, registry: Any) -> str:
    """``slot``'s name; for a model named by its path, the file's stem (among its aliases) when that names this model
    alone, else the stem and a digest of the path, made an alias of the model so that it routes to it too."""
    name = slot.name
    if not name.startswith(PATH_MARKS):
        return name
    for alias in sorted(slot.aliases):
        if alias and not alias.startswith(PATH_MARKS) and "/" not in alias and registry.find(alias) is slot:
            return alias
    alias = f"{Path(name).stem}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    slot.aliases.add(alias)
    return alias
