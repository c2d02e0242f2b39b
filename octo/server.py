"""The aiohttp application: one middleware (request id, auth, errors, metrics), routes, start-up."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from aiohttp import web

from octo import api
from octo.config import ServerConfig
from octo.errors import InvalidRequest, NotFound, OctoError, PayloadTooLarge, Unauthorized
from octo.metrics import CONTENT_TYPE, Metrics
from octo.serving import new_id
from octo.state import STATE, AppState

log = logging.getLogger("octo.server")
_OPEN_PATHS = frozenset({"/health"})


def _error_response(request: web.Request, err: OctoError) -> web.Response:
    if request.path.startswith("/v1/messages"):
        body = api.anthropic_error_body(err)
    else:
        body = err.body()
    return api.json_response(body, status=err.status, headers=err.headers or None)


def _from_http(exc: web.HTTPException) -> OctoError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(f"The request body is larger than the limit ({exc.text}).")
    if isinstance(exc, web.HTTPNotFound):
        return NotFound("Unknown endpoint.", code="unknown_url")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        err = InvalidRequest(f"Method {exc.method} is not allowed here.", code="method_not_allowed")
        err.status = 405
        return err
    err = OctoError(exc.reason or "HTTP error")
    err.status = exc.status
    err.type = "invalid_request_error" if exc.status < 500 else "server_error"
    return err


@web.middleware
async def octo_middleware(request: web.Request, handler) -> web.StreamResponse:
    state: AppState = request.app[STATE]
    started = time.perf_counter()
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        key = state.config.api_key
        if key and request.path not in _OPEN_PATHS and request.method != "OPTIONS":
            _check_key(request, key)
        resp = await handler(request)
        status = resp.status
    except OctoError as err:
        resp = _error_response(request, err)
        status = err.status
    except web.HTTPException as exc:
        err = _from_http(exc)
        resp = _error_response(request, err)
        status = err.status
    except asyncio.CancelledError:
        status = 499  # client closed the connection
        raise
    except (ConnectionResetError, ConnectionError):
        status = 499
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        err = OctoError("Internal server error; see the server log for details.")
        resp = _error_response(request, err)
    finally:
        if state.metrics is not None:
            state.metrics.observe(endpoint, status, time.perf_counter() - started)
    resp.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or new_id("req")
    return resp


def _check_key(request: web.Request, key: str) -> None:
    given = request.headers.get("Authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    if not token or not hmac.compare_digest(token.encode(), key.encode()):
        raise Unauthorized("Invalid or missing API key: send 'Authorization: Bearer <key>'.")


# -- info routes -------------------------------------------------------------------------------------
def _model_state(h: Any) -> dict[str, Any]:
    out = {"state": h.state, "isolation": h.isolation}
    if h.reason:
        out["reason"] = h.reason
    worker = getattr(h, "worker_info", None)
    if worker is not None:
        out["worker"] = worker()
    return out


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    h = state.handle
    return api.json_response({"status": "ok" if h.state == "ready" else "degraded", "model": h.name,
                              "engine": h.engine_name, **_model_state(h),
                              "uptime_s": round(time.time() - state.started, 3)})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    h = state.handle
    data = [{"id": h.name, "object": "model", "created": int(state.started), "owned_by": "octo",
             "engine": h.engine_name, "task": h.task, "context_length": h.info.n_ctx, "aliases": list(h.aliases),
             **_model_state(h)}]
    return api.json_response({"object": "list", "data": data})


async def model_get(request: web.Request) -> web.Response:
    state = request.app[STATE]
    h = state.handle
    name = request.match_info["name"]
    if not h.matches(name):
        raise NotFound(f"The model '{name}' does not exist; this server serves '{h.name}'.", param="model",
                       code="model_not_found")
    return api.json_response({"id": name, "object": "model", "created": int(state.started), "owned_by": "octo"})


async def engines(request: web.Request) -> web.Response:
    state = request.app[STATE]
    h = state.handle
    return api.json_response({"object": "list", "active": h.engine_name, "model": h.name,
                              "isolation": h.isolation, "selection": h.selection, "data": state.engines})


async def queue_stats(request: web.Request) -> web.Response:
    stats = await request.app[STATE].handle.stats()
    return api.json_response(stats["queue"])


async def cache_stats(request: web.Request) -> web.Response:
    stats = await request.app[STATE].handle.stats()
    if stats["cache"] is None:
        cfg = request.app[STATE].config
        why = "disabled by --no-cache" if cfg.no_cache else "the served model has no text generation"
        return api.json_response({"enabled": False, "reason": why, "entries": 0, "bytes": 0, "hits": 0,
                                  "misses": 0, "hit_rate": 0.0})
    return api.json_response(stats["cache"])


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    snapshot = await state.handle.stats()
    return web.Response(body=state.metrics.render(snapshot), headers={"Content-Type": CONTENT_TYPE})


async def _no_transcription(request: web.Request) -> web.Response:  # audio extras not installed
    h = request.app[STATE].handle
    raise InvalidRequest(f"Model '{h.name}' ({h.engine_name}) does not support audio transcription; serve a "
                         "Whisper model (e.g. `octo serve whisper-base`).", param="model", code="unsupported_task")


def _audio_handlers() -> tuple[Any, Any]:
    try:
        from octo import audio
    except ImportError:
        return _no_transcription, _no_transcription
    return audio.transcriptions, audio.translations


def create_app(config: ServerConfig, handle: Any, engine_rows: list[dict[str, Any]] | None = None,
               plugin_manager: Any = None) -> web.Application:
    """The application for one served model. ``handle.scheduler`` is started on app start-up."""
    app = web.Application(middlewares=[octo_middleware], client_max_size=int(config.max_body_mb * 2**20))
    state = AppState(config=config, handle=handle, engines=engine_rows or [], started=time.time())
    state.metrics = Metrics(state)
    app[STATE] = state
    transcriptions, translations = _audio_handlers()
    r = app.router
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{name:.+}", model_get)
    r.add_get("/v1/engines", engines)
    r.add_get("/v1/queue/stats", queue_stats)
    r.add_get("/v1/cache/stats", cache_stats)
    r.add_post("/v1/chat/completions", api.chat_completions)
    r.add_post("/v1/completions", api.completions)
    r.add_post("/v1/embeddings", api.embeddings)
    r.add_post("/v1/messages", api.messages)
    r.add_post("/v1/audio/transcriptions", transcriptions)
    r.add_post("/v1/audio/translations", translations)
    if plugin_manager is not None:
        plugin_manager.hook.register_routes(app=app)

    async def on_startup(app: web.Application) -> None:
        await handle.activate(config)

    async def on_cleanup(app: web.Application) -> None:
        await handle.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
