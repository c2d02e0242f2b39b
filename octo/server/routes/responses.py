"""Route handlers of the Responses API: ``POST /v1/responses`` (streaming and not), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``. The request runs as a chat generation
(octo.serving.responses.to_chat); stored responses live in SQLite (octo.serving.response_store)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from octo.errors import ContextLengthExceeded, NotFound, OctoError
from octo.logsafe import quoted
from octo.protocol.openai import ChatCompletionRequest, parse, validation_error
from octo.protocol.responses import ResponsesRequest
from octo.scheduler.events import Done, Failed, Logprob, Text, ToolDelta
from octo.server import imagefetch
from octo.server.keepalive import SSE_HEADERS, KeepAlive
from octo.server.routes.openai import dumps, event_stream, json_body, json_response, model_of
from octo.server.state import STATE
from octo.serving import response_items, responses
from octo.serving.response_store import ResponseStore

MAX_TRUNCATIONS = 256
WARNING_HEADER = "x-octo-warning"
log = logging.getLogger("octo.serving.responses")


def _store(request: web.Request) -> ResponseStore:
    state = request.app[STATE]
    if state.store is None:  # (an app made without setup(): opened on first use, checked as at start)
        state.store = new_store(state.config)
    return state.store


def new_store(config: Any) -> ResponseStore:
    return ResponseStore(ttl_s=config.responses_ttl, max_bytes=int(config.responses_max_mb * 2**20))


def _chat(form: responses.ChatForm, req: ResponsesRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(form.body)
    except ValidationError as exc:
        raise responses.translate_error(validation_error(exc), req, form.params) from None


def _drop_oldest(body: dict[str, Any], has_instructions: bool) -> bool:
    """truncation "auto": drop the oldest turn of the conversation (and the tool results answering its calls);
    False when only the last turn is left."""
    msgs = body["messages"]
    first = 1 if has_instructions else 0
    if len(msgs) - first <= 1:
        return False
    dropped = msgs.pop(first)
    ids = {c["id"] for c in dropped.get("tool_calls") or []}
    while len(msgs) > first and msgs[first]["role"] == "tool" and msgs[first].get("tool_call_id") in ids:
        msgs.pop(first)  # a tool result without its call is not a conversation
    return len(msgs) > first


def _sse_event(ev: dict[str, Any]) -> bytes:
    return b"event: " + ev["type"].encode() + b"\ndata: " + dumps(ev) + b"\n\n"


async def create_response(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(ResponsesRequest, body)
    responses.check_unsupported(req)
    store = _store(request)
    if req.store:  # decided before anything is generated: a response that could not be stored is not made
        await store.check_writable()
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = await store.get(req.previous_response_id)
        if prev is None:
            raise NotFound(f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id")
        history = prev[1]
    form = responses.to_chat(req, history)
    chat_req = _chat(form, req)
    if req.stream:
        return await _streamed(request, req, form, chat_req, len(body))
    try:
        async with model_of(request, chat_req) as handle:
            return await _serve(request, handle, req, form, chat_req, len(body))
    except OctoError as err:
        raise responses.translate_error(err, req, form.params) from None


async def _serve(request: web.Request, handle: Any, req: ResponsesRequest, form: responses.ChatForm,
                 chat_req: ChatCompletionRequest, size: int, stream: _Stream | None = None) -> web.StreamResponse:
    """The response (``stream``: streamed), the conversation cut from its oldest turn while it does not fit the
    context with truncation "auto"; remote images fetched first (octo.server.imagefetch)."""
    chat_body, conversation = form.body, form.conversation
    if any(ref.remote for ref in form.images):
        await imagefetch.fetch_remote(request, handle, form.images)  # (the body and the conversation hold them now)
        chat_req = _chat(form, req)
    for _ in range(MAX_TRUNCATIONS):
        tickets: list = []
        try:
            tickets, events = await handle.submit("chat", chat_req, size)
            if stream is not None:
                await handle.wait_admitted(tickets)
                return await stream.write(request, events, conversation)
            result = await tickets[0].result
            break
        except ContextLengthExceeded:
            if req.truncation != "auto" or not _drop_oldest(chat_body, bool(req.instructions)):
                raise
            chat_req = _chat(form, req)
        finally:
            handle.abandon(tickets)
    else:
        raise ContextLengthExceeded("The conversation does not fit the model's context.", param="input")
    rid, model = responses.new_id("resp"), req.model or handle.name
    status, incomplete = responses.status_of(result)
    output = responses.output_items(result, req)
    obj = responses.response_object(rid, req, model, int(time.time()), status, output, result, incomplete)
    if req.store:
        await _store(request).put(obj, [*conversation, responses.assistant_message(output)])
    return json_response(obj, headers=_warning(req))


def _warning(req: ResponsesRequest) -> dict[str, str] | None:
    """The ``x-octo-warning`` header (and an info log line) saying what of the request the model was not given."""
    warning = responses.ToolNames(req).warning()
    if warning is None:
        return None
    log.info("POST /v1/responses: %s", quoted(warning))
    return {WARNING_HEADER: warning}


async def _streamed(request: web.Request, req: ResponsesRequest, form: responses.ChatForm,
                    chat_req: ChatCompletionRequest, size: int) -> web.StreamResponse:
    """A streamed response; an error after its headers ends it with ``response.failed``."""
    model = req.model or (await request.app[STATE].registry.route(None)).name
    stream = _Stream(responses.EventStream(responses.new_id("resp"), req, model))
    stream.ka = KeepAlive(request, {**SSE_HEADERS, **(_warning(req) or {})}, stream.beat)
    try:
        async with model_of(request, chat_req) as handle:
            return await _serve(request, handle, req, form, chat_req, size, stream)
    except OctoError as err:
        return await stream.ka.fail(responses.translate_error(err, req, form.params), stream.failed)
    finally:
        stream.ka.close()


class _Stream:
    """The events of one streamed response. Its keep-alive (octo.server.keepalive) is ``response.in_progress``, an
    event, because Codex's idle timer counts events and SSE comments are none (docs/api.md); the first one, when it
    comes before admission, opens the stream with ``response.created`` as every client expects first."""

    __slots__ = ("es", "ka", "opened")

    def __init__(self, es: responses.EventStream) -> None:
        self.es = es
        self.ka: KeepAlive
        self.opened = False

    def beat(self) -> bytes:
        if not self.opened:
            self.opened = True
            return b"".join(_sse_event(e) for e in self.es.start())
        return _sse_event(self.es.in_progress())

    def failed(self, err: OctoError) -> bytes:
        return _sse_event(self.es.failed(err))

    async def write(self, request: web.Request, events: Any, conversation: list[dict[str, Any]]) -> web.StreamResponse:
        es, ka, req = self.es, self.ka, self.es.req
        if not self.opened:
            await ka.send(self.beat())
        lps: list = []
        async for batch in event_stream(events, 1):
            out: list[dict[str, Any]] = []
            for ev in batch:
                cls = type(ev)
                if cls is Logprob:
                    lps.append(ev.entry)
                elif cls is Text:
                    out += es.text(ev.text, lps)
                    lps = []
                elif cls is ToolDelta:
                    out += es.tool(ev.delta)
                elif cls is Done:
                    closing, final = es.finish(ev.result)
                    try:
                        if req.store:
                            await _store(request).put(final, [*conversation,
                                                              responses.assistant_message(final["output"])])
                        out += closing
                    except OctoError as err:  # the store failed while this response ran: it ends failed, not stored
                        out.append(es.failed(err))
                elif cls is Failed:
                    err = ev.error if isinstance(ev.error, OctoError) else OctoError(str(ev.error))
                    out.append(es.failed(err))
            if out:
                if ka.live:
                    await ka.stop()
                await ka.resp.write(b"".join(_sse_event(e) for e in out))
        return ka.resp


async def get_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    found = await _store(request).get(rid)
    if found is None:
        raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
    return json_response(found[0])


async def list_input_items(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    found = await _store(request).get(rid)
    if found is None:
        raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
    return json_response(response_items.input_items_page(rid, found[1], request.query))


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not await _store(request).delete(rid):
        raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
    return json_response({"id": rid, "object": "response", "deleted": True})


def setup(app: web.Application) -> None:
    """The routes, and the store opened and checked at start (in its own thread: the server does not wait)."""
    add_routes(app.router)

    async def open_store(app: web.Application) -> None:
        state = app[STATE]
        if state.store is None:
            state.store = new_store(state.config)
            state.store.start()

    async def close_store(app: web.Application) -> None:
        store = app[STATE].store
        if store is not None:
            await asyncio.get_running_loop().run_in_executor(None, store.close)

    app.on_startup.append(open_store)
    app.on_cleanup.append(close_store)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/responses", create_response)
    router.add_get("/v1/responses/{response_id}", get_response)
    router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    router.add_delete("/v1/responses/{response_id}", delete_response)
