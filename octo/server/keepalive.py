"""Streams that never go silent: the keep-alive of a streamed response, on a timer owned by the route that writes it.

Whatever stands between a streamed request and its first token (the model's load, the queue, the prefill of the
prompt) sends the protocol's own keep-alive each time ``--stream-keepalive`` seconds (``OCTO_STREAM_KEEPALIVE``)
pass with nothing written: an ``event: ping`` on Anthropic's Messages API, a repeated ``response.in_progress`` event
on the Responses API, an SSE comment line on Chat Completions and Completions, an empty chunk (``done: false``) on
Ollama's ``/api/chat`` and ``/api/generate`` (docs/api.md says why each). Engines know nothing of it.

A response's headers go out once its request is admitted (the route calls :meth:`KeepAlive.open`) or once the
first interval passes, whichever comes first: a request refused quickly (a 400, a full queue's 503 with
``Retry-After``, an unknown model's 404) gets an ordinary JSON error with its status; an error after the headers (a
load that fails, a queue time-out, a crash) ends the stream with the protocol's error event (:meth:`KeepAlive.fail`).

The timer is one ``loop.call_at`` per streamed request, not a task: a request admitted and answered within the
interval pays for a timer handle and nothing else. A keep-alive that cannot be written (the client went away)
cancels the request's handler, so its sequence leaves the batch at the next step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from octo.errors import OctoError
from octo.server.stamp import start_stream
from octo.server.state import STATE

log = logging.getLogger("octo.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
COMMENT = b": keep-alive\n\n"  # an SSE comment: no event for any client (the SSE spec; every SDK skips it)


class KeepAlive:
    """One streamed response on its way to its first content. ``beat()`` gives the bytes of one keep-alive (a
    callable: some protocols open their stream with it, or number their events). Until :meth:`stop`, the route
    writes through :meth:`send`; after it, to ``resp`` directly."""

    __slots__ = ("request", "headers", "beat", "resp", "live", "interval", "due", "timer", "beating", "lock", "loop",
                 "handler")

    def __init__(self, request: web.Request, headers: dict[str, str], beat: Callable[[], bytes]) -> None:
        self.request, self.headers, self.beat = request, headers, beat
        self.resp: web.StreamResponse | None = None
        self.live = True  # keep-alives until the first content
        self.loop = asyncio.get_running_loop()
        self.handler = asyncio.current_task()
        self.lock = asyncio.Lock()  # one writer at a time: the route or a keep-alive
        self.timer: asyncio.TimerHandle | None = None
        self.beating: asyncio.Task | None = None
        self.interval = request.app[STATE].config.stream_keepalive
        self.due = 0.0
        if self.interval > 0:
            self.due = self.loop.time() + self.interval
            self.timer = self.loop.call_at(self.due, self._fire)

    @property
    def started(self) -> bool:
        """Whether the headers went out (an error now is an event of the stream, not a status)."""
        return self.resp is not None

    async def open(self) -> web.StreamResponse:
        """The response, its headers sent now if no keep-alive sent them yet (the request is admitted)."""
        async with self.lock:
            return self.resp or await self._start()

    async def send(self, data: bytes) -> None:
        """Write ``data`` before the first content (a stream's opening events): the next keep-alive is due an
        interval later."""
        async with self.lock:
            resp = self.resp or await self._start()
            await resp.write(data)
            self.due = self.loop.time() + self.interval

    async def stop(self) -> web.StreamResponse | None:
        """The first content is here: no keep-alive after this one (waits for one being written). The response, or
        None when its headers have not gone out."""
        self.live = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        beating, self.beating = self.beating, None
        if beating is not None and not beating.done():
            await beating
        return self.resp

    def resume(self) -> None:
        """Keep-alives again until the next content: another model call of the same answer waits for admission
        and its prefill (the Messages API's server-side tool search)."""
        if not self.live and self.interval > 0 and self.resp is not None:
            self.live = True
            self.due = self.loop.time() + self.interval
            self.timer = self.loop.call_at(self.due, self._fire)

    def close(self) -> None:
        """No more keep-alives (the request is over, or its first content came)."""
        self.live = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def fail(self, err: OctoError, event: Callable[[OctoError], bytes]) -> web.StreamResponse:
        """``err`` came before the first content: raised (an ordinary JSON error with its status) while the
        headers have not gone out, else written as the protocol's error ``event(err)``, which ends the stream."""
        resp = await self.stop()
        if resp is None:
            raise err
        await resp.write(event(err))
        return resp

    async def _start(self) -> web.StreamResponse:
        resp = web.StreamResponse(headers=self.headers)
        await start_stream(self.request, resp)
        self.resp = resp
        return resp

    def _fire(self) -> None:
        self.timer = None
        if self.live:
            self.beating = self.loop.create_task(self._beat())

    async def _beat(self) -> None:
        try:
            async with self.lock:
                if self.live and self.loop.time() >= self.due:  # (nothing written since the timer was set)
                    resp = self.resp or await self._start()
                    await resp.write(self.beat())
                    self.due = self.loop.time() + self.interval
        except Exception as exc:  # noqa: BLE001 - the client went away: its request ends (and leaves the batch)
            log.debug("%s %s: a keep-alive could not be written (%s); the request ends", self.request.method,
                      self.request.path, exc)
            self.live = False
            if self.handler is not None and not self.handler.done():
                self.handler.cancel()
            return
        if self.live:
            self.timer = self.loop.call_at(self.due, self._fire)


def comment() -> bytes:
    """The keep-alive of Chat Completions and Completions streams."""
    return COMMENT
