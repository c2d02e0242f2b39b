"""A steady engine choice: the engine an earlier start chose for a model on this host keeps serving it unless a
challenger, measured without disturbance from other processes, scores more than ``MARGIN`` times its score
(``octo.runtime.selection.select`` asks :func:`beats`). Two starts on a busy host then pick the same engine instead of
whichever the noise favoured, and a disturbed measurement never crowns an engine. The choice is kept under
``OCTO_HOME/bench/choice``, keyed by the candidates' cache keys (host, engines and versions, artifacts)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from octo.atomic import write_json
from octo.paths import bench_dir
from octo.quarantine import move_aside, read_json

log = logging.getLogger("octo.runtime.engine_choice")
MARGIN = 1.10


def winner_file(keys: dict[str, dict[str, Any]]) -> Path:
    """Where the engine chosen for this set of candidates (engines, versions, artifacts, host) is kept."""
    digest = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:24]
    return bench_dir() / "choice" / f"{digest}.json"


def incumbent(keys: dict[str, dict[str, Any]]) -> str | None:
    """The engine an earlier start chose for these candidates on an undisturbed measurement (None: none yet)."""
    path = winner_file(keys)
    data = read_json(path, log, max_bytes=64 << 10, what="engine choice cache")
    name = data.get("engine") if isinstance(data, dict) else None
    if data is not None and not isinstance(name, str):
        move_aside(path, "not an engine choice of this octo's shape", log, what="engine choice cache")
    return name if isinstance(name, str) and name in keys else None


def measured_quietly(res: dict[str, Any]) -> bool:
    """Measured without disturbance from other processes (a cached result too: a disturbed one is cached as
    provisional, ``octo.runtime.selection.provisional``)."""
    return not (res.get("conditions") or {}).get("disturbed")


def beats(name: str, res: dict[str, Any], best: str, best_res: dict[str, Any], kept: str | None) -> bool:
    """Whether candidate ``name`` (its result ``res``) takes the lead from ``best``. The engine an earlier start chose
    (``kept``) is displaced only by a challenger measured without disturbance that scores more than ``MARGIN`` times
    its score (a disturbed measurement never displaces it); between two others the higher score leads. Only an
    undisturbed (or cached) winner is kept for the next start (:func:`keep`)."""
    quiet, best_quiet = measured_quietly(res), measured_quietly(best_res)
    if best == kept:
        return quiet and res["score"] > MARGIN * best_res["score"]
    if name == kept:
        return not (best_quiet and best_res["score"] > MARGIN * res["score"])
    return res["score"] > best_res["score"]  # no earlier choice between these two: the score decides


def keep(keys: dict[str, dict[str, Any]], name: str, result: dict[str, Any]) -> None:
    """Remember ``name`` as the choice for these candidates when its result was measured undisturbed (or cached)."""
    if measured_quietly(result):
        write_json(winner_file(keys), {"engine": name, "score": result["score"]}, indent=2)


def reason(name: str, kept: str | None, results: dict[str, dict[str, Any]], when: str = "before on this host") -> str:
    """Why ``name`` serves, in plain words (``when`` the engine ``kept`` was chosen)."""
    others = {n: r for n, r in results.items() if n != name and not r.get("error")}
    top = max(others, key=lambda n: others[n]["score"], default=None)
    ratio = f"{results[top]['score'] / results[name]['score']:.2f}x" if top and results[name]["score"] else None
    if name == kept:
        if top is None:
            return f"{name}, as chosen {when} (no other engine could serve)"
        return (f"{name}, as chosen {when} ({top} scored {ratio} of it; a switch needs more than "
                f"{MARGIN:.2f}x measured undisturbed)")
    if kept and kept != name:
        return f"{name}: it scored more than {MARGIN:.2f}x {kept}, the engine chosen {when.split(' on ')[0]}"
    if top is None:
        return f"{name}, the only engine that could serve it"
    return f"{name}: highest benchmark score ({top} scored {ratio} of it)"
