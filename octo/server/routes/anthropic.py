"""Route handlers of the Anthropic Messages API: ``POST /v1/messages`` (streaming and not) and ``POST
/v1/messages/count_tokens``, and the error shape of these routes. The request runs as a chat generation in the
model's worker (octo.serving.anthropic builds it and shapes the answer).

A stream's ``message_start`` is written when the first event of the sequence arrives, so that it can report
``usage.cache_read_input_tokens``: the engine thread posts a ``Cached`` event (``octo.scheduler.events``), before any
text,
when it restored prompt tokens from the prefix cache (none: nothing was cached)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from octo.errors import OctoError
from octo.protocol.anthropic import AnthropicCountTokensRequest, AnthropicRequest
from octo.protocol.openai import parse
from octo.scheduler.events import Cached, Done, Failed, Text, ToolDelta
from octo.server.routes.openai import dumps, event_stream, json_body, json_response, model_of, sse_response
from octo.serving import anthropic

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(exc: Any) -> dict[str, Any]:
    if isinstance(exc, OctoError):
        kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": exc.message}}
    return {"type": "error", "error": {"type": "api_error", "message": str(exc)}}


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(AnthropicRequest, body)
    async with model_of(request, req) as handle:
        tickets, events = await handle.submit("messages", req, len(body))
        mid, model, opts = anthropic.new_id("msg"), req.model or handle.name, anthropic.Options.of(req)
        try:
            if not req.stream:  # a queue timeout arrives on the result future as well
                return json_response(anthropic.response(mid, model, await tickets[0].result, opts))
            await handle.wait_admitted(tickets)
            return await _stream(request, tickets[0], events, mid, model, opts)
        finally:
            handle.abandon(tickets)


async def _stream(request: web.Request, ticket: Any, events: Any, mid: str, model: str,
                  opts: anthropic.Options) -> web.StreamResponse:
    resp = await sse_response(request)
    blocks = anthropic.StreamBlocks(opts)
    started = False
    async for batch in event_stream(events, 1):
        out: list[bytes] = []
        if not started:  # the Cached event, when there is one, comes first
            started = True
            cached = sum(ev.tokens for ev in batch if isinstance(ev, Cached))
            out.append(_event(*anthropic.message_start(mid, model, ticket.n_prompt, cached)))
            out.append(_event("ping", {"type": "ping"}))
        for ev in batch:
            cls = type(ev)
            if cls is Text:
                evs = blocks.text(ev.text)
            elif cls is ToolDelta:
                evs = blocks.tool(ev.delta)
            elif cls is Done:
                evs = blocks.finish(ev.result)
            elif cls is Failed:
                out.append(_event("error", anthropic_error_body(ev.error)))
                continue
            else:
                continue  # Cached, Logprob
            out += [_event(name, obj) for name, obj in evs]
        if out:
            await resp.write(b"".join(out))
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_body(request)
    req = parse(AnthropicCountTokensRequest, body)
    async with model_of(request, req) as handle:
        n = await handle.count_tokens("messages", req)
    return json_response({"input_tokens": n})
