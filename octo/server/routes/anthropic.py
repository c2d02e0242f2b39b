"""Route handlers of the Anthropic Messages API: ``POST /v1/messages`` (streaming and not) and ``POST
/v1/messages/count_tokens``, and the error shape of these routes. The request runs as a chat generation in the
model's worker (octo.serving.anthropic builds it and shapes the answer).

A stream's ``message_start`` is written when the first event of the sequence arrives, so that it can report
``usage.cache_read_input_tokens``: the engine thread posts a ``Cached`` event (``octo.scheduler.events``), before any
text,
when it restored prompt tokens from the prefix cache (none: nothing was cached)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from octo.errors import OctoError
from octo.protocol.anthropic import AnthropicCountTokensRequest, AnthropicRequest
from octo.protocol.openai import parse
from octo.scheduler.events import Cached, Done, Failed, Reasoning, Text, ToolDelta
from octo.server.routes.openai import dumps, event_stream, json_body, json_response, model_of, sse_response
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


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(AnthropicRequest, body)
    anthropic.refuse_threads(req)
    async with model_of(request, req) as handle:
        tickets, events = await handle.submit("messages", req, len(body))
        try:
            if not req.stream:  # a queue timeout arrives on the result future as well
                return json_response(await _whole(handle, req, tickets))
            await handle.wait_admitted(tickets)
            mid, model = anthropic.new_id("msg"), req.model or handle.name
            resp = await sse_response(request)
            blocks = answer.StreamBlocks(answer.Options.of(req), req)
            await _stream(resp, tickets[0], events, mid, model, blocks)
            while blocks.pending:  # the model called the server-side tool search: it runs, the answer goes on
                events = await _search(handle, resp, blocks, tickets)
                if events is None:
                    break
                await _stream(resp, None, events, mid, model, blocks)
            return resp
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


async def _search(handle: Any, resp: web.StreamResponse, blocks: answer.StreamBlocks, tickets: list[Any]) -> Any:
    """Run the searches the model asked for and write their result blocks; the events of the model call that goes on
    from there (its tickets join ``tickets``), or None when the answer pauses."""
    turn = blocks.turn
    out = blocks.searched(await asyncio.to_thread(turn.searched, blocks.pending))
    follow = turn.follow_up()
    if follow is None:  # as many searches as one answer may run: it pauses (stop_reason "pause_turn")
        out += blocks.end()
    await resp.write(b"".join(_event(name, obj) for name, obj in out))
    if follow is None:
        return None
    more, events = await handle.submit("messages", follow, 0)
    tickets += more
    await handle.wait_admitted(more)
    return events


async def _stream(resp: web.StreamResponse, ticket: Any, events: Any, mid: str, model: str,
                  blocks: answer.StreamBlocks) -> None:
    """One model call's events (``ticket`` None: a call that goes on from a search, after the message started)."""
    started = ticket is None
    async for batch in event_stream(events, 1):
        out: list[bytes] = []
        if not started:  # the Cached event, when there is one, comes first
            started = True
            cached = sum(ev.tokens for ev in batch if isinstance(ev, Cached))
            out.append(_event(*answer.message_start(mid, model, ticket.n_prompt, cached)))
            out.append(_event("ping", {"type": "ping"}))
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
                out.append(_event("error", anthropic_error_body(ev.error)))
                continue
            else:
                continue  # Cached, Logprob
            out += [_event(name, obj) for name, obj in evs]
        if out:
            await resp.write(b"".join(out))


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_body(request)
    req = parse(AnthropicCountTokensRequest, body)
    async with model_of(request, req) as handle:
        n = await handle.count_tokens("messages", req)
    return json_response({"input_tokens": n})
