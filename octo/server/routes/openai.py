"""Route handlers for generation and embeddings: parse, call the serving layer and scheduler, write JSON/SSE.

A stream's headers go out once every sequence of the request is admitted, or once the first keep-alive is due
(octo.server.keepalive), whichever comes first: validation errors, a full queue (503) and an unknown model arrive as a
proper HTTP status; an error after the headers (a load that fails, a queue time-out) ends the stream with an error
event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from octo.engine import Task
from octo.errors import InvalidRequest, OctoError, UnsupportedParameter
from octo.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse,
)
from octo.scheduler.events import END, Done, Event, Failed, Logprob, Reasoning, Text, ToolDelta
from octo.scheduler.jobs import Result
from octo.server import imagefetch
from octo.server.bodies import read_json_body
from octo.server.keepalive import SSE_HEADERS, KeepAlive, comment
from octo.server.state import STATE
from octo.serving import openai as serving


def dumps(obj: Any) -> bytes:
    """JSON bytes of ``obj``. What orjson refuses takes the standard library's path: an integer past 64 bits (a
    request's own value echoed back, such as a number in a tool's schema), a string with surrogates (a header's
    bytes that were not UTF-8, quoted in an error), escaped as ASCII."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json", headers=headers)


async def json_body(request: web.Request) -> bytes:
    """The JSON body: bounded by --max-body-mb before and after decompression."""
    return await read_json_body(request, int(request.app[STATE].config.max_body_mb * 2**20))


def model_of(request: web.Request, req: Any):
    """``async with``: the ready handle of the model ``req`` names, held for the request (loaded on demand, never
    unloaded under it; a crashed worker restarts here)."""
    return request.app[STATE].registry.use(req.model, req.keep_alive)


def _data(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def event_stream(queue: asyncio.Queue, n: int) -> AsyncIterator[list[Event]]:
    """Batches of ``octo.scheduler.events`` until ``n`` sequences are done (drains what is ready)."""
    done = 0
    while done < n:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        for e in batch:
            if type(e) in END:
                done += 1
        yield batch


async def _write_events(ka: KeepAlive, queue: asyncio.Queue, n: int,
                        text_chunk: Callable[[int, str, list | None], bytes],
                        finish_chunk: Callable[[int, str, list | None], bytes],
                        tool_chunk: Callable[[int, dict, list | None], bytes] | None = None,
                        reasoning_chunk: Callable[[int, str], bytes] | None = None) -> list[Result | None]:
    """Write the events of ``n`` sequences as SSE chunks until all are done; their results by choice index
    (None for one that failed: its error went out as an error event). A token's logprobs ride on the next chunk of
    its choice. The first chunk ends the keep-alives."""
    results: list[Result | None] = [None] * n
    pending: dict[int, list] = {}
    async for batch in event_stream(queue, n):
        out = []
        for ev in batch:  # dispatch on the exact class: a ``match`` with class patterns costs 5-10 times as much
            cls = type(ev)
            if cls is Text:
                out.append(text_chunk(ev.index, ev.text, pending.pop(ev.index, None)))
            elif cls is Logprob:
                pending.setdefault(ev.index, []).append(ev.entry)
            elif cls is Reasoning:
                if reasoning_chunk is not None:
                    out.append(reasoning_chunk(ev.index, ev.text))
            elif cls is ToolDelta:
                if tool_chunk is not None:
                    out.append(tool_chunk(ev.index, ev.delta, pending.pop(ev.index, None)))
            elif cls is Done:
                results[ev.index] = ev.result
                out.append(finish_chunk(ev.index, ev.result.finish_reason, pending.pop(ev.index, None)))
            elif cls is Failed:
                pending.pop(ev.index, None)
                out.append(_error_event(ev.error))
        if out:
            if ka.live:
                await ka.stop()
            await ka.resp.write(b"".join(out))
    return results


def _error_event(exc: Any) -> bytes:
    err = exc if isinstance(exc, OctoError) else InvalidRequest(str(exc))
    return _data(err.body())


def _error_done(err: OctoError) -> bytes:
    """An error that ends a stream before its first content."""
    return _error_event(err) + b"data: [DONE]\n\n"


# -- /v1/chat/completions ------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(ChatCompletionRequest, body)
    if req.stream:
        return await _streamed(request, req, "chat", len(body), _chat_events)
    async with model_of(request, req) as handle:
        await imagefetch.fetch_remote(request, handle, serving.image_refs(req))
        tickets, _ = await handle.submit("chat", req, len(body))
        try:  # a queue timeout arrives on the result future as well
            results = [await t.result for t in tickets]
            return json_response(serving.chat_response(serving.new_id("chatcmpl"), req.model or handle.name,
                                                       handle.fingerprint, results))
        finally:
            handle.abandon(tickets)


async def _streamed(request: web.Request, req: Any, kind: str, size: int,
                    write: Callable[[KeepAlive, Any, Any, list, asyncio.Queue], Awaitable[None]]) -> web.StreamResponse:
    """A streamed chat or completion: the model (loaded on demand), admission, then ``write`` its events; SSE
    comments keep the stream alive until its first content (octo.server.keepalive), and an error after the
    headers ends it with an error event."""
    ka = KeepAlive(request, SSE_HEADERS, comment)
    try:
        async with model_of(request, req) as handle:
            if kind == "chat":
                await imagefetch.fetch_remote(request, handle, serving.image_refs(req))
            tickets, events = await handle.submit(kind, req, size)
            try:
                await handle.wait_admitted(tickets)
                await ka.open()
                await write(ka, handle, req, tickets, events)
            finally:
                handle.abandon(tickets)
        await ka.resp.write(b"data: [DONE]\n\n")
        return ka.resp
    except OctoError as err:
        return await ka.fail(err, _error_done)
    finally:
        ka.close()


async def _chat_events(ka: KeepAlive, handle: Any, req: ChatCompletionRequest, tickets: list,
                       events: asyncio.Queue) -> None:
    model, rid, fp, created = req.model or handle.name, serving.new_id("chatcmpl"), handle.fingerprint, int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, finish: str | None = None, lps: list | None = None) -> bytes:
        return _data({**serving.chat_chunk(rid, model, fp, created, index, delta, finish, lps), **extra})

    await ka.send(b"".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)))
    results = await _write_events(ka, events, req.n,
                                  lambda i, text, lps: chunk(i, {"content": text}, None, lps),
                                  lambda i, finish, lps: chunk(i, {}, finish, lps),
                                  lambda i, delta, lps: chunk(i, delta, None, lps),
                                  lambda i, text: chunk(i, {"reasoning_content": text}))
    if include_usage and all(results):
        usage = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "system_fingerprint": fp, "choices": [], "usage": serving.usage(results)}
        await ka.resp.write(_data(usage))


# -- /v1/completions -----------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    req = parse(CompletionRequest, body)
    if req.echo and req.stream:
        raise UnsupportedParameter("echo", "echo is only supported without stream")
    if req.stream:
        return await _streamed(request, req, "completion", len(body), _completion_events)
    async with model_of(request, req) as handle:
        tickets, _ = await handle.submit("completion", req, len(body))
        model, rid, fp = req.model or handle.name, serving.new_id("cmpl"), handle.fingerprint
        try:
            results = [await t.result for t in tickets]
            texts = await handle.prompt_texts(req) if req.echo else [""] * (len(results) // req.n)
            prefixes = [texts[i // req.n] for i in range(len(results))]
            return json_response(serving.completion_response(rid, model, fp, results, prefixes, req.n))
        finally:
            handle.abandon(tickets)


async def _completion_events(ka: KeepAlive, handle: Any, req: CompletionRequest, tickets: list,
                             events: asyncio.Queue) -> None:
    model, rid, fp, created = req.model or handle.name, serving.new_id("cmpl"), handle.fingerprint, int(time.time())
    offsets: dict[int, int] = {}

    def chunk(index: int, text: str, lps: list | None, finish: str | None = None) -> bytes:
        logprobs = None
        if lps is not None:
            logprobs = serving.completion_logprobs(lps, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        return _data(serving.completion_chunk(rid, model, fp, created, index, text, finish, logprobs))

    results = await _write_events(ka, events, len(tickets), chunk, lambda i, finish, lps: chunk(i, "", lps, finish))
    if req.stream_options and req.stream_options.include_usage and all(results):
        u = serving.completion_response(rid, model, fp, results, [""] * len(results), req.n)["usage"]
        await ka.resp.write(_data({"id": rid, "object": "text_completion", "created": created, "model": model,
                                   "system_fingerprint": fp, "choices": [], "usage": u}))


# -- /v1/embeddings ------------------------------------------------------------------------------------
async def embeddings(request: web.Request) -> web.Response:
    import numpy as np
    body = await json_body(request)
    req = parse(EmbeddingRequest, body)
    serving.check_embedding_input(req.input, 0)  # the limits that need no model, before one loads for it
    async with model_of(request, req) as handle:
        if Task.EMBEDDINGS not in handle.tasks:
            raise InvalidRequest(f"Model '{handle.name}' ({handle.engine_name}) does not support embeddings.",
                                 param="model", code="unsupported_task")
        dim = handle.info.embedding_dim
        if req.dimensions is not None and req.dimensions != dim:
            raise UnsupportedParameter("dimensions", f"this model's embeddings have {dim} dimensions")
        serving.check_embedding_input(req.input, handle.info.n_vocab)
        result = await handle.call("embed", req.input)
        data = []
        for i, vec in enumerate(result.vectors):
            emb: Any = vec
            if req.encoding_format == "base64":
                emb = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return json_response({"object": "list", "data": data, "model": req.model or handle.name,
                              "usage": {"prompt_tokens": result.n_tokens, "total_tokens": result.n_tokens}})
