"""Route handlers of Ollama's native API: ``/api/chat``, ``/api/generate`` (NDJSON streams by default, one JSON object
with ``"stream": false``), ``/api/embed``, ``/api/embeddings``, and ``GET|HEAD /`` for clients that probe Ollama
(a browser asking for HTML gets the dashboard). The model list, ``show``, ``pull`` and ``delete`` routes live in
octo.server.routes.ollama_models. Generation goes through the same model handle as every API (``submit("ollama",
...)``):
queue limits, batching, the prefix cache, auth and metrics apply unchanged. Errors are Ollama's ``{"error": "..."}``
(octo.server.app shapes every error under ``/api/``), with the status octo gives them.

Ollama's durations are measured: ``total_duration`` and ``load_duration`` (until the model is ready) here,
``prompt_eval_duration`` (admission to the first generated token) and ``eval_duration`` (from there to the end) on
the engine thread (``Result.prompt_eval_s``, ``Result.eval_s``)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from aiohttp import web

from octo.engine import Task
from octo.errors import InvalidRequest, OctoError, UnsupportedParameter
from octo.protocol.ollama import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, parse
from octo.runtime.specs import parse_keep_alive
from octo.scheduler.events import Done, Failed, Logprob, Reasoning, Text, ToolDelta
from octo.scheduler.jobs import Result
from octo.server.bodies import read_json_body
from octo.server.keepalive import NDJSON_HEADERS, KeepAlive
from octo.server.routes import dashboard as api_dashboard
from octo.server.routes import ollama_models as api_ollama_models
from octo.server.routes.openai import dumps, json_response
from octo.server.state import STATE
from octo.serving import ollama

ROOT_TEXT = "Ollama is running"


async def body_of(request: web.Request) -> bytes:
    return await read_json_body(request, int(request.app[STATE].config.max_body_mb * 2**20))


def error_line(exc: Any) -> bytes:
    message = exc.message if isinstance(exc, OctoError) else str(exc)
    return dumps({"error": message}) + b"\n"


# -- GET|HEAD / --------------------------------------------------------------------------------------------------
async def root(request: web.Request) -> web.StreamResponse:
    """"Ollama is running" for a client that probes the server (Ollama's root), the dashboard for a browser."""
    if "text/html" in request.headers.get("Accept", ""):
        return await api_dashboard.page(request)
    return web.Response(text=ROOT_TEXT, content_type="text/plain")


async def version(request: web.Request) -> web.Response:
    """The Ollama release whose API octo implements (clients gate features on it), not octo's own version."""
    return json_response({"version": ollama.API_VERSION})


# -- /api/chat and /api/generate -------------------------------------------------------------------------------
async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatRequest)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, GenerateRequest)


def _shape(req: Any, model: str) -> Any:
    """The builder of one answer object of the request's kind (chat: ``message``; generate: ``response``)."""
    if isinstance(req, ChatRequest):
        def chunk(content: str = "", thinking: str | None = None, calls: list | None = None) -> dict[str, Any]:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = ollama.tool_calls(calls)
            return {"model": model, "created_at": ollama.now(), "message": msg, "done": False}
    else:
        def chunk(content: str = "", thinking: str | None = None, calls: list | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {"model": model, "created_at": ollama.now(), "response": content, "done": False}
            if thinking:
                out["thinking"] = thinking
            return out
    return chunk


async def _generate(request: web.Request, kind: type) -> web.StreamResponse:
    clock = ollama.Clock(time.perf_counter())
    body = await body_of(request)
    req = parse(kind, body, request.path)
    name = ollama.model_name(req.model)
    ollama.Options.parse(req.options)  # an option of the wrong type: a 400 before a model loads for it
    if isinstance(req, GenerateRequest):
        ollama.check_generate(req)
        if not req.prompt:
            return await _load_or_unload(request, req, name, {"response": ""})
    elif not req.messages:
        return await _load_or_unload(request, req, name, {"message": {"role": "assistant", "content": ""}})
    chunk = _shape(req, req.model)
    if req.streaming:
        return await _streamed(request, req, name, len(body), chunk, clock)
    async with request.app[STATE].registry.use(name, req.keep_alive) as handle:
        clock.loaded = time.perf_counter()
        tickets, _ = await handle.submit("ollama", req.model_copy(update={"stream": False, "model": name}), len(body))
        try:  # a queue timeout arrives on the result future as well
            result = await tickets[0].result
            clock.done = time.perf_counter()
            out = _Output(result.text, result.reasoning, result.tool_calls, result.logprobs)
            return json_response(_final(chunk, result, clock, out, True))
        finally:
            handle.abandon(tickets)


async def _streamed(request: web.Request, req: Any, name: str, size: int, chunk: Any,
                    clock: ollama.Clock) -> web.StreamResponse:
    """A streamed answer (NDJSON). Until its first content an empty chunk (``done: false``, as Ollama's own streams
    send while a tool call is parsed) keeps it alive (octo.server.keepalive); an error after its headers is an
    ``{"error": ...}`` line, as Ollama's."""
    ka = KeepAlive(request, NDJSON_HEADERS, lambda: dumps(chunk()) + b"\n")
    try:
        async with request.app[STATE].registry.use(name, req.keep_alive) as handle:
            clock.loaded = time.perf_counter()
            tickets, events = await handle.submit("ollama", req.model_copy(update={"stream": True, "model": name}),
                                                  size)
            try:
                await handle.wait_admitted(tickets)
                await ka.open()
                return await _stream(ka, events, chunk, clock)
            finally:
                handle.abandon(tickets)
    except OctoError as err:
        return await ka.fail(err, error_line)
    finally:
        ka.close()


async def _load_or_unload(request: web.Request, req: Any, name: str, empty: dict[str, Any]) -> web.Response:
    """An empty request loads the model (``done_reason`` "load"), or with ``keep_alive`` 0 unloads it ("unload"):
    at once when it is idle, else when its requests in flight are done."""
    registry = request.app[STATE].registry
    if req.keep_alive is not None and parse_keep_alive(req.keep_alive) == 0:
        slot = await registry.route(name)
        if slot.handle is not None:
            if slot.inflight:
                slot.keep_alive = 0  # the last request in flight unloads it (Registry.use)
            else:
                await registry.unload(slot.name)
        reason = "unload"
    else:
        async with registry.use(name, req.keep_alive):
            reason = "load"
    return json_response({"model": req.model, "created_at": ollama.now(), **empty, "done": True,
                          "done_reason": reason})


class _Output:
    """What one sequence's answer adds up to: a stream collects its tool calls and logprobs as they come."""

    def __init__(self, text: str = "", thinking: str | None = None, calls: list | None = None,
                 lps: list | None = None) -> None:
        self.text, self.thinking = text, thinking
        self.calls: list[dict[str, Any]] = list(calls or [])
        self.lps: list = list(lps or [])

    def tool(self, delta: dict[str, Any]) -> None:
        """A Chat Completions tool-call delta (octo.scheduler.emission): a new call, or a fragment of its arguments."""
        for tc in delta.get("tool_calls", []):
            fn = tc.get("function") or {}
            if tc.get("id"):
                self.calls.append({"id": tc["id"], "type": "function",
                                   "function": {"name": fn.get("name", ""), "arguments": ""}})
            if fn.get("arguments") and self.calls:
                self.calls[-1]["function"]["arguments"] += fn["arguments"]


def _final(chunk: Any, result: Result, clock: ollama.Clock, out: _Output, whole: bool) -> dict[str, Any]:
    obj = chunk(out.text if whole else "", out.thinking if whole else None, (out.calls or None) if whole else None)
    obj.update(done=True, done_reason=ollama.done_reason(result), **clock.metrics(result))
    lps = ollama.logprobs(out.lps if whole else None)
    if lps:
        obj["logprobs"] = lps
    return obj


async def _stream(ka: KeepAlive, events: asyncio.Queue, chunk: Any, clock: ollama.Clock) -> web.StreamResponse:
    out = _Output()
    while True:
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        lines: list[bytes] = []
        end = False
        for ev in batch:
            kind = type(ev)
            if kind is Text:
                obj = chunk(ev.text)
                if out.lps:  # a token's logprobs come just before its text
                    obj["logprobs"], out.lps = ollama.logprobs(out.lps), []
            elif kind is Reasoning:
                obj = chunk("", ev.text)
            elif kind is ToolDelta:
                out.tool(ev.delta)
                continue
            elif kind is Logprob:
                out.lps.append(ev.entry)
                continue
            elif kind is Done or kind is Failed:
                clock.done, end = time.perf_counter(), True
                if kind is Failed:
                    lines.append(error_line(ev.error))
                    break
                if out.calls:  # Ollama sends whole calls: once they are complete
                    lines.append(dumps(chunk("", None, out.calls)) + b"\n")
                lines.append(dumps(_final(chunk, ev.result, clock, out, False)) + b"\n")
                break
            else:
                continue  # Cached
            lines.append(dumps(obj) + b"\n")
        if lines:
            if ka.live:
                await ka.stop()
            await ka.resp.write(b"".join(lines))
        if end:
            return ka.resp


# -- /api/embed and /api/embeddings ----------------------------------------------------------------------------
def _embed_options(request: web.Request, options: dict[str, Any] | None, n_ctx: int) -> None:
    """Embeddings sample nothing: every option is ignored (one warning line names them) but a ``num_ctx`` the loaded
    context holds (octo embeds with the whole loaded context; Ollama caps num_ctx at it the same way)."""
    opts = ollama.Options.parse(options)
    ollama.warn_ignored(request.path, [k for k, v in (options or {}).items() if v is not None and not (
        k == "num_ctx" and (opts.num_ctx or n_ctx) >= n_ctx)])


async def _embed_call(request: web.Request, req: Any, name: str, texts: list[str]) -> tuple[Any, Any, float]:
    ollama.Options.parse(req.options)  # an option of the wrong type: a 400 before a model loads for it
    async with request.app[STATE].registry.use(name, req.keep_alive) as handle:
        loaded = time.perf_counter()
        if Task.EMBEDDINGS not in handle.tasks:
            raise InvalidRequest(f"\"{req.model}\" does not support embeddings", param="model",
                                 code="unsupported_task")
        dim = getattr(req, "dimensions", None)
        if dim and dim != handle.info.embedding_dim:
            raise UnsupportedParameter("dimensions", f"this model's embeddings have {handle.info.embedding_dim} "
                                       "dimensions")
        _embed_options(request, req.options, handle.info.n_ctx)
        return await handle.call("embed", texts), handle, loaded


async def embed(request: web.Request) -> web.Response:
    started = time.perf_counter()
    req = parse(EmbedRequest, await body_of(request), request.path)
    name = ollama.model_name(req.model)
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not texts or any(t == "" for t in texts):
        raise InvalidRequest("input must be a non-empty string or a list of non-empty strings", param="input")
    result, _, loaded = await _embed_call(request, req, name, texts)
    vectors = []
    for vec in result.vectors:  # Ollama's /api/embed answers unit vectors
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        vectors.append([v / norm for v in vec])
    ns = 1_000_000_000
    return json_response({"model": req.model, "embeddings": vectors,
                          "total_duration": max(1, int((time.perf_counter() - started) * ns)),
                          "load_duration": max(1, int((loaded - started) * ns)),
                          "prompt_eval_count": result.n_tokens})


async def embeddings(request: web.Request) -> web.Response:
    req = parse(EmbeddingsRequest, await body_of(request), request.path)
    name = ollama.model_name(req.model)
    if not req.prompt:  # as Ollama: an empty prompt has an empty embedding
        async with request.app[STATE].registry.use(name, req.keep_alive):
            return json_response({"embedding": []})
    result, _, _ = await _embed_call(request, req, name, [req.prompt])
    return json_response({"embedding": list(result.vectors[0])})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/api/chat", chat)
    router.add_post("/api/generate", generate)
    router.add_post("/api/embed", embed)
    router.add_post("/api/embeddings", embeddings)
    router.add_get("/api/version", version)
    api_ollama_models.add_routes(router)
