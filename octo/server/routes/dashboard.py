"""The built-in web dashboard: ``GET /`` (the page), ``GET /dashboard/{file}`` (its static scripts and styles, from
``octo/dashboard/`` inside the package) and ``GET /v1/dashboard/live`` (one server-sent-events feed of live load).

The page is not secret: ``/`` and the static files are served without the API key (``is_public``); every API call the
page makes, the live feed included, carries the key the page asks for. The files are read once, on first use, and
served from memory with an ``ETag`` (304 on ``If-None-Match``); the assets' URLs in the page carry their hash, so
they are cached for a year and a new octo is never shown with old scripts.

The live feed never touches an engine thread: one sampler task per app reads each loaded model's counters (the
scheduler's and prefix cache's, in the model's process, as ``/v1/queue/stats`` does) once a second while at least one
page listens, and every listener gets the same sample; rates come from the counters' differences.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from octo.errors import NotFound
from octo.server.stamp import start_stream
from octo.server.state import STATE

DIR = Path(__file__).resolve().parent.parent / "dashboard"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
FILE_RE = re.compile(r"[a-z0-9_-]+\.(js|css|svg|png)")
INTERVAL = 1.0  # seconds between samples of the live feed
IDLE_PING = 15.0  # an SSE comment this often keeps proxies from closing a quiet stream (samples are sent anyway)
# Content-Security-Policy of the page: its own scripts and styles only, API calls to this origin, microphone
# recordings as blob: URLs; nothing from elsewhere
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'self'")
PUBLIC_FILES = web.AppKey("octo_dashboard_files", dict)
SAMPLER = web.AppKey("octo_dashboard_sampler", object)


def is_public(path: str) -> bool:
    """The page and its static files: served without the API key (the API calls the page makes carry it)."""
    return path in ("/", "/index.html") or (path.startswith("/dashboard/") and FILE_RE.fullmatch(path[11:]) is not None)


class _File:
    __slots__ = ("body", "etag", "ctype")

    def __init__(self, body: bytes, ctype: str) -> None:
        self.body, self.ctype = body, ctype
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'


def load_files(directory: Path = DIR) -> dict[str, _File]:
    """Every asset of the dashboard by name, and the page (``index.html``) with each asset's URL versioned by its
    hash (``app.js`` -> ``/dashboard/app.js?v=HASH``)."""
    files: dict[str, _File] = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and FILE_RE.fullmatch(p.name):
            files[p.name] = _File(p.read_bytes(), TYPES[p.suffix])
    page = (directory / "index.html").read_text(encoding="utf-8")
    for name, f in files.items():
        page = page.replace(f'"/dashboard/{name}"', f'"/dashboard/{name}?v={f.etag.strip(chr(34))[:12]}"')
    files["index.html"] = _File(page.encode(), TYPES[".html"])
    return files


def _files(app: web.Application) -> dict[str, _File]:
    files = app.get(PUBLIC_FILES)
    if files is None:  # first use: read once (a few tens of KB), then always from memory
        files = load_files()
        app[PUBLIC_FILES] = files
    return files


def _serve(request: web.Request, f: _File, cache: str) -> web.Response:
    headers = {"ETag": f.etag, "Cache-Control": cache, "X-Content-Type-Options": "nosniff"}
    if f.ctype.startswith("text/html"):
        headers.update({"Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"})
    inm = request.headers.get("If-None-Match", "")
    if f.etag in {t.strip() for t in inm.split(",")} or inm.strip() == "*":
        return web.Response(status=304, headers=headers)
    body = b"" if request.method == "HEAD" else f.body
    return web.Response(body=body, headers={**headers, "Content-Type": f.ctype})


async def page(request: web.Request) -> web.Response:
    # revalidated on every visit (a 304 when unchanged): the page names the current assets' hashes
    return _serve(request, _files(request.app)["index.html"], "no-cache")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["file"]
    f = _files(request.app).get(name) if FILE_RE.fullmatch(name) else None
    if f is None:
        raise NotFound(f"The dashboard has no file '{name}'.", code="unknown_url")
    # versioned URLs (?v=HASH) never change: a year; an unversioned one is revalidated
    cache = "public, max-age=31536000, immutable" if request.query.get("v") else "no-cache"
    return _serve(request, f, cache)


class Sampler:
    """Samples the loaded models' queue and cache counters once a second while anyone listens; listeners get each
    sample through their own queue (a slow listener drops samples, never blocks the others)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.listeners: set[asyncio.Queue] = set()
        self.task: asyncio.Task | None = None
        self.last: dict[str, tuple[float, dict[str, Any]]] = {}  # model -> (time, counters) of the previous sample

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=4)
        self.listeners.add(q)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.listeners.discard(q)

    async def _run(self) -> None:
        while self.listeners:
            started = time.monotonic()
            try:
                sample = await self.sample()
            except Exception as exc:  # noqa: BLE001 - the feed reports, never dies
                sample = {"time": time.time(), "error": str(exc), "models": {}}
            data = b"data: " + orjson.dumps(sample) + b"\n\n"
            for q in list(self.listeners):
                if q.full():
                    q.get_nowait()
                q.put_nowait(data)
            await asyncio.sleep(max(0.05, INTERVAL - (time.monotonic() - started)))
        self.task = None

    async def sample(self) -> dict[str, Any]:
        registry = self.app[STATE].registry
        slots = list(registry.slots)
        loaded = [s for s in slots if s.handle is not None and s.state not in ("available", "loading")]
        got = await asyncio.gather(*(asyncio.wait_for(s.handle.stats(), 2.0) for s in loaded),
                                   return_exceptions=True)
        stats = {s.name: g for s, g in zip(loaded, got, strict=True) if isinstance(g, dict)}
        now = time.monotonic()
        models: dict[str, Any] = {}
        for s in slots:
            st = stats.get(s.name)
            if st is None:
                models[s.name] = {"state": s.state, **s.progress()}
                self.last.pop(s.name, None)
                continue
            models[s.name] = self._row(s.name, s.state, st, now)
        return {"time": time.time(), "interval": INTERVAL, "models": models}

    def _row(self, name: str, state: str, st: dict[str, Any], now: float) -> dict[str, Any]:
        q, c = st.get("queue") or {}, st.get("cache") or {}
        counters = {"processed": q.get("total_processed") or 0, "tokens": q.get("generated_tokens") or 0}
        rps = tok_s = 0.0
        prev = self.last.get(name)
        if prev is not None and now > prev[0]:
            dt = now - prev[0]
            # a restarted worker starts its counters at 0: no negative rate
            rps = max(0, counters["processed"] - prev[1]["processed"]) / dt
            tok_s = max(0, counters["tokens"] - prev[1]["tokens"]) / dt
        self.last[name] = (now, counters)
        max_batch = q.get("max_batch") or 0
        active = q.get("active") or 0
        return {"state": state, "rps": round(rps, 3), "tok_s": round(tok_s, 2), "active": active,
                "queued": q.get("pending") or 0, "preempted": q.get("preempted") or 0, "max_batch": max_batch,
                "occupancy": round(active / max_batch, 4) if max_batch else 0.0,
                "total_processed": counters["processed"], "generated_tokens": counters["tokens"],
                "engine_thread": q.get("engine_thread"), "stale": bool(q.get("stale")), "age_s": q.get("age_s"),
                "cache": {"enabled": bool(c), "hit_rate": c.get("hit_rate", 0.0), "bytes": c.get("bytes", 0),
                          "budget_bytes": c.get("budget_bytes"), "entries": c.get("entries", 0),
                          "hits": c.get("hits", 0), "misses": c.get("misses", 0),
                          "tokens_reused": c.get("tokens_reused", 0)} if c else {"enabled": False}}


async def live(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one ``data:`` JSON sample a second (``models``: per model ``rps``, ``tok_s``, ``active``,
    ``queued``, ``occupancy``, ``cache``...) until the client goes away or the server drains."""
    app = request.app
    sampler = app.get(SAMPLER)
    if sampler is None:
        sampler = app[SAMPLER] = Sampler(app)
    state = app[STATE]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await start_stream(request, resp)
    q = sampler.subscribe()
    try:
        await resp.write(b"retry: 2000\n\n")
        while not state.draining:
            try:
                data = await asyncio.wait_for(q.get(), IDLE_PING)
            except TimeoutError:
                data = b": ping\n\n"
            await resp.write(data)
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        sampler.unsubscribe(q)
    return resp


def add_routes(r: web.UrlDispatcher, root=page) -> None:
    r.add_get("/", root)
    r.add_get("/index.html", page)
    r.add_get("/dashboard/{file:[a-z0-9_-]+\\.(?:js|css|svg|png)}", asset)  # /dashboard/live: the feed's alias
    r.add_get("/v1/dashboard/live", live)
