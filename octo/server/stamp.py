"""The headers every response gets just before its headers go out: the request id, CORS for an allowed origin, and
the Ray Serve replica that answered (--cluster).

CORS: a route answers the origins of ``--cors-origins``; Ollama's routes (``/api/...`` and ``/``) also answer the
local origins Ollama answers by default (:func:`ollama_origin`), so that local web and desktop apps made for Ollama
work as they do with Ollama.

The way in (``octo.server.guard``) stamps a response its handler returned; a handler that streams stamps its
response here before it prepares it (:func:`start_stream`). Stamping twice changes nothing (aiohttp's
``on_response_prepare`` signal stamps too, where a plugin's routes are served: octo.server.app)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from octo.config import ServerConfig
from octo.server.state import STATE
from octo.serving.openai import new_id

# CORS (--cors-origins): what a browser page from an allowed origin may send and read. A preflight is allowed the
# headers it asks for (the SDKs send openai-*/x-stainless-*/anthropic-* headers); these are the ones named when it
# asks for none. Max-Age: Chromium caps it at 2 hours.
CORS_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, OpenAI-Organization, " \
               "OpenAI-Project, X-Request-Id"
CORS_EXPOSE = "Retry-After, X-Request-Id"
CORS_MAX_AGE = "7200"
# Ollama's default origins (envconfig.AllowedOrigins of Ollama 0.32.15, without OLLAMA_ORIGINS): these hosts on http
# and https, with any port or none, and every origin of these desktop-app schemes
OLLAMA_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
OLLAMA_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")


def ollama_route(path: str) -> bool:
    """Whether ``path`` is one of Ollama's routes (its native API and its root)."""
    return path == "/" or path.startswith("/api/")


def ollama_origin(origin: str) -> bool:
    """Whether Ollama answers ``origin`` by default: http(s) on localhost, 127.0.0.1 or 0.0.0.0 with any port (or
    none), or any origin of a desktop-app scheme (app://, file://, tauri://, vscode-webview://, vscode-file://)."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep:
        return False
    if scheme in OLLAMA_SCHEMES:
        return True
    host, colon, port = rest.partition(":")
    return scheme in ("http", "https") and host in OLLAMA_HOSTS and (not colon or port.isdigit())


def local_ollama_origin(request: web.Request) -> bool:
    """A browser request to one of Ollama's routes from one of Ollama's default origins."""
    origin = request.headers.get("Origin")
    return origin is not None and ollama_route(request.path) and ollama_origin(origin)


def stamp(request: web.Request, resp: web.StreamResponse, config: ServerConfig) -> None:
    """Add the request id (the client's X-Request-Id, or a new one), the replica header and CORS headers to
    ``resp``, once."""
    h = resp.headers
    if "X-Request-Id" in h:  # stamped already
        return
    h["X-Request-Id"] = request.headers.get("X-Request-Id") or new_id("req")
    if config.cluster:  # the Ray Serve replica that answered (octo.cluster.deploy)
        _replica(h)
    if config.cors_origins or ollama_route(request.path):
        _cors(request, h, config.cors_origins)


def _replica(h: Any) -> None:
    from octo.cluster.deploy import ANSWERED_BY, REPLICA_HEADER

    replica = ANSWERED_BY.get()
    if replica:
        h[REPLICA_HEADER] = replica


def _cors(request: web.Request, h: Any, allowed: tuple[str, ...]) -> None:
    h.add("Vary", "Origin")
    origin = request.headers.get("Origin")
    if origin is None or ("*" not in allowed and origin.lower() not in allowed and not local_ollama_origin(request)):
        return
    h["Access-Control-Allow-Origin"] = origin  # the origin itself, also for "*" (Vary: Origin above)
    h["Access-Control-Expose-Headers"] = CORS_EXPOSE
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:  # a preflight
        h["Access-Control-Allow-Methods"] = CORS_METHODS
        h["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers") or CORS_HEADERS
        h["Access-Control-Max-Age"] = CORS_MAX_AGE
        h.add("Vary", "Access-Control-Request-Method, Access-Control-Request-Headers")
        if request.headers.get("Access-Control-Request-Private-Network") == "true":  # a public page calling localhost
            h["Access-Control-Allow-Private-Network"] = "true"


async def start_stream(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Stamp and send the headers of a streamed response (SSE, NDJSON)."""
    stamp(request, resp, request.app[STATE].config)
    await resp.prepare(request)
    return resp


async def on_prepare(request: web.Request, resp: web.StreamResponse) -> None:
    """aiohttp's ``on_response_prepare`` signal, where plugins add routes or middlewares: what they answer is
    stamped as well."""
    stamp(request, resp, request.app[STATE].config)
