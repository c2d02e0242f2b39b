"""From ``octo serve MODEL [--engine NAME]`` to a loaded ModelHandle: resolve, choose the engine, load."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine
from octo.errors import ConfigError, ModelNotFound, OctoError
from octo.logsafe import quoted
from octo.plugins import KNOWN_ENGINES, engine_registry, load_errors
from octo.runtime.prespawn import LOAD_HANDED_OVER
from octo.runtime.selection import Candidate
from octo.scheduler.posting import new_engine_thread

log = logging.getLogger("octo.runtime.loader")
ENGINE_EXTRAS = ("llamacpp", "mlx", "onnx", "whisper")  # built-in engines with a pip extra of the same name


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


def canonical_engine(name: str | None, registry: dict[str, type[Engine]], isolation: str | None = None
                     ) -> str | None:
    """The canonical name of engine ``name`` (None: none named), checked to be available here; an engine that will
    run in a worker process (``isolation`` or its own) is checked there (``check_available``, at its load), so that
    its library is not imported into the gateway before it serves."""
    if name is None:
        return None
    cls = registry.get(name)
    if cls is None:
        known = ", ".join(sorted({c.name for c in registry.values()}))
        why = load_errors.get(f"octo.engines.{name}")
        extra = f" (its plugin failed to load: {why})" if why else ""
        raise ConfigError(f"Unknown engine '{name}'{extra}; installed engines: {known}.", param="engine")
    if (isolation or cls.isolation) != "process":
        check_available(cls)
    return cls.name


def check_available(cls: type[Engine]) -> None:
    det = cls.detect()
    if not det.available:
        raise ConfigError(f"Engine '{cls.name}' is not available here: {det.reason}", param="engine")


class LocalCandidate(Candidate):
    """An engine loaded in this process (``--isolation thread``)."""

    def __init__(self, cls: type[Engine], artifact: str, name: str, config: ServerConfig) -> None:
        self.cls, self.artifact, self.name, self.config = cls, artifact, name, config
        self.engine: Engine | None = None
        self.thread = new_engine_thread()  # load, benchmark and (the winner) serving all run on this one thread

    async def _on_thread(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    async def open(self, bench):
        from octo.runtime.model import load_engine

        t = time.perf_counter()
        LOAD_HANDED_OVER.set()
        self.engine = await self._on_thread(load_engine, self.cls, self.config, self.artifact, self.name)
        load_s = time.perf_counter() - t
        if bench is None:
            return load_s, None
        from octo.runtime.benchmark import micro_benchmark

        self.wait_prepare()
        return load_s, await self._on_thread(micro_benchmark, self.engine, *bench)

    async def set_threads(self, n: int) -> None:
        if n in self.engine.thread_counts():
            await self._on_thread(self.engine.set_threads, n)

    async def discard(self) -> None:
        try:
            await self._on_thread(self.engine.unload)
        except Exception:  # noqa: BLE001
            log.exception("unload failed")
        self.thread.shutdown(wait=False)

    def handle(self, aliases: tuple[str, ...], **kw: Any) -> Any:
        from octo.runtime.model import ModelHandle

        handle = ModelHandle(self.name, aliases, self.cls.name, self.engine, self.artifact, **kw)
        handle.engine_thread = self.thread
        # in the gateway only because --isolation thread said so: its tokenizer and template must not block the
        # server's loop (an engine that declares itself safe there, as the pure-Python echo, runs them inline: a hop
        # to a thread costs about 0.2 ms a request, bench/overhead.py)
        handle.guard_loop = self.cls.isolation != "thread"
        return handle


class WorkerCandidate(Candidate):
    """An engine loaded in its own worker process (``--isolation process``): a crash loses only the candidate."""

    in_process = False

    def __init__(self, cls: type[Engine], artifact: str, name: str, config: ServerConfig,
                 say: Callable[[str], None]) -> None:
        self.cls, self.artifact, self.name, self.config, self.say = cls, artifact, name, config, say
        self.worker = self.loaded = self.spawned = None  # spawned: the worker while it loads (one to kill)
        self.spare = True  # the spare worker may take it (not a background measurement's: octo.runtime.remeasure)

    async def open(self, bench):
        from octo.runtime.process import remembered, start_worker

        first = remembered(self.cls, self.artifact, self.config.options)
        self.worker, self.loaded = await start_worker(self.cls, self.artifact, self.name, self.config, first=first,
                                                      bench=bench, say=self.say,
                                                      spawned=lambda w: setattr(self, "spawned", w),
                                                      spare=self.spare)
        return self.loaded["load_seconds"], self.loaded.get("benchmark")

    async def set_threads(self, n: int) -> None:
        await self.worker.request("set_threads", n)

    async def discard(self) -> None:
        await self.worker.stop()

    def handle(self, aliases: tuple[str, ...], **kw: Any):
        from octo.runtime.remote import RemoteHandle

        return RemoteHandle(self.name, aliases, self.cls, self.artifact, self.config, self.worker, self.loaded, **kw)


def _candidates(resolved: Any, engine_name: str | None, registry: dict[str, type[Engine]]) -> dict[str, Any]:
    """Engine -> artifact for the engines that can serve ``resolved`` here (``engine_name`` alone when given);
    echo-like engines only when no real engine can."""
    if engine_name is not None:
        if engine_name not in resolved.artifacts:
            have = ", ".join(sorted(resolved.artifacts)) or "none"
            raise ModelNotFound(f"Model '{resolved.name}' has no artifact for engine '{engine_name}'; "
                                f"engines with one: {have}.", param="engine")
        return {engine_name: resolved.artifacts[engine_name]}
    usable = {e: a for e, a in resolved.artifacts.items() if e in registry and registry[e].detect().available}
    real = {e: a for e, a in usable.items() if "any" not in registry[e].formats}
    candidates = real or usable
    if not candidates:
        have = ", ".join(sorted(resolved.artifacts)) or "none"
        why = [f"{e}: {registry[e].detect().reason}" for e in sorted(resolved.artifacts) if e in registry]
        extras = " or ".join(f"pip install 'octo[{e}]'" for e in sorted(resolved.artifacts)
                             if e in ENGINE_EXTRAS and e not in registry)
        raise ConfigError(f"No installed engine can serve '{resolved.name}' here (artifacts for: {have}). "
                          + (f"Unavailable here: {'; '.join(why)}. " if why else "")
                          + (f"Install one with {extras}." if extras else
                             "" if why else "Install an engine plugin that reads it."))
    return candidates


def resolve_local(model: str, engine: str | None, registry: dict[str, type[Engine]], need_local: bool = True,
                  isolation: str | None = None, options: dict[str, Any] | None = None,
                  ) -> tuple[str, tuple[str, ...], str, int]:
    """(name, aliases, task, estimated bytes: weights + KV, octo.runtime.memguard) of a model this host can load,
    without
    downloading anything;
    404 for an unknown model, and (``need_local``: a request's model) for one whose artifacts are not downloaded,
    naming the `octo pull` command."""
    from octo.models.download import ArtifactNotDownloaded, is_downloaded, local_path, pull_command
    from octo.models.resolve import resolve
    from octo.runtime.memguard import model_bytes

    engine_name = canonical_engine(engine, registry, isolation)
    if engine_name is not None and "any" in registry[engine_name].formats:
        return model, (), "chat", 0
    resolved = resolve(model, {c.name: c.formats for c in registry.values()}, offline=need_local,
                       bare_paths=not need_local)  # a request's 'org/name' is never a folder of the working folder
    candidates = _candidates(resolved, engine_name, registry)
    local = {e: a for e, a in candidates.items() if is_downloaded(a)}
    if not local and need_local:
        first = next(iter(candidates.values()))
        raise ArtifactNotDownloaded(f"Model '{resolved.name}' is not downloaded here, and requests never start "
                                    f"a download. Download it first: {pull_command(first)}.", param="model")
    sizes = [model_bytes(path, options) for path in map(local_path, local.values()) if path is not None]
    return resolved.name, tuple(resolved.aliases), resolved.task, max(sizes, default=0)


def servable_catalog(registry: dict[str, type[Engine]]) -> list[dict[str, Any]]:
    """Catalog models this host could load on demand now: an installed, available engine has an artifact for the
    default variant, and that artifact is downloaded (or synthetic, built locally)."""
    from octo.models.catalog import load_catalog
    from octo.models.download import is_downloaded

    catalog = load_catalog()
    out = []
    for entry in catalog.entries:
        artifacts = catalog.artifacts(entry, entry.default_variant)
        usable = [e for e, a in artifacts.items() if e in registry and "any" not in registry[e].formats
                  and registry[e].detect().available and _downloaded(a, is_downloaded)]
        if usable:
            out.append({"id": entry.id, "task": entry.task, "aliases": list(entry.aliases), "engines": usable})
    return out


def _downloaded(artifact: Any, is_downloaded: Callable[[Any], bool]) -> bool:
    try:
        return is_downloaded(artifact)
    except Exception:  # noqa: BLE001 - a broken cache entry reads as "not downloaded"
        return False


def isolation_of(cls: type[Engine], config: ServerConfig) -> str:
    return config.isolation or cls.isolation


def candidate(cls: type[Engine], artifact: str, name: str, config: ServerConfig,
              say: Callable[[str], None]) -> Candidate:
    if isolation_of(cls, config) == "process":
        return WorkerCandidate(cls, artifact, name, config, say)
    return LocalCandidate(cls, artifact, name, config)


async def open_model(config: ServerConfig, registry: dict[str, type[Engine]] | None = None,
                     say: Callable[[str], None] = print, download: bool = True, lazy_rows: bool = False
                     ) -> tuple[Any, Any]:
    """Resolve ``config.model``, choose its engine (the start-up benchmark when several can serve it) and load it,
    in this process or in a worker; returns the handle (not yet activated) and the /v1/engines rows (with
    ``lazy_rows``, a function that makes them: detecting every engine imports its library, which a gateway does only
    when asked). With ``download`` false (a load a request asked for) artifacts that are not here are not
    downloaded."""
    offline = None if download else True
    registry = registry or engine_registry()
    engine_name = canonical_engine(config.engine, registry, config.isolation)
    if engine_name is not None and "any" in registry[engine_name].formats:
        # engines such as echo serve any name and need no artifact
        cand = candidate(registry[engine_name], config.model, config.model, config, say)
        await cand.open(None)
        handle = cand.handle((), selection={"reason": f"--engine {engine_name}", "candidates": [engine_name]})
        return handle, _rows(lazy_rows, registry, engine_name, engine=_engine_view(handle))
    from octo.models.download import fetch
    from octo.models.resolve import resolve

    formats = {c.name: c.formats for c in registry.values()}  # canonical names only, never aliases
    resolved = await asyncio.to_thread(resolve, config.model, formats, not download, download)
    candidates = _candidates(resolved, engine_name, registry)
    if engine_name is not None:
        artifact = candidates[engine_name]
        say(f"octo: {quoted(resolved.name, bare=True)}: loading with {engine_name} ({quoted(artifact.uri, bare=True)})")
        path = await asyncio.to_thread(fetch, artifact, offline=offline)
        cand = candidate(registry[engine_name], str(path), resolved.name, config, say)
        await _open_or_fail(cand, registry, lazy_rows)
        handle = cand.handle(tuple(resolved.aliases),
                             selection={"reason": f"--engine {engine_name}", "candidates": [engine_name]})
        return handle, _rows(lazy_rows, registry, engine_name, engine=_engine_view(handle))
    paths, failed, whys = await _fetch_all(resolved.name, candidates, offline, say)
    if not paths:
        raise _no_artifact(resolved.name, failed, whys)
    configs = options_per_engine({n: registry[n] for n in paths}, config, resolved.name, say)
    cands = {n: candidate(registry[n], paths[n], resolved.name, configs[n], say) for n in paths}
    if len(cands) == 1:
        (chosen, cand), = cands.items()
        await _open_or_fail(cand, registry, lazy_rows)
        reason, results = "only candidate engine", {}
    else:
        from octo.runtime.selection import select

        try:
            chosen, cand, results, reason = await select(cands, seconds=config.bench_seconds, rebench=config.rebench,
                                                         say=say, defer=config.bench_when_idle and not config.rebench)
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from None
    for name, err in failed.items():
        results[name] = {"prefill_tok_s": None, "decode_tok_s": None, "batch_decode_tok_s": None, "threads": None,
                         "score": 0.0, "cached": False, "seconds": None, "error": err}
    handle = cand.handle(tuple(resolved.aliases), selection={"reason": reason,
                                                             "candidates": sorted([*paths, *failed])},
                         benchmarks=results)
    handle.remeasure = pending_of(resolved.name, tuple(resolved.aliases), chosen, cands, results, config, registry)
    return handle, _rows(lazy_rows, registry, chosen, results, engine=_engine_view(handle))


def pending_of(model: str, aliases: tuple[str, ...], chosen: str, cands: dict[str, Candidate], results: dict[str, Any],
             config: ServerConfig, engines: dict[str, type[Engine]]) -> Any:
    """What the selection left provisional, for the gateway to measure again while the model is idle
    (``octo.runtime.remeasure``), each candidate in a worker of its own whatever ``--isolation`` says, and how to
    serve the model with another engine if one wins (in a worker, as it would load)."""
    names = sorted((n for n in cands if results.get(n, {}).get("provisional") or results.get(n, {}).get("unmeasured")),
                   key=lambda n: (n != chosen, -(results[n].get("score") or 0.0)))  # the serving one first: the leader
    if not names:
        return None
    from octo.runtime.remeasure import Pending
    from octo.runtime.selection import candidate_key

    def make(n: str) -> WorkerCandidate:  # a new process: taking the spare would start its replacement meanwhile
        cand = WorkerCandidate(cands[n].cls, cands[n].artifact, model, getattr(cands[n], "config", config), log.info)
        cand.spare = False
        return cand

    def serving_candidate(n: str) -> Candidate | None:
        cand = candidate(cands[n].cls, cands[n].artifact, model, getattr(cands[n], "config", config), log.info)
        return cand if isinstance(cand, WorkerCandidate) else None

    def handle_of(cand: Candidate, n: str, reason: str) -> tuple[Any, Any]:
        handle = cand.handle(aliases, selection={"reason": reason, "candidates": sorted(results)}, benchmarks=results)
        return handle, _rows(True, engines, n, results, engine=_engine_view(handle))

    return Pending(model, chosen, config.bench_seconds, {n: candidate_key(c) for n, c in cands.items()},
                   results, make, {n: c.artifact for n, c in cands.items()}, names, serving_candidate, handle_of,
                   first=any(results[n].get("unmeasured") for n in names),
                   unchosen=bool(results.get(chosen, {}).get("unmeasured")))


def options_per_engine(classes: dict[str, type[Engine]], config: ServerConfig, model: str,
                       say: Callable[[str], None]) -> dict[str, ServerConfig]:
    """Each candidate engine's configuration: with several candidates, each gets only the ``-o`` options it declares
    (``Engine.option_names``), so that ``-o n_threads=2`` (llama.cpp's) works whichever engine wins; one line says
    which engines run without an option. An option no candidate declares is an error naming it."""
    if len(classes) < 2 or not config.options:
        return {n: config for n in classes}
    declared = {n: cls.__dict__.get("option_names") for n, cls in classes.items()}  # the class's own declaration
    takers = {key: [n for n, names in declared.items() if names is None or key in names] for key in config.options}
    unknown = [key for key, names in takers.items() if not names]
    if unknown:
        known = sorted(set().union(*(names for names in declared.values() if names)))
        raise ConfigError(f"Unknown option '{unknown[0]}': no engine that can serve '{model}' here "
                          f"({', '.join(classes)}) takes it; their options: {', '.join(known)}.", param=unknown[0])
    for key, names in takers.items():
        if len(names) < len(classes):
            left = [n for n in classes if n not in names]
            say(f"octo: -o {key} is an option of {', '.join(names)} only: {', '.join(left)} "
                f"{'runs' if len(left) == 1 else 'run'} without it")
    return {n: config if all(n in takers[k] for k in config.options) else
            dataclasses.replace(config, options={k: v for k, v in config.options.items() if n in takers[k]})
            for n in classes}


def _no_artifact(name: str, failed: dict[str, str], whys: dict[str, str | None]) -> OctoError:
    """Why no candidate engine has an artifact: one sentence when none is downloaded for one reason (offline, the hub
    unreachable), else each engine's failure."""
    from octo.models.download import ArtifactNotDownloaded

    if len(set(whys.values())) == 1 and None not in whys.values():
        return ArtifactNotDownloaded(f"'{name}' is not downloaded here and {next(iter(whys.values()))}. Download it "
                                     f"first, with network access: octo pull {name}", param="model")
    return ConfigError(f"No engine could get an artifact for '{name}': "
                       + "; ".join(f"{n}: {e}" for n, e in failed.items()))


async def _fetch_all(name: str, candidates: dict[str, Any], offline: bool | None,
                     say: Callable[[str], None]) -> tuple[dict[str, str], dict[str, str], dict[str, str | None]]:
    """Each candidate engine's artifact, here (downloaded unless ``offline``): the paths, why the others failed, and
    for those not downloaded the reason a download cannot happen now (offline...; None for other failures). The
    failures are said only when another engine has its artifact: when none has, the caller says it once."""
    from octo.models.download import fetch

    paths, failed, whys = {}, {}, {}
    for engine, artifact in candidates.items():
        say(f"octo: {quoted(name, bare=True)}: {engine} artifact {quoted(artifact.uri, bare=True)}")
        try:
            paths[engine] = str(await asyncio.to_thread(fetch, artifact, offline=offline))
        except Exception as exc:  # noqa: BLE001 - one unavailable artifact must not stop the others
            failed[engine] = f"artifact unavailable: {getattr(exc, 'message', None) or exc}"
            whys[engine] = getattr(exc, "cannot_download", None)
    if paths:
        for engine, why in failed.items():
            say(f"octo: {engine}: {why}")
    return paths, failed, whys


def _rows(lazy: bool, *args: Any, **kw: Any) -> Any:
    rows = functools.partial(engine_rows, *args, **kw)
    return rows if lazy else rows()


async def _open_or_fail(cand: Candidate, registry: dict[str, type[Engine]], lazy_rows: bool = False) -> None:
    """Load ``cand``; unless the rows are made later (``lazy_rows``), a thread meanwhile detects every installed
    engine (``engine_rows``: each one's library is imported into this process the first time), so the rows made once
    the model is loaded cost nothing."""
    detecting = None if lazy_rows else asyncio.ensure_future(asyncio.to_thread(engine_rows, registry))
    try:
        await cand.open(None)
    except OctoError as err:
        raise ConfigError(err.message) from None
    if detecting is not None:
        await detecting


class _EngineView:
    """What ``engine_rows`` shows of the active engine, for a model in this process or in a worker."""

    def __init__(self, batching: str, info: Any) -> None:
        self.batching, self.info = batching, info


def _engine_view(handle: Any) -> Any:
    engine = getattr(handle, "engine", None)
    return engine if engine is not None else _EngineView(handle.batching, handle.info)
