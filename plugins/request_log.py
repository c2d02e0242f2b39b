"""Request log plugin: one JSON line per request (method, path, status, seconds, request id).

Load it with ``octo serve MODEL --plugins-dir plugins``; lines go to the ``octo.requests`` logger, or to the
file named by ``OCTO_REQUEST_LOG``.
"""

from __future__ import annotations

import json
import logging
import os
import time

from aiohttp import web

from octo.errors import OctoError
from octo.hookspecs import hookimpl

log = logging.getLogger("octo.requests")


@hookimpl
def register_routes(app: web.Application) -> None:
    path = os.environ.get("OCTO_REQUEST_LOG")
    if path:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    @web.middleware
    async def request_log(request: web.Request, handler):
        t0 = time.perf_counter()
        status = 499
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except (OctoError, web.HTTPException) as exc:
            status = exc.status
            raise
        finally:
            log.info(json.dumps({"method": request.method, "path": request.path, "status": status,
                                 "seconds": round(time.perf_counter() - t0, 6),
                                 "request_id": request.headers.get("X-Request-Id")}))

    app.middlewares.append(request_log)
