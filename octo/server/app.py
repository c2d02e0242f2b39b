"""The aiohttp application: its routes (each /v1 route also without /v1), each behind the way in
(``octo.server.guard``: auth, errors, metrics, OPTIONS, response headers), and start-up."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from octo.config import ServerConfig
from octo.errors import InvalidRequest, NotFound
from octo.server import guard, imagefetch, stamp
from octo.server.guard import HOST_GUARD, V1_OF
from octo.server.hostcheck import HostGuard
from octo.server.metrics import CONTENT_TYPE, Metrics
from octo.server.routes import anthropic as api_anthropic
from octo.server.routes import dashboard as api_dashboard
from octo.server.routes import ollama as api_ollama
from octo.server.routes import openai as api
from octo.server.state import STATE, AppState

log = logging.getLogger("octo.server.app")
# aiohttp's connection handler: bodies are decompressed by octo/bodies.py with bounds, not by aiohttp (whose
# decompression is bounded only after the fact); a connection that has not sent a whole request (headers arriving at
# 1 byte/s: slowloris) or sits idle between requests is closed after 75 s (aiohttp's default is an hour; nginx's
# upstream keep-alive is 60 s, so a proxy never reuses a connection octo is closing); header lines and fields are
# aiohttp's defaults (8,190 bytes, 128 headers: 400 above)
HANDLER_ARGS = {"auto_decompress": False, "keepalive_timeout": 75.0}


class _MalformedRequestLog(logging.Filter):
    """aiohttp logs every malformed request (a bad request line, header or chunk: its own 400) as an ERROR with a
    traceback; that is the client's fault, so one line at INFO says it, and a flood of garbage fills no log with
    tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and (exc.code or 400) < 500:
            record.msg, record.args = "%s: %s", (record.getMessage(), (exc.message or "").strip().split("\n")[0])
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_MALFORMED_REQUEST_LOG = _MalformedRequestLog()


# -- info routes -------------------------------------------------------------------------------------
def _model_entry(state: AppState, slot: Any) -> dict[str, Any]:
    """One servable model for /v1/models, /health and the admin routes."""
    h = slot.handle
    entry = {"id": slot.name, "object": "model", "created": int(slot.loaded_at or state.started), "owned_by": "octo",
             "state": slot.state, "task": h.task if h is not None else slot.task,
             "aliases": sorted(a for a in slot.aliases if a != slot.name), "pinned": slot.spec.pinned,
             "keep_alive": slot.keep_alive, "expires_at": slot.expires_at(), "requests_in_flight": slot.inflight,
             "memory": {"estimated_bytes": slot.estimated_bytes or None,
                        "measured_bytes": _rss(h) if h is not None else None}}
    if h is not None:
        entry.update(engine=h.engine_name, context_length=h.info.n_ctx, isolation=h.isolation,
                     load_seconds=slot.load_seconds, tasks=sorted(t.value for t in h.tasks),
                     capabilities=capabilities(h.task, h.info))
        worker = getattr(h, "worker_info", None)
        if worker is not None:
            entry["worker"] = worker()
        cluster = getattr(h, "cluster_info", None)
        if cluster is not None:  # --cluster: replicas and where each runs
            entry["cluster"] = cluster()
    reason = (h.reason if h is not None else None) or (slot.error.message if slot.error is not None else None)
    if reason:
        entry["reason"] = reason
    entry.update(slot.progress())  # a load in progress (loading_s, waiting) or a failed one's retry_in_s
    return entry


def capabilities(task: str, info: Any) -> list[str]:
    """What a loaded model does, in Ollama's words (``/api/show``): ``completion`` (chat), ``vision`` (it takes
    images), ``embedding``, ``transcription``."""
    caps = [{"chat": "completion", "embeddings": "embedding"}.get(task, task)]
    if getattr(info, "takes_images", False):
        caps.append("vision")
    return caps


def _rss(handle: Any) -> int | None:
    """Resident memory of a model in a worker process (an in-process model shares the gateway's)."""
    worker = getattr(handle, "worker", None)
    if worker is None or not worker.alive:
        return None
    try:
        for line in open(f"/proc/{worker.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    slots = state.registry.loaded()
    bad = [s for s in slots if s.state != "ready"]
    # 503 (take me out of rotation) while draining, or when a model cannot serve and will not come back by itself
    # (a wedged or dead engine thread, a model that failed); a crashed worker restarts on the next request: 200
    down = state.draining or any(s.state in ("wedged", "failed") for s in slots)
    loading = [s for s in state.registry.slots if s.handle is None and s.loading is not None]
    status = "draining" if state.draining else "degraded" if bad else "ok"
    if status == "ok" and state.store is not None and state.store.status == "unavailable":
        # the responses store (octo.serving.response_store): unavailable makes the server degraded, not down
        status = "degraded"
    key = state.config.api_key
    if key and not guard.has_key(request, key):  # open to load balancers: the status only, details need the key
        return api.json_response({"status": status}, status=503 if down else 200)
    body: dict[str, Any] = {"status": status,
                            "models": [{"id": s.name, "engine": s.handle.engine_name, "state": s.state,
                                        **({"reason": s.handle.reason} if s.handle.reason else {}), **s.progress()}
                                       for s in slots] + [{"id": s.name, "state": s.state, **s.progress()}
                                                          for s in loading],
                            "uptime_s": round(time.time() - state.started, 3)}
    if state.store is not None:
        body["responses_store"] = state.store.health()
    if len(slots) == 1:  # a one-model server: its model's details at the top
        body.update({"model": slots[0].name, **_model_entry(state, slots[0])})
        body.pop("id"), body.pop("object"), body.pop("owned_by")
    return api.json_response(body, status=503 if down else 200)


async def models_route(request: web.Request) -> web.Response:
    """Every model the server knows (loaded or not), then catalog models it could load on demand."""
    state = request.app[STATE]
    data = []
    for s in state.registry.slots:
        entry = _model_entry(state, s)
        data += [entry, *(_adapter_entry(s, entry, adapter) for adapter in s.spec.lora)]
    for row in await state.registry.catalog_available():
        data.append({"id": row["id"], "object": "model", "created": int(state.started), "owned_by": "octo",
                     "state": "available", "task": row["task"], "aliases": row["aliases"],
                     "engines": row["engines"], "source": "catalog"})
    return api.json_response({"object": "list", "data": data})


def _slot(request: web.Request) -> Any:
    state = request.app[STATE]
    name = request.match_info["name"]
    slot = state.registry.find(name)
    if slot is None:
        names = ", ".join(s.name for s in state.registry.slots) or "none"
        raise NotFound(f"The model '{name}' does not exist; servable here: {names}.", param="model",
                       code="model_not_found")
    return slot


def _adapter_entry(slot: Any, entry: dict[str, Any], adapter: str) -> dict[str, Any]:
    """A LoRA adapter of ``slot`` as a model of its own, ``base:adapter`` (vLLM lists adapters so too)."""
    return {"id": f"{slot.name}:{adapter}", "object": "model", "created": entry["created"], "owned_by": "octo",
            "parent": slot.name, "root": slot.name, "lora": adapter, "state": entry["state"], "task": entry["task"]}


async def model_get(request: web.Request) -> web.Response:
    slot = _slot(request)
    entry = _model_entry(request.app[STATE], slot)
    name = request.match_info["name"]
    adapter = name.rpartition(":")[2]
    if ":" in name and adapter in slot.spec.lora and not slot.matches(name) and name != slot.name:
        entry = _adapter_entry(slot, entry, adapter)
    return api.json_response(entry)


async def model_load(request: web.Request) -> web.Response:
    state = request.app[STATE]
    slot = await state.registry.load(request.match_info["name"])
    return api.json_response(_model_entry(state, slot))


async def model_unload(request: web.Request) -> web.Response:
    state = request.app[STATE]
    slot = await state.registry.unload(request.match_info["name"])
    return api.json_response(_model_entry(state, slot))


def _engines_of(slot: Any) -> dict[str, Any]:
    h = slot.handle
    return {"model": slot.name, "active": h.engine_name, "state": slot.state, "isolation": h.isolation,
            **({"worker": h.worker_info()} if hasattr(h, "worker_info") else {}),
            "selection": h.selection, "data": slot.rows}


async def engines(request: web.Request) -> web.Response:
    state = request.app[STATE]
    want = request.query.get("model")
    slots = state.registry.loaded()
    if want is not None:
        slot = state.registry.find(want)
        if slot is None or slot.handle is None:
            raise NotFound(f"The model '{want}' is not loaded.", param="model", code="model_not_found")
        slots = [slot]
    per_model = [_engines_of(s) for s in slots]
    body: dict[str, Any] = {"object": "list", "models": per_model}
    if len(per_model) == 1:  # its fields at the top; its engine rows only there (each engine once)
        body.update(per_model[0])
        per_model[0] = {k: v for k, v in per_model[0].items() if k != "data"}
        body["models"] = per_model
    else:
        from octo.plugins import engine_registry
        from octo.runtime.loader import engine_rows

        body["data"] = engine_rows(engine_registry())
    return api.json_response(body)


_SUMMED = ("pending", "active", "calls_running", "max_batch", "max_queue", "max_depth", "total_processed",
           "total_rejected", "total_timeouts", "total_cancelled", "steps", "generated_tokens", "entries", "bytes",
           "hits", "misses", "tokens_reused", "evictions")


async def _stats(request: web.Request) -> dict[str, dict[str, Any]]:
    slots = request.app[STATE].registry.loaded()
    got = await asyncio.gather(*(s.handle.stats() for s in slots), return_exceptions=True)
    return {s.name: g for s, g in zip(slots, got, strict=True) if isinstance(g, dict)}


def _totals(per_model: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    rows = [r for r in per_model.values() if r]
    if len(rows) == 1:
        return dict(rows[0])
    out: dict[str, Any] = {k: sum(r.get(k) or 0 for r in rows) for k in _SUMMED if any(k in r for r in rows)}
    if "hits" in out:
        lookups = out["hits"] + out.get("misses", 0)
        out["hit_rate"] = round(out["hits"] / lookups, 4) if lookups else 0.0
    return out


async def queue_stats(request: web.Request) -> web.Response:
    per = {name: st["queue"] for name, st in (await _stats(request)).items()}
    return api.json_response({**_totals(per), "models": per})


async def cache_stats(request: web.Request) -> web.Response:
    per = {name: st["cache"] for name, st in (await _stats(request)).items() if st["cache"] is not None}
    if not per:
        cfg = request.app[STATE].config
        why = "disabled by --no-cache" if cfg.no_cache else "no loaded model has text generation"
        return api.json_response({"enabled": False, "reason": why, "entries": 0, "bytes": 0, "hits": 0,
                                  "misses": 0, "hit_rate": 0.0, "models": {}})
    return api.json_response({**_totals(per), "enabled": True, "models": per})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    snapshot = await _stats(request)
    return web.Response(body=state.metrics.render(snapshot), headers={"Content-Type": CONTENT_TYPE})


async def _no_transcription(request: web.Request) -> web.Response:  # audio extras not installed
    raise InvalidRequest("Audio transcription is not installed here (pip install 'octo[whisper]').", param="model",
                         code="unsupported_task")


def _audio_handlers() -> tuple[Any, Any]:
    try:
        from octo.server.routes import audio
    except ImportError:
        return _no_transcription, _no_transcription
    return audio.transcriptions, audio.translations


def _add_unprefixed(router: web.UrlDispatcher) -> dict[str, str]:
    """Every /v1 route registered so far also without the prefix (/chat/completions, /models/{name}...: clients
    whose base URL lacks /v1, llama-server's bare paths), same handler, unless that path is taken; a route added
    after this call gets no alias. Returns alias -> /v1 path (for the metrics label)."""
    taken = {res.canonical for res in router.resources()}
    aliases: dict[str, str] = {}
    for res in list(router.resources()):
        v1 = res.canonical
        if not v1.startswith("/v1/") or v1[3:] in taken:
            continue
        path = getattr(res, "_orig_path", None) or v1  # a DynamicResource's path keeps its patterns ({name:.+})
        for route in res:
            router.add_route(route.method, path[3:], route.handler)
        aliases[v1[3:]] = v1
    return aliases


def _add_routes(app: web.Application) -> None:
    """octo's own routes (health, metrics, models, engines, stats), the OpenAI and Anthropic ones, audio, the
    Responses API (its store opened at start), tokenization, Ollama's API and the dashboard."""
    transcriptions, translations = _audio_handlers()
    r = app.router
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", models_route)
    r.add_post("/v1/models/{name:.+}/load", model_load)
    r.add_post("/v1/models/{name:.+}/unload", model_unload)
    r.add_get("/v1/models/{name:.+}", model_get)
    r.add_get("/v1/engines", engines)
    r.add_get("/v1/queue/stats", queue_stats)
    r.add_get("/v1/cache/stats", cache_stats)
    r.add_post("/v1/chat/completions", api.chat_completions)
    r.add_post("/v1/completions", api.completions)
    r.add_post("/v1/embeddings", api.embeddings)
    r.add_post("/v1/messages", api_anthropic.messages)
    r.add_post("/v1/messages/count_tokens", api_anthropic.count_tokens)
    r.add_post("/v1/audio/transcriptions", transcriptions)
    r.add_post("/v1/audio/translations", translations)
    from octo.server.routes import responses as api_responses

    api_responses.setup(app)  # routes, and the responses store opened and checked at start
    from octo.server.routes import tokens as api_tokens

    api_tokens.add_routes(r)
    api_ollama.add_routes(r)  # Ollama's API under /api/
    # GET / (the web dashboard; "Ollama is running" for a client that probes Ollama), /dashboard/{file}, the feed
    api_dashboard.add_routes(r, root=api_ollama.root)


def _guard(app: web.Application, plugged: bool) -> None:
    """Every route behind the way in: its handler wrapped; or, where a plugin added middlewares, the way in as the
    first middleware (its checks before the plugin's code). The response headers of what a plugin's route streams
    come from aiohttp's on_response_prepare signal (octo's own streams stamp theirs: octo.server.stamp)."""
    if app.middlewares:
        app.middlewares.insert(0, guard.octo_middleware)
    else:
        guard.guard_routes(app)
    if plugged or app.middlewares:
        app.on_response_prepare.append(stamp.on_prepare)


def create_app(config: ServerConfig, models: Any, engine_rows: list[dict[str, Any]] | None = None,
               plugin_manager: Any = None) -> web.Application:
    """The application. ``models`` is a started ``Registry``, or one loaded handle (with its /v1/engines rows),
    which the app activates on start-up."""
    from octo.runtime.registry import Registry

    server_log = logging.getLogger("aiohttp.server")
    if _MALFORMED_REQUEST_LOG not in server_log.filters:
        server_log.addFilter(_MALFORMED_REQUEST_LOG)
    app = web.Application(client_max_size=int(config.max_body_mb * 2**20), handler_args=HANDLER_ARGS)
    if isinstance(models, Registry):
        registry = models
    else:
        registry = Registry(config, {})
        registry.adopt(models, engine_rows)
    state = AppState(config=config, registry=registry, started=time.time())
    state.metrics = Metrics(state)
    app[STATE] = state
    imagefetch.setup(app, config)  # --allow-image-urls: the fetcher of remote image URLs
    r = app.router
    _add_routes(app)
    n_routes = len(r.routes())
    if plugin_manager is not None:
        plugin_manager.hook.register_routes(app=app)
    plugged = len(r.routes()) != n_routes  # a plugin's routes: the signal stamps what they stream
    app[HOST_GUARD] = HostGuard(config.host, config.allowed_hosts, config.cors_origins)
    app[V1_OF] = _add_unprefixed(r)  # the /v1 routes registered above (plugins' too) get their alias
    guard.add_unmatched(r)  # last: 404 and 405 in the API's shape, OPTIONS anywhere
    _guard(app, plugged)

    async def on_startup(app: web.Application) -> None:
        await registry.activate_all()

    async def on_cleanup(app: web.Application) -> None:
        await registry.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
