"""Every request's way in: the Host check (DNS rebinding), CORS preflights, the browser Origin check, the API key,
draining, errors in the API's own shape, metrics, and the response headers (``octo.server.stamp``).

It wraps each route's handler (:func:`guard_routes`: the endpoint's metrics label and the app's state are looked up
once, not per request, and aiohttp runs no middleware chain), and a last catch-all route answers what no route
matches (404, 405, and every path's OPTIONS preflight). Where a plugin adds middlewares, the same code runs as the
first middleware instead (:data:`octo_middleware`), so octo's checks come before a plugin's code."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from typing import Any

from aiohttp import web

from octo.errors import InvalidRequest, NotFound, OctoError, Overloaded, PayloadTooLarge, Unauthorized
from octo.logsafe import quoted
from octo.server.bodies import BODY_KEY
from octo.server.hostcheck import HostGuard
from octo.server.routes import anthropic as api_anthropic
from octo.server.routes import dashboard as api_dashboard
from octo.server.routes import openai as api
from octo.server.stamp import local_ollama_origin, stamp
from octo.server.state import STATE, AppState

log = logging.getLogger("octo.server.app")
OPEN_PATHS = frozenset({"/health"})
UNMATCHED = "unmatched"  # the metrics label of a request no route answers
# the /v1 route each prefix-less alias stands for (its metrics label): octo.server.app._add_unprefixed
V1_OF = web.AppKey("octo_v1_of", dict)
HOST_GUARD = web.AppKey("octo_host_guard", HostGuard)


def error_response(request: web.Request, err: OctoError) -> web.Response:
    path = request.path
    if (path[3:] if path.startswith("/v1/") else path).startswith("/messages"):  # /v1/messages and /messages
        body = api_anthropic.anthropic_error_body(err)
    elif path.startswith("/api/"):  # Ollama's API: {"error": "..."}
        body = {"error": err.message}
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


async def serve(request: web.Request, handler: Any, state: AppState, guard: HostGuard, endpoint: str) -> Any:
    """``handler(request)`` behind every check, its errors as responses in the API's shape, counted in the
    metrics under ``endpoint``; the response stamped unless the handler streamed it (it stamped it itself)."""
    started = time.perf_counter()
    if not guard.host_allowed(request.headers.get("Host")):  # DNS rebinding: before anything else, preflights too
        return _refused(request, state, guard, started)
    if request.method == "OPTIONS":
        return _preflight(request, state, started)
    status = 500
    err: OctoError | None = None
    counted = request.path not in OPEN_PATHS
    if counted:
        state.inflight += 1
    try:
        key = state.config.api_key
        # every method but OPTIONS (answered above), HEAD too; the dashboard page and its static files are open
        # (the API calls the page makes carry the key)
        # a browser's request: only from this server's own page, --cors-origins, or on Ollama's routes Ollama's
        # default local origins
        if "Origin" in request.headers and not local_ollama_origin(request):
            guard.check(request)
        if key and counted and not api_dashboard.is_public(request.path):
            _check_key(request, key)
        if state.draining and counted:
            raise Overloaded("The server is shutting down; retry on another instance or after it restarts.",
                             code="server_shutting_down", headers={"Retry-After": "5", "Connection": "close"})
        resp = await handler(request)
        status = resp.status
    except OctoError as exc:
        err = exc  # (the name of an ``except ... as`` is unbound after its block)
        resp = error_response(request, err)
        status = err.status
    except web.HTTPException as exc:
        err = _from_http(exc)
        resp = error_response(request, err)
        status = err.status
    except asyncio.CancelledError:
        status = 499  # client closed the connection (aiohttp cancels its handler)
        raise
    except Exception as exc:
        if isinstance(exc, ConnectionError) and _client_gone(request):
            status = 499  # it closed the connection while its answer was being written: nothing is wrong here
        else:
            log.exception("unhandled error on %s %s", request.method, quoted(request.path, bare=True))
            err = OctoError("Internal server error; see the server log for details.")
            resp = error_response(request, err)
    finally:
        if counted:
            state.inflight -= 1
        if state.metrics is not None:
            state.metrics.observe(endpoint, status, time.perf_counter() - started)
    if status == 499:  # (aiohttp writes nothing more to a closed connection: no traceback, no access-log error)
        log.debug("%s %s: the client closed the connection", request.method, quoted(request.path, bare=True))
        return web.Response(status=499)
    if 400 <= status < 500:
        log_refusal(request, status, err)
    if not resp.prepared:
        stamp(request, resp, state.config)
    return resp


@web.middleware
async def octo_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """:func:`serve` as the first middleware (where a plugin adds middlewares of its own)."""
    app = request.app  # (a property that walks the match info: once)
    endpoint = _label(request.match_info.route.resource, app[V1_OF])
    return await serve(request, handler, app[STATE], app[HOST_GUARD], endpoint)


def _label(resource: web.AbstractResource | None, v1_of: dict[str, str]) -> str:
    """A route's metrics label: its path (a prefix-less alias counts as its /v1 route), UNMATCHED for the last one."""
    if resource is None or isinstance(resource, _Anything):
        return UNMATCHED
    return v1_of.get(resource.canonical, resource.canonical)


class _Anything(web.PlainResource):
    """The last resource: it matches every request target, also one without a leading slash (``OPTIONS *``)."""

    def __init__(self) -> None:
        super().__init__("/")

    def _match(self, path: str) -> dict[str, str]:  # (aiohttp's match of a resource: no path parameters)
        return {}

    def raw_match(self, path: str) -> bool:  # (never taken for a route added later at "/")
        return False


def add_unmatched(router: web.UrlDispatcher) -> None:
    """The last route: every method on every path no other route answers (:func:`unmatched`)."""
    resource = _Anything()
    router.register_resource(resource)
    resource.add_route("*", unmatched)


async def unmatched(request: web.Request) -> web.StreamResponse:
    """The last route: 405 for a path some route answers with another method, else 404 (OPTIONS never gets here:
    :func:`serve` answers it)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if isinstance(resource, _Anything):
            continue
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def guard_routes(app: web.Application) -> None:
    """Put every route's handler behind :func:`serve`: one call a request, with what it needs bound now."""
    state, guard, v1_of = app[STATE], app[HOST_GUARD], app[V1_OF]
    for resource in app.router.resources():
        endpoint = _label(resource, v1_of)
        for route in resource:
            inner = route.handler
            wrapped = functools.partial(serve, handler=inner, state=state, guard=guard, endpoint=endpoint)
            wrapped.octo_route = inner  # type: ignore[attr-defined]
            route._handler = wrapped  # (aiohttp keeps a route's handler there)


def _refused(request: web.Request, state: AppState, guard: HostGuard, started: float) -> web.Response:
    """The 403 of a request whose Host this server does not answer (counted and logged like any other refusal)."""
    try:
        guard.check(request)
    except OctoError as err:
        if state.metrics is not None:
            state.metrics.observe(UNMATCHED, err.status, time.perf_counter() - started)
        log_refusal(request, err.status, err)
        resp = error_response(request, err)
        stamp(request, resp, state.config)
        return resp
    raise AssertionError("a refused Host passed the check")


def _preflight(request: web.Request, state: AppState, started: float) -> web.Response:
    """A CORS preflight, on every path, before the API key (browsers send it without credentials): 204, and the CORS
    headers (stamp) for an allowed origin only; never the 405 of a route that has no OPTIONS."""
    if state.metrics is not None:
        state.metrics.observe("OPTIONS", 204, time.perf_counter() - started)
    resp = web.Response(status=204)
    stamp(request, resp, state.config)
    return resp


def _client_gone(request: web.Request) -> bool:
    """Whether the request's connection is closed or closing (a write to it raised because the client left)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def log_refusal(request: web.Request, status: int, err: OctoError | None) -> None:
    """One INFO line per refused request (4xx): the route, the param and the message; the body too at DEBUG."""
    message = err.message if err is not None else "refused by the handler"
    param = err.param if err is not None else None
    code = err.code if err is not None else None
    # (the path, code, param and message may carry a request's own text: quoted, so it cannot forge a line)
    log.info("refused %s %s: %d %s%s: %s", request.method, quoted(request.path, 200, bare=True), status,
             quoted(code, bare=True) if code else "", f" (param {quoted(param, 200, bare=True)})" if param else "",
             quoted(message, 2000))
    if log.isEnabledFor(logging.DEBUG):
        body = request.get(BODY_KEY)
        if body:
            log.debug("refused request body (%d bytes): %r", len(body), bytes(body[:4096]))


def _check_key(request: web.Request, key: str) -> None:
    if not has_key(request, key):
        raise Unauthorized("Invalid or missing API key: send 'Authorization: Bearer <key>'.")


def has_key(request: web.Request, key: str) -> bool:
    given = request.headers.get("Authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    # a header's bytes that are not UTF-8 arrive as surrogates: compared as the bytes they were, never an error
    return bool(token) and hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode())
