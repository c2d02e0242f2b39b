"""The model registry: every model a server can serve, which of them are loaded, and routing by ``model``.

Models named at start-up (``octo serve A B``, ``--models-file``) load then and stay loaded unless they have a
``keep_alive``; a request for any other servable model (a catalog entry whose artifact is here, a local path, a
synthetic model) loads it on demand, once however many requests wait for it, and it unloads after ``--keep-alive``
idle. ``--max-loaded`` and ``--memory-budget`` make room by unloading the least recently used idle model (never
one with requests in flight, never a pinned one or one named at start: octo.runtime.room). Each loaded model is an
ordinary handle (``octo.runtime.model`` in this process, ``octo.runtime.remote`` in a worker), chosen by the start-up
benchmark like a single served model.
What the server is told about each model (``ModelSpec``, the models file, ``keep_alive``) is in ``octo.runtime.specs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine
from octo.errors import InvalidRequest, ModelFailed, ModelNotFound, OctoError, Overloaded, QueueTimeout
from octo.logsafe import quoted
from octo.runtime.names import public_name
from octo.runtime.room import RoomMixin
from octo.runtime.specs import ModelSpec, catalog_max_tokens, parse_keep_alive

log = logging.getLogger("octo.runtime.registry")
CATALOG_SCAN_DELAY_S = 3.0  # the first scan of the catalog's servable models, after the server starts ...
LULL_QUIET_S = 1.0  # ... in a lull (as a new spare worker's start): no request in flight or ended this recently ...
CATALOG_SCAN_LATEST_S = 30.0  # ... or this long after the start, busy or not
MAX_SPELLINGS = 256  # requests' spellings of model names remembered (the most recent)
class Slot:
    """One servable model and, while it is loaded, its handle."""

    def __init__(self, spec: ModelSpec, name: str, aliases: set[str], task: str | None) -> None:
        self.spec = spec
        self.name = name
        self.aliases = aliases
        self.task = task
        self.handle: Any = None
        self._rows: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]] = []
        self.loading: asyncio.Task | None = None
        self.error: OctoError | None = None
        self.failed_at = 0.0
        self.failures = 0  # failed loads in a row: the back-off before the next try (octo.runtime.supervision.backoff)
        self.loading_since = 0.0  # monotonic start of the load in progress
        self.inflight = 0
        self.last_used = time.monotonic()
        self.loaded_at = 0.0
        self.keep_alive = spec.keep_alive
        self.artifact_bytes = 0
        self.estimated_bytes = 0
        self.load_seconds: float | None = None
        self.no_room = ""  # why its load waits for room (a loaded model to become idle); "" when it does not
        self.remeasure: asyncio.Task | None = None  # measuring again what selection left provisional

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The /v1/engines rows of its engines, made the first time they are asked for (``open_model``'s
        ``lazy_rows``: detecting every engine imports its library into the gateway, not done before it serves)."""
        if callable(self._rows):
            self._rows = self._rows()
        return self._rows

    @rows.setter
    def rows(self, rows: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]) -> None:
        self._rows = rows

    @property
    def state(self) -> str:
        if self.loading is not None:
            return "loading"
        if self.handle is not None:  # a worker silent for a few beats shows it before it is killed for it
            state = self.handle.state
            return "unresponsive" if state == "ready" and getattr(self.handle, "silent", False) else state
        if self.error is not None:
            return "failed"
        return "available"

    def retry_in(self) -> float:
        """Seconds before a failed load is tried again (0: now)."""
        from octo.runtime.supervision import backoff

        if self.error is None:
            return 0.0
        return max(0.0, self.failed_at + backoff(self.failures) - time.monotonic())

    def progress(self) -> dict[str, Any]:
        """What /health, /v1/models and the dashboard show of a load in progress or a failed one."""
        if self.state == "loading":
            since = self.loading_since if self.loading is not None else getattr(self.handle, "loading_since", 0.0)
            return {"loading_s": round(time.monotonic() - since, 3) if since else None, "waiting": self.inflight}
        if self.error is not None and self.handle is None:
            return {"retry_in_s": round(self.retry_in(), 3)}
        return {}

    def expires_at(self) -> float | None:
        """Wall-clock time at which an idle loaded model unloads (None: never)."""
        if self.handle is None or self.keep_alive is None or self.spec.pinned:
            return None
        return time.time() + max(0.0, self.keep_alive - (time.monotonic() - self.last_used)) if self.inflight == 0 \
            else None

    def matches(self, model: str) -> bool:
        if model == self.name or model in self.aliases:
            return True
        return model == "whisper-1" and self.task == "transcription"


class Registry(RoomMixin):
    def __init__(self, config: ServerConfig, engines: dict[str, type[Engine]],
                 say: Callable[[str], None] = log.info) -> None:
        self.config = config
        self.engines = engines
        self.say = say
        self.slots: list[Slot] = []
        self._by_name: dict[str, Slot] = {}
        self._sweeper: asyncio.Task | None = None
        self._room = asyncio.Lock()  # one load decides about eviction at a time
        self._freed = asyncio.Event()  # a model became idle or unloaded (a load waiting for room looks again)
        self._spellings: OrderedDict[str, Slot] = OrderedDict()  # requests' other spellings, bounded (_remember)
        self.loads = 0
        self.unloads = 0
        self.cluster: Any = None  # octo.cluster.deploy.Cluster with --cluster: models load as Ray Serve deployments
        self.starting = False  # start() runs: it reports the failed loads itself

    # -- start-up and shutdown -----------------------------------------------------------------------------
    async def start(self, specs: list[ModelSpec]) -> None:
        """Load the models named at start-up, in order. One that cannot load (not downloaded, offline, no engine...)
        is reported once with its own reason and the others serve, as Ollama serves what it has; when none loads, the
        start stops with every model's reason. The keep-alive sweeper starts with the app (``activate_all``)."""
        problems: list[tuple[str, str, str]] = []  # (model, the whole reason, its cause)
        self.starting = True
        try:
            for spec in specs:
                slot = None
                try:
                    slot = await self._slot_for(spec.model, spec)
                    await self._load(slot)
                except OctoError as exc:
                    if slot is not None:  # not served: a request for it is answered as for any model not named
                        self._drop(slot)
                    problems.append((spec.model, getattr(exc, "why", exc.message), getattr(exc, "cause", exc.message)))
        finally:
            self.starting = False
        if problems and len(problems) == len(specs):  # nothing to serve: the start stops, every reason said once
            raise ModelFailed(problems[0][1] if len(problems) == 1 else "no model named could be served:\n"
                              + "\n".join(f"  - '{model}': {cause}" for model, _, cause in problems), param="model")
        for model, _, cause in problems:
            self.say(f"octo: not serving '{quoted(model, bare=True)}': {cause}")

    def _drop(self, slot: Slot) -> None:
        """Forget a model that failed to load at start-up (it has no handle)."""
        self.slots.remove(slot)
        self._by_name = {n: s for n, s in self._by_name.items() if s is not slot}

    def adopt(self, handle: Any, rows: list[dict[str, Any]] | None = None, spec: ModelSpec | None = None) -> Slot:
        """Add a model that is already loaded (its handle not yet activated: ``activate_all`` does that)."""
        slot = Slot(spec or ModelSpec(handle.name, engine=handle.engine_name), handle.name, set(handle.aliases),
                    handle.task)
        slot.handle, slot.rows, slot.loaded_at = handle, rows or [], time.time()
        self.slots.append(slot)
        for name in (handle.name, *handle.aliases):
            self._by_name.setdefault(name, slot)
        return slot

    async def activate_all(self) -> None:
        for slot in self.loaded():
            await slot.handle.activate(self.config_for(slot.spec) if slot.spec.declared else self.config)
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep())
            # /v1/models answers from it; a few seconds later, in a lull, so that its imports (huggingface_hub: 0.3 s
            # holding the GIL) and file scans do not compete with the first requests (a /v1/models starts it at once)
            self._scan_timer = loop.call_later(CATALOG_SCAN_DELAY_S, self._scan_in_a_lull, time.monotonic())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._scan_timer.cancel()
        for slot in self.slots:
            if slot.loading is not None:
                slot.loading.cancel()
        await asyncio.gather(*(self._unload(s) for s in self.slots if s.handle is not None), return_exceptions=True)
        from octo.runtime.process import SPARE

        await SPARE.close()
        if self.cluster is not None:
            await self.cluster.close()

    async def catalog_available(self) -> list[dict[str, Any]]:
        """Catalog models servable on demand that the registry has no slot for yet. Scanned when the app starts and
        again in the background every 30 s, so that /v1/models answers at once from what it has (the first scan, a
        few seconds on a cold host, is waited for 0.5 s at most: until it ends, the listing has no catalog rows)."""
        cached = getattr(self, "_catalog", None)
        if cached is None or time.monotonic() - cached[0] > 30:
            task = self._scan_catalog()
            if cached is None:
                try:
                    cached = await asyncio.wait_for(asyncio.shield(task), 0.5)
                except TimeoutError:
                    return []
        return [r for r in cached[1] if self.find(r["id"]) is None]

    def _scan_in_a_lull(self, started: float) -> None:
        """(timer) The first catalog scan once no request ran for ``LULL_QUIET_S``, else half a second later
        (``CATALOG_SCAN_LATEST_S`` after ``started`` at the latest)."""
        if time.monotonic() - started < CATALOG_SCAN_LATEST_S and not self.lull():
            self._scan_timer = asyncio.get_running_loop().call_later(0.5, self._scan_in_a_lull, started)
            return
        self._scan_catalog()

    def lull(self) -> bool:
        """No request in flight, none ended in ``LULL_QUIET_S``: background work (catalog scan, spare) goes now."""
        return not any(s.inflight or time.monotonic() - s.last_used < LULL_QUIET_S for s in self.slots)

    def _scan_catalog(self) -> asyncio.Task:
        task = getattr(self, "_catalog_scan", None)
        if task is None or task.done():
            self._catalog_scan = task = asyncio.get_running_loop().create_task(self._catalog_rows())
        return task

    async def _catalog_rows(self) -> tuple[float, list[dict[str, Any]]]:
        from octo.runtime.loader import servable_catalog

        try:
            rows = await asyncio.to_thread(servable_catalog, self.engines)
        except OctoError as exc:  # a broken catalog file: listed models stay listable
            log.warning("catalog unavailable: %s", exc.message)
            rows = []
        self._catalog = (time.monotonic(), rows)
        return self._catalog

    # -- routing -----------------------------------------------------------------------------------------
    def loaded(self) -> list[Slot]:
        return [s for s in self.slots if s.handle is not None]

    def find(self, model: str | None) -> Slot | None:
        """The slot named ``model`` (a name, an alias, a path, ``whisper-1``, ``base:adapter`` for one of a model's
        LoRA adapters, or ``name:latest``, Ollama's tag of a name), without resolving anything."""
        if model:
            slot = self._named(model)
            if slot is not None:
                return slot
            base, sep, adapter = model.rpartition(":")
            if sep and base and adapter:
                slot = self._named(base)  # one level: "a:b:c" is base "a:b" (a name:variant) and adapter "c"
                if slot is not None and (adapter in slot.spec.lora or adapter == "latest"):
                    return slot
        return None

    def _named(self, model: str) -> Slot | None:
        slot = self._by_name.get(model) or self._spellings.get(model)
        if slot is not None:
            return slot
        return next((s for s in self.slots if s.matches(model)), None)

    def _remember(self, spelling: str, slot: Slot) -> None:
        """A request's spelling of a model ("./m.gguf", "DEMO") kept for the next request, the most recent
        ``MAX_SPELLINGS`` only: spellings are the clients' to invent, the registry's memory is not."""
        self._spellings[spelling] = slot
        self._spellings.move_to_end(spelling)
        while len(self._spellings) > MAX_SPELLINGS:
            self._spellings.popitem(last=False)

    def _servable(self, model: str) -> str:
        """The spelling of a request's ``model`` to resolve (a path as its real path); the 404 of an unknown name
        for one the operator did not make servable (octo.models.servable)."""
        from octo.models.catalog import load_catalog
        from octo.models.servable import request_model

        names = {n.lower() for n in load_catalog().all_names()}
        declared = frozenset(a for s in self.slots if s.spec.declared for a in (s.name, *s.aliases) if a[:1] == "/")
        return request_model(model, names, self.config.models_dirs, self.config.allow_any_path, declared)

    async def route(self, model: str | None) -> Slot:
        """The slot serving ``model``; a new on-demand slot for a servable model not seen before. Without a
        ``model``, the only model there is (a 400 naming ``model`` when there are several)."""
        if not model:
            candidates = [s for s in self.slots if s.handle is not None or s.spec.declared]
            if len(candidates) == 1:
                return candidates[0]
            names = ", ".join(s.name for s in candidates) or "none"
            raise InvalidRequest(f"'model' is required when this server has several models (loaded: {names}).",
                                 param="model") if candidates else \
                InvalidRequest("'model' is required: no model is loaded yet.", param="model")
        slot = self.find(model)
        if slot is not None:
            return slot
        model = model.removesuffix(":latest") or model  # Ollama's tag of the default: the name alone
        try:
            return await self._slot_for(model, ModelSpec(model, declared=False, keep_alive=self.config.keep_alive))
        except (ModelNotFound, InvalidRequest):
            base, sep, adapter = model.rpartition(":")
            slot = self.find(base) if sep and base else None
            if slot is not None and slot.spec.lora:  # a model with adapters, none of them this one
                known = ", ".join(f"{slot.name}:{a}" for a in slot.spec.lora)
                raise ModelNotFound(f"Model '{slot.name}' has no LoRA adapter '{adapter}'; its adapters: {known}.",
                                    param="model") from None
            raise

    async def _slot_for(self, model: str, spec: ModelSpec) -> Slot:
        """Resolve ``model`` (catalog, path, Hugging Face id) to its slot, creating one when it is new."""
        from octo.runtime.loader import resolve_local

        typed = model
        try:
            if not spec.declared:
                model = spec.model = await asyncio.to_thread(self._servable, model)
            name, aliases, task, nbytes = await asyncio.to_thread(  # (spec.options: -o mmproj, the projector)
                resolve_local, model, spec.engine, self.engines, not spec.declared, self.config.isolation, spec.options)
        except ModelNotFound as exc:
            if spec.declared:  # named at start: no server answers yet, so no "servable here" list
                raise
            servable = ", ".join(public_name(s, self) for s in self.slots) or "none loaded"  # never a server path
            raise ModelNotFound(f"{exc.message} Servable here: {servable}.", param="model",
                                code=exc.code) from None
        slot = self._by_name.get(name)
        if slot is None and not spec.declared:  # a file spelled another way ("./a/../m.gguf"): its slot, no new copy
            slot = next((s for s in map(self._named, filter(os.path.isabs, (name, *aliases))) if s is not None), None)
        if slot is None:
            slot = Slot(spec, name, {model, *aliases} - {name}, task)
            slot.artifact_bytes = nbytes
            self.slots.append(slot)
            self._by_name[name] = slot
        elif spec.declared:
            slot.aliases.add(model)
        if spec.declared:
            self._by_name[model] = slot
        else:
            self._remember(typed, slot)
        return slot

    def use(self, model: str | None, keep_alive: Any = None) -> Use:
        """``async with registry.use(model) as handle``: the ready handle serving ``model`` for the length of one
        request (loaded on demand; the model is not unloaded while a request uses it). ``keep_alive`` (Ollama's)
        sets how long it stays loaded afterwards."""
        return Use(self, model, keep_alive)

    def leave(self, slot: Slot, keep_alive: Any) -> None:
        """A request is done with ``slot``; ``keep_alive`` (``...``: none given) is how long it stays loaded now."""
        slot.inflight -= 1
        slot.last_used = time.monotonic()
        if slot.inflight == 0:
            self._busy_changed()
            self._freed.set()
        if keep_alive is not ...:
            slot.keep_alive = keep_alive
        if slot.keep_alive == 0 and slot.inflight == 0 and slot.handle is not None and not slot.spec.pinned:
            asyncio.get_running_loop().create_task(self._unload(slot))

    def _capped(self, slot: Slot, seconds: float | None) -> float | None:
        """A request's keep_alive (None: forever) held to the longest this model may get: --max-keep-alive, or the
        model's own keep-alive from the command line or models file if longer (None: no limit)."""
        own = slot.spec.keep_alive if slot.spec.declared else self.config.keep_alive
        limit = None if own is None or self.config.max_keep_alive is None else max(own, self.config.max_keep_alive)
        if limit is None:
            return seconds
        return limit if seconds is None else min(seconds, limit)

    async def _ready(self, slot: Slot, retry_now: bool = False) -> Any:
        """The slot's handle, ready: a request waits for the load it triggered (or joined) up to ``--load-timeout``,
        not its queue time-out, which starts once the model serves."""
        if slot.handle is None:
            if slot.error is not None and slot.retry_in() > 0 and not retry_now:
                raise slot.error
            try:
                await asyncio.wait_for(asyncio.shield(self._load(slot)), self.config.load_timeout)
            except TimeoutError:
                if slot.no_room:  # still waiting for a loaded model to become idle: the reason, not a 504
                    raise Overloaded(f"No room to load '{slot.name}' within {self.config.load_timeout:g} s: "
                                     f"{slot.no_room}; retry later.", code="no_room",
                                     headers={"Retry-After": "5"}) from None
                raise QueueTimeout(f"Model '{slot.name}' is still loading after {self.config.load_timeout:g} s "
                                   "(--load-timeout); retry later.", code="load_timeout",
                                   headers={"Retry-After": "5"}) from None
        if retry_now and hasattr(slot.handle, "retry_now"):  # a worker's model that failed: restarted now
            await slot.handle.retry_now()
        await slot.handle.ensure_ready()  # the handle's own state: 503 (with the reason) while it cannot serve
        return slot.handle

    # -- loading and unloading ---------------------------------------------------------------------------------
    async def load(self, model: str) -> Slot:
        """Load ``model`` now (``POST /v1/models/{id}/load``)."""
        slot = await self.route(model)
        await self._ready(slot, retry_now=True)  # a failed model is tried again now; its error if it fails again
        return slot

    async def unload(self, model: str) -> Slot:
        """Unload ``model`` now (``POST /v1/models/{id}/unload``); refused while requests use it."""
        slot = self.find(model)
        if slot is None:
            raise ModelNotFound(f"The model '{model}' is not known here.", param="model")
        if slot.inflight:
            err = InvalidRequest(f"Model '{slot.name}' has {slot.inflight} request(s) in flight; unload it when they "
                                 "are done.", param="model", code="model_busy")
            err.status = 409
            raise err
        await self._unload(slot)
        return slot

    def forget(self, slot: Slot) -> None:
        """Forget an unloaded model loaded on demand whose files are gone (``DELETE /api/delete``)."""
        if slot.handle is None and slot.loading is None and not slot.spec.declared and slot in self.slots:
            self.slots.remove(slot)
            for table in (self._by_name, self._spellings):
                for name in [n for n, s in table.items() if s is slot]:
                    del table[name]

    def _load(self, slot: Slot) -> asyncio.Future:
        """The slot's load (one task however many requests wait for it)."""
        if slot.handle is not None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut
        if slot.loading is None:
            slot.loading_since = time.monotonic()
            slot.loading = asyncio.get_running_loop().create_task(self._do_load(slot))
            slot.loading.add_done_callback(_consume)
        return slot.loading

    async def _do_load(self, slot: Slot) -> None:
        from octo.runtime import process
        from octo.runtime.loader import open_model

        process.SPARE.hurry()  # (a no-op unless a spare's replacement waits: a switch right after the one before)
        config = self.config_for(slot.spec)
        t0 = time.monotonic()
        try:
            async with self._room:
                # weights plus the prefix-cache share; the KV pool is counted once the engine reports it
                slot.estimated_bytes = slot.artifact_bytes + int(config.cache_size_mb * 2**20)
                await self._make_room(slot)
                self.say(f"octo: loading '{quoted(slot.name, bare=True)}'")
                if self.cluster is not None:  # a deployment whose replicas each run this same loading
                    handle, rows = await self.cluster.open_model(slot.spec, config, self.engines, say=self.say,
                                                                 download=slot.spec.declared)
                else:
                    handle, rows = await open_model(config, self.engines, say=self.say,
                                                    download=slot.spec.declared, lazy_rows=True)
                await handle.activate(config)
                await self._trim(slot)  # (a model over the count alone goes only now: octo.runtime.room)
            slot.handle, slot.rows, slot.error, slot.failures = handle, rows, None, 0
            slot.task = handle.task
            slot.aliases.update(handle.aliases)
            for alias in handle.aliases:
                self._by_name.setdefault(alias, slot)
            slot.loaded_at = time.time()
            slot.last_used = time.monotonic()
            slot.load_seconds = round(time.monotonic() - t0, 3)
            self.loads += 1
            self.say(f"octo: '{quoted(slot.name, bare=True)}' ready with {handle.engine_name} ({handle.isolation}) in "
                     f"{slot.load_seconds:.2f} s")
            slot.remeasure = handle.remeasure.start(self, slot) if getattr(handle, "remeasure", None) else None
            await self._share_cores()
        except Overloaded:
            raise  # no room now: only the requests waiting for this load are refused, the next one tries again
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the reason, the server goes on
            cause = exc if isinstance(exc, OctoError) else OctoError(f"{type(exc).__name__}: {exc}")
            from octo.runtime.supervision import backoff, retry_after

            slot.failures += 1
            slot.failed_at = time.monotonic()
            delay = backoff(slot.failures)
            if isinstance(cause, (ModelNotFound, InvalidRequest)) and cause.status < 500:
                slot.error = cause
            else:
                why = f"Model '{slot.name}' could not be loaded: {cause.message}"
                slot.error = ModelFailed(f"{why} It is tried again in {delay:g} s, or now with POST "
                                         f"/v1/models/{slot.name}/load.", param="model", headers=retry_after(delay))
                slot.error.why = why
            slot.error.cause = cause.message
            if not self.starting:  # (at start-up, start() says it once, with the other models' problems)
                log.error("loading '%s' failed: %s", quoted(slot.name, bare=True), quoted(cause.message))
            raise slot.error from None
        finally:
            slot.loading = None

    def config_for(self, spec: ModelSpec) -> ServerConfig:
        """The server configuration one model runs with: its own engine, options, batch size and cache share."""
        c = self.config
        share = c.cache_size_mb / max(1, c.max_loaded or sum(1 for s in self.slots if s.spec.declared))
        options = dict(spec.options)
        if spec.lora:  # the engine loads the adapters with the model (an engine without LoRA refuses the option)
            import json

            options["lora"] = json.dumps(spec.lora)
        return dataclasses.replace(c, model=spec.model, engine=spec.engine, options=options, cache_size_mb=share,
                                   max_batch=spec.max_batch or c.max_batch, default_max_tokens=catalog_max_tokens(spec))

    async def _unload(self, slot: Slot) -> None:
        handle, slot.handle = slot.handle, None
        if handle is None:
            return
        if slot.remeasure is not None:  # (its measurement's worker is killed)
            slot.remeasure.cancel()
        slot.rows = []
        if not slot.spec.declared:
            slot.keep_alive = self.config.keep_alive
        try:
            await handle.close()
        except Exception:  # noqa: BLE001
            log.exception("unloading '%s' failed", quoted(slot.name, bare=True))
        self.unloads += 1
        self._freed.set()
        del handle
        gc.collect()  # an in-process engine's memory goes back now, not at the next collection
        self.say(f"octo: unloaded '{quoted(slot.name, bare=True)}'")
        await self._share_cores()

    def _busy_changed(self) -> None:
        """A model became busy or idle. With --share-cores os, models in workers that are busy at the same time
        split the cores: each tunable one (llama.cpp) computes with cores / busy models threads, and gets its own
        count back once it is the only busy one (measured: 0.87x -> about 1.0x of the mean single-model rate)."""
        if self.config.share_cores != "os":
            return
        workers = [s for s in self.slots if s.handle is not None and hasattr(s.handle, "limit_threads")]
        if len(workers) < 2 and not any(s.handle.threads_limit for s in workers):
            return
        busy = [s for s in workers if s.inflight > 0]
        share = max(1, (os.cpu_count() or 1) // len(busy)) if len(busy) >= 2 else None
        loop = asyncio.get_running_loop()
        for s in workers:
            want = share if s in busy else None
            if s.handle.threads_limit != want:
                s.handle.threads_limit = want  # now, so the next change compares with it; the tasks run in order
                loop.create_task(s.handle.limit_threads(want))

    async def _share_cores(self) -> None:
        """With --share-cores turns, two or more models in workers compute in turns (octo.runtime.arbiter)."""
        workers = [s.handle for s in self.loaded() if hasattr(s.handle, "share_cores")]
        on = len(workers) >= 2 and self.config.share_cores == "turns"
        for handle in workers:
            if handle.shares_cores != on:
                try:
                    await handle.share_cores(on)
                except OctoError as exc:  # a worker that just died is restarted with the current setting
                    log.warning("%s: could not switch core sharing: %s", quoted(handle.name, bare=True), exc.message)

    async def _sweep(self) -> None:
        """Unload idle models whose keep-alive has run out (once a second)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in self.loaded():
                if not (slot.spec.pinned or slot.inflight or slot.keep_alive is None or slot.loading is not None) \
                        and now - slot.last_used >= slot.keep_alive:
                    self.say(f"octo: '{quoted(slot.name, bare=True)}' idle for {slot.keep_alive:g} s (keep_alive): "
                             "unloading")
                    await self._unload(slot)


def _consume(fut: asyncio.Future) -> None:
    """A load nobody waits for any more (its requests timed out) leaves no 'exception never retrieved' warning."""
    if not fut.cancelled():
        fut.exception()


class Use:
    """One request's use of a model (``Registry.use``): a plain async context manager, not a generator one, because
    every request enters one (three calls instead of about a dozen)."""

    __slots__ = ("registry", "model", "keep_alive", "slot", "ka")

    def __init__(self, registry: Registry, model: str | None, keep_alive: Any) -> None:
        self.registry, self.model, self.keep_alive = registry, model, keep_alive
        self.slot: Slot | None = None

    async def __aenter__(self) -> Any:
        registry = self.registry
        # a model that is known and loaded (most requests): no coroutine of route's or _ready's to run
        slot = registry.find(self.model) if self.model else None
        if slot is None:
            slot = await registry.route(self.model)
        ka = self.keep_alive
        self.ka = registry._capped(slot, parse_keep_alive(ka)) if ka is not None else ...
        slot.inflight += 1
        if slot.inflight == 1:
            registry._busy_changed()
        self.slot = slot
        try:
            handle = slot.handle
            if handle is None:
                return await registry._ready(slot)
            await handle.ensure_ready()  # (what _ready does for a loaded model)
            return handle
        except BaseException:
            self.slot = None
            registry.leave(slot, self.ka)
            raise

    async def __aexit__(self, *exc: Any) -> None:
        if self.slot is not None:
            self.registry.leave(self.slot, self.ka)
