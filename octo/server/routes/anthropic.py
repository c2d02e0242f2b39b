"""Route handlers of the Anthropic Messages API: ``POST /v1/messages`` (streaming and not) and ``POST
/v1/messages/count_tokens``, and the error shape of these routes. The request runs as a chat generation in the
model's worker (octo.serving.anthropic builds it and shapes the answer).

A stream's ``message_start`` is written when the first event of the sequence arrives, so that it can report
``usage.cache_read_input_tokens``: the engine thread posts a ``Cached`` event (``octo.scheduler.events``), before any
text, when it restored prompt tokens from the prefix cache (none: nothing was cached). While the request waits
(its model's load, the queue, the prefill) ``ping`` events keep the stream alive (octo.server.keepalive)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from octo.errors import InvalidRequest, OctoError
from octo.protocol.anthropic import AnthropicCountTokensRequest, AnthropicRequest
from octo.protocol.openai import parse
from octo.scheduler.events import Cached, Done, Failed, Reasoning, Text, ToolDelta
from octo.server import imagefetch
from octo.server.keepalive import SSE_HEADERS, KeepAlive
from octo.server.routes.openai import dumps, event_stream, json_body, json_response, model_of
from octo.serving import anthropic
from octo.serving import anthropic_answer as answer

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(exc: Any) -> dict[str, Any]:
    if isinstance(exc, OctoError):
        kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
        body: dict[str, Any] = {"type": kind, "message": exc.message}
        if getattr(exc, "details", None):  # what the SDK acts on (octo.serving.anthropic.refuse_threads)
            body["details"] = exc.details
        return {"type": "error", "error": body}
    return {"type": "error", "error": {"type": "api_error", "message": str(exc)}}


async def _fetch_images(request: web.Request, handle: Any, req: AnthropicCountTokensRequest) -> None:
    """The request's image URLs fetched (--allow-image-urls), a 400 naming the block in its message."""
    try:
        await imagefetch.fetch_remote(request, handle, anthropic.image_refs(req))
    except InvalidRequest as err:
        raise anthropic.with_path(err) from None


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


PING = _event("ping", {"type": "ping"})  # Anthropic's keep-alive, which every client skips


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(AnthropicRequest, body)
    anthropic.refuse_threads(req)
    if req.stream:
        return await _streamed(request, req, len(body))
    async with model_of(request, req) as handle:
        await _fetch_images(request, handle, req)
        tickets, _ = await handle.submit("messages", req, len(body))
        try:  # a queue timeout arrives on the result future as well
            return json_response(await _whole(handle, req, tickets))
        finally:
            handle.abandon(tickets)


async def _whole(handle: Any, req: AnthropicRequest, tickets: list[Any]) -> dict[str, Any]:
    """A message not streamed. When the model calls the server-side tool search, the search runs here and the
    generation goes on with its result (octo.serving.anthropic_tools): one answer over several model calls."""
    opts = answer.Options.of(req)
    result = await tickets[0].result
    turn = answer.Turn(req, opts) if opts.search is not None else None
    while turn is not None and (calls := turn.add(result)):
        await asyncio.to_thread(turn.searched, calls)
        follow = turn.follow_up()
        if follow is None:  # as many searches as one answer may run: it pauses (stop_reason "pause_turn")
            break
        more, _ = await handle.submit("messages", follow, 0)
        tickets += more
        result = await more[0].result
    return answer.response(anthropic.new_id("msg"), req.model or handle.name, result, opts, turn)


async def _streamed(request: web.Request, req: AnthropicRequest, size: int) -> web.StreamResponse:
    """A streamed message: ``ping`` events keep it alive until its first content (octo.server.keepalive); an error
    after its headers ends it with an ``error`` event."""
    start = _Start()
    ka = KeepAlive(request, SSE_HEADERS, start.beat)
    try:
        async with model_of(request, req) as handle:
            await _fetch_images(request, handle, req)
            tickets, events = await handle.submit("messages", req, size)
            try:
                await handle.wait_admitted(tickets)
                start.args = (anthropic.new_id("msg"), req.model or handle.name, tickets[0].n_prompt)
                await ka.open()
                blocks = answer.StreamBlocks(answer.Options.of(req), req)
                await _stream(ka, start, events, blocks)
                while blocks.pending:  # the model called the server-side tool search: it runs, the answer goes on
                    events = await _search(handle, ka, blocks, tickets)
                    if events is None:
                        break
                    await _stream(ka, start, events, blocks)
                return ka.resp
            finally:
                handle.abandon(tickets)
    except OctoError as err:
        return await ka.fail(err, _error)
    finally:
        ka.close()


class _Start:
    """A stream's ``message_start`` (and the ``ping`` Anthropic's API sends after it): written with the sequence's
    first event, which reports the prompt tokens restored from the prefix cache, or with the first keep-alive after
    admission when the prefill takes longer. Before admission a keep-alive is a ``ping`` alone."""

    __slots__ = ("args", "sent")

    def __init__(self) -> None:
        self.args: tuple[str, str, int] | None = None  # (id, model, prompt tokens), once admitted
        self.sent = False

    def beat(self) -> bytes:
        return self.opening(0) if self.args is not None and not self.sent else PING

    def opening(self, cached: int) -> bytes:
        self.sent = True
        mid, model, n_prompt = self.args or ("", "", 0)
        return _event(*answer.message_start(mid, model, n_prompt, cached)) + PING


async def _search(handle: Any, ka: KeepAlive, blocks: answer.StreamBlocks, tickets: list[Any]) -> Any:
    """Run the searches the model asked for and write their result blocks; the events of the model call that goes on
    from there (its tickets join ``tickets``), or None when the answer pauses."""
    turn = blocks.turn
    out = blocks.searched(await asyncio.to_thread(turn.searched, blocks.pending))
    follow = turn.follow_up()
    if follow is None:  # as many searches as one answer may run: it pauses (stop_reason "pause_turn")
        out += blocks.end()
    await ka.resp.write(b"".join(_event(name, obj) for name, obj in out))
    if follow is None:
        return None
    ka.resume()  # pings again while the next model call waits and prefills
    more, events = await handle.submit("messages", follow, 0)
    tickets += more
    await handle.wait_admitted(more)
    return events


async def _stream(ka: KeepAlive, start: _Start, events: Any, blocks: answer.StreamBlocks) -> web.StreamResponse:
    async for batch in event_stream(events, 1):
        head = b"" if start.sent else start.opening(sum(ev.tokens for ev in batch if type(ev) is Cached))
        out: list[bytes] = []
        for ev in batch:
            cls = type(ev)
            if cls is Text:
                evs = blocks.text(ev.text)
            elif cls is Reasoning:
                evs = blocks.thinking(ev.text)
            elif cls is ToolDelta:
                evs = blocks.tool(ev.delta)
            elif cls is Done:
                evs = blocks.finish(ev.result)
            elif cls is Failed:
                out.append(_error(ev.error))
                continue
            else:
                continue  # Cached, Logprob
            out += [_event(name, obj) for name, obj in evs]
        if not out:  # (the Cached event alone, or text a thinking block holds back)
            if head:
                await ka.send(head)
            continue
        if ka.live:
            await ka.stop()
        await ka.resp.write(head + b"".join(out))
    return ka.resp


def _error(exc: Any) -> bytes:
    return _event("error", anthropic_error_body(exc))


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_body(request)
    req = parse(AnthropicCountTokensRequest, body)
    async with model_of(request, req) as handle:
        await _fetch_images(request, handle, req)
        n = await handle.count_tokens("messages", req)
    return json_response({"input_tokens": n})
