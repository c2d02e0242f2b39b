"""The listening sockets of ``octo serve``: taken before anything loads, answered with a 503 until the API is up.

Loading the models (and starting a Ray head, and the start-up benchmark) can take minutes. The port is taken
first (``octo.server.sockets``, before the engine worker starts), so that a port in use is an error at once (not
after the load, and never a traceback), and nothing started meanwhile can take it: a Ray head starts a dozen
services on free ports, one of which could be the one asked for.
Until the API serves, every request gets a 503 with ``Retry-After`` (``/health``: ``{"status": "loading"}``),
as llama-server answers while it loads, instead of a refused connection.

The loading responder serves duplicates of the sockets; closing it closes only its duplicates, so the listening
sockets (and connections waiting in their backlog) pass to the API without a moment in which the port is free.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from aiohttp import web

from octo.errors import OctoError
from octo.server.sockets import open_sockets

__all__ = ["Starting", "loading_responder", "open_sockets"]

RETRY_AFTER_S = "5"
_PAGE = ("<!doctype html><html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content=2>"
         "<title>octo: starting</title></head><body style='font-family:system-ui;margin:3em'>"
         "<h1>octo is starting</h1><p>Loading its models; this page reloads until the dashboard is up.</p>"
         "</body></html>")


class Starting(OctoError):
    """Every request's answer until the API serves."""

    status = 503
    type = "server_error"
    code = "server_starting"


async def loading_responder(socks: list[socket.socket], error_body: Any, models: list[str],
                            guard: Any = None) -> web.AppRunner:
    """A 503 on every request while the server starts, served on duplicates of ``socks`` (``runner.cleanup()``
    hands them back). ``error_body(request, err)`` shapes the error as the API would (Anthropic's on /v1/messages);
    ``/health`` lists ``models`` (those loading at start-up) as loading; ``guard`` (octo.server.hostcheck.HostGuard)
    refuses
    what the server would; a browser asking for the dashboard gets a
    page that reloads until the server is up."""
    started = time.time()

    async def answer(request: web.Request) -> web.StreamResponse:
        if guard is not None:  # a non-local Host (DNS rebinding) or another page: refused while starting too
            try:
                guard.check(request)
            except OctoError as err:
                return error_body(request, err)
        headers = {"Retry-After": RETRY_AFTER_S}
        if request.path == "/health":
            return web.json_response({"status": "loading", "models": [{"id": m, "state": "loading"} for m in models],
                                      "uptime_s": round(time.time() - started, 3)}, status=503, headers=headers)
        if request.path == "/" and request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
            return web.Response(text=_PAGE, content_type="text/html", status=503, headers=headers)
        err = Starting("The server is starting (loading its models); retry shortly.", headers=headers)
        return error_body(request, err)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock.dup()).start()
    return runner
