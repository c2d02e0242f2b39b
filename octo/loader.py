"""From ``octo serve MODEL [--engine NAME]`` to a loaded ModelHandle: resolve, choose the engine, load."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine
from octo.errors import ConfigError, ModelNotFound
from octo.model import ModelHandle, load_engine
from octo.plugins import KNOWN_ENGINES, engine_registry, load_errors

log = logging.getLogger("octo.loader")


def engine_rows(registry: dict[str, type[Engine]], active: str | None = None,
                benchmarks: dict[str, Any] | None = None, engine: Engine | None = None) -> list[dict[str, Any]]:
    """Every known engine (built-in or plugin), for /v1/engines and ``octo engines``.

    ``engine`` is the loaded active engine: its row shows the live batching mode and the model's details.
    """
    rows = []
    names = list(dict.fromkeys([*KNOWN_ENGINES, *(c.name for c in registry.values())]))
    for name in names:
        cls = registry.get(name)
        if cls is None:
            err = load_errors.get(f"octo.engines.{name}")
            rows.append({"name": name, "available": False,
                         "reason": f"plugin failed to load: {err}" if err else "engine plugin not installed",
                         "tasks": [], "formats": [], "version": None, "batching": None,
                         "benchmark": (benchmarks or {}).get(name), "active": False})
            continue
        try:
            det = cls.detect()
        except Exception as exc:  # noqa: BLE001 - detect must not take the server down
            det_available, det_reason = False, f"detect() failed: {exc}"
        else:
            det_available, det_reason = det.available, det.reason
        try:
            version = cls.version() if det_available else None
        except Exception:  # noqa: BLE001
            version = None
        rows.append({"name": name, "available": det_available, "reason": det_reason or None,
                     "tasks": sorted(t.value for t in cls.tasks), "formats": sorted(cls.formats),
                     "version": version, "batching": cls.batching,
                     "benchmark": (benchmarks or {}).get(name), "active": name == active})
        if engine is not None and name == active:
            rows[-1]["batching"] = engine.batching
            if engine.info is not None:
                rows[-1]["model"] = engine.info.extra
    return rows


def canonical_engine(name: str | None, registry: dict[str, type[Engine]]) -> str | None:
    if name is None:
        return None
    cls = registry.get(name)
    if cls is None:
        known = ", ".join(sorted({c.name for c in registry.values()}))
        why = load_errors.get(f"octo.engines.{name}")
        extra = f" (its plugin failed to load: {why})" if why else ""
        raise ConfigError(f"Unknown engine '{name}'{extra}; installed engines: {known}.", param="engine")
    det = cls.detect()
    if not det.available:
        raise ConfigError(f"Engine '{cls.name}' is not available here: {det.reason}", param="engine")
    return cls.name


def open_model(config: ServerConfig, registry: dict[str, type[Engine]] | None = None,
               say: Callable[[str], None] = print) -> tuple[ModelHandle, list[dict[str, Any]]]:
    registry = registry or engine_registry()
    engine_name = canonical_engine(config.engine, registry)
    if engine_name is not None and "any" in registry[engine_name].formats:
        # engines such as echo serve any name and need no artifact
        engine = load_engine(registry[engine_name], config, config.model, config.model)
        handle = ModelHandle(config.model, (), engine_name, engine, config.model,
                             selection={"reason": f"--engine {engine_name}", "candidates": [engine_name]})
        return handle, engine_rows(registry, engine_name, engine=engine)
    from octo.catalog import load_catalog
    from octo.download import fetch

    formats = {c.name: c.formats for c in registry.values()}  # canonical names only, never aliases
    resolved = load_catalog().resolve(config.model, formats)
    usable = {e: a for e, a in resolved.artifacts.items() if e in registry and registry[e].detect().available}
    if engine_name is not None:
        if engine_name not in resolved.artifacts:
            have = ", ".join(sorted(resolved.artifacts)) or "none"
            raise ModelNotFound(f"Model '{resolved.name}' has no artifact for engine '{engine_name}'; "
                                f"engines with one: {have}.", param="engine")
        artifact = resolved.artifacts[engine_name]
        say(f"octo: {resolved.name}: loading with {engine_name} ({artifact.uri})")
        path = fetch(artifact)
        engine = load_engine(registry[engine_name], config, str(path), resolved.name)
        handle = ModelHandle(resolved.name, tuple(resolved.aliases), engine_name, engine, str(path),
                             selection={"reason": f"--engine {engine_name}", "candidates": [engine_name]})
        return handle, engine_rows(registry, engine_name, engine=engine)
    real = {e: a for e, a in usable.items() if "any" not in registry[e].formats}
    candidates = real or usable  # echo-like engines only when no real engine can serve the model
    if not candidates:
        have = ", ".join(sorted(resolved.artifacts)) or "none"
        raise ConfigError(f"No installed engine can serve '{resolved.name}' here (artifacts for: {have}). "
                          "Install one with pip install 'octo[llamacpp]' (or mlx, onnx, whisper).")
    paths, failed = {}, {}
    for name, artifact in candidates.items():
        say(f"octo: {resolved.name}: {name} artifact {artifact.uri}")
        try:
            paths[name] = str(fetch(artifact))
        except Exception as exc:  # noqa: BLE001 - one unavailable artifact must not stop the others
            failed[name] = f"artifact unavailable: {getattr(exc, 'message', None) or exc}"
            say(f"octo: {name}: {failed[name]}")
    candidates = {n: a for n, a in candidates.items() if n in paths}
    if not candidates:
        raise ConfigError(f"No engine could get an artifact for '{resolved.name}': "
                          + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    if len(candidates) == 1:
        (chosen,) = candidates
        engine = load_engine(registry[chosen], config, paths[chosen], resolved.name)
        reason, results = "only candidate engine", {}
    else:
        from octo.selection import select

        chosen, engine, results, reason = select(
            {n: (registry[n], paths[n]) for n in candidates},
            lambda cls, path: load_engine(cls, config, path, resolved.name),
            seconds=config.bench_seconds, rebench=config.rebench, say=say)
    for name, err in failed.items():
        results[name] = {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None, "threads": None,
                         "score": 0.0, "cached": False, "seconds": None, "error": err}
    handle = ModelHandle(resolved.name, tuple(resolved.aliases), chosen, engine, paths[chosen],
                         selection={"reason": reason, "candidates": sorted([*candidates, *failed])},
                         benchmarks=results)
    return handle, engine_rows(registry, chosen, results, engine=engine)
