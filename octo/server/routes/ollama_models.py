"""Ollama's model-management routes over octo's registry and catalog: ``GET /api/tags`` (every servable model),
``GET /api/ps`` (the loaded ones), ``POST /api/show``, ``POST /api/pull`` (a real huggingface_hub download of the
catalog model's artifacts, its progress streamed as Ollama's progress objects), ``DELETE /api/delete`` (the
downloaded artifacts, from the hub cache), and clear refusals for what octo does not do (``/api/create``,
``/api/push``, ``/api/copy``, blobs).

Names are Ollama's ``name:tag``: a model whose octo name has no tag is listed as ``name:latest`` (and
``name:latest`` resolves to the name on every route: octo.runtime.registry); a model named by its path is listed by a
name (octo.runtime.names), never by a path on the server. ``digest`` is the SHA-256 of the artifact's
identity
(its URI, size and modification time), stable while the file is: octo does not hash multi-gigabyte files to list
them."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from octo.errors import InvalidRequest, NotFound, OctoError
from octo.models.resolve import uri_kind
from octo.protocol.ollama import ModelRequest, parse
from octo.runtime.names import public_name
from octo.server.bodies import read_json_body
from octo.server.routes.openai import dumps, json_response
from octo.server.stamp import start_stream
from octo.server.state import STATE
from octo.serving import ollama
from octo.text.reasoning import template_source

FORMATS = {"llamacpp": "gguf", "mlx": "safetensors", "onnx": "onnx", "whisper": "whisper"}
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model that stays loaded (Ollama writes a far-off time too)


def tagged(name: str) -> str:
    """Ollama's ``name:tag`` of an octo name: ``:latest`` added to a name without a tag (not to a local path)."""
    if name.startswith(("/", ".", "~")) or ":" in name.rpartition("/")[2]:
        return name
    return f"{name}:latest"


def _digest(*parts: Any) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()


def _size_label(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def _artifact_path(model: str, engines: dict[str, Any]) -> tuple[str, Path | None, str | None]:
    """(format, local path or None, family) of a catalog name or a path, without loading or downloading (a Hugging
    Face id that is not in the catalog is not looked up: that would ask the hub)."""
    from octo.models.catalog import load_catalog  # (yaml and the catalog's schema: when an API call needs them)
    from octo.models.download import fetch, is_downloaded
    from octo.models.servable import looks_like_path

    base = model.rpartition(":")[0] if ":" in model.rpartition("/")[2] else model
    if "/" in base and load_catalog().get(base) is None and not looks_like_path(base):
        return "", None, None  # (decided from the name: 'org/name' is never a folder of the working folder)
    try:
        resolved = load_catalog().resolve(model, {n: c.formats for n, c in engines.items()}, bare_paths=False)
    except OctoError:
        return "", None, None
    entry = load_catalog().get(base)
    family = entry.family if entry is not None else None
    for engine, art in resolved.artifacts.items():
        if art.format == "synth" or uri_kind(art.uri) == "synth":
            return "synth", None, family
        if is_downloaded(art):
            try:
                return art.format or FORMATS.get(engine, engine), fetch(art, offline=True, progress=False), family
            except OctoError:
                continue
    return "", None, family


def _describe(engines: dict[str, Any], name: str, slot: Any = None) -> dict[str, Any]:
    """The ``details``, size, digest and GGUF metadata of a model (blocking: file system)."""
    from octo.models.formats import gguf_metadata

    fmt, path, family = _artifact_path(slot.spec.model if slot is not None else name, engines)
    meta = gguf_metadata(path) if path is not None and path.is_file() and fmt == "gguf" else {}
    h = slot.handle if slot is not None else None
    extra = dict(h.info.extra or {}) if h is not None else {}
    arch = meta.get("general.architecture") or extra.get("architecture") or family or ""
    n_params = extra.get("n_params") or meta.get("general.parameter_count")
    size = path.stat().st_size if path is not None and path.is_file() else \
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path is not None else 0
    quant = extra.get("file_type") or ""
    details = {"parent_model": "", "format": fmt or FORMATS.get(h.engine_name, h.engine_name) if h else fmt,
               "family": arch, "families": [arch] if arch else None, "parameter_size": _size_label(n_params),
               "quantization_level": quant if isinstance(quant, str) else str(quant)}
    mtime = path.stat().st_mtime if path is not None else 0.0
    return {"details": details, "size": size, "digest": _digest(name, path or "", size, mtime), "meta": meta,
            "modified_at": ollama.rfc3339(mtime or time.time()), "path": path}


@functools.lru_cache(maxsize=32)
def _template_file(path: Path, mtime: float) -> str:
    """The chat template inside a model's files (a GGUF's ``tokenizer.chat_template``, a folder's
    ``chat_template.jinja`` or ``tokenizer_config.json``), "" when there is none; cached per file version."""
    try:
        if path.is_file():
            from gguf import GGUFReader  # the llamacpp extra; reads the header lazily (memory-mapped)

            field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
            return bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else ""
        if (path / "chat_template.jinja").is_file():
            return (path / "chat_template.jinja").read_text(encoding="utf-8")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        return template if isinstance(template, str) else ""
    except (ImportError, OSError, ValueError, KeyError, IndexError):
        return ""


# What Ollama's model list holds: generation and embedding models. A speech model octo serves on /v1/audio is not
# one (front-ends such as Open WebUI would offer it as a chat model): /v1/models lists it.
OLLAMA_TASKS = frozenset({"chat", "embeddings", None})


def _row(name: str, desc: dict[str, Any]) -> dict[str, Any]:
    return {"name": tagged(name), "model": tagged(name), "modified_at": desc["modified_at"], "size": desc["size"],
            "digest": desc["digest"], "details": desc["details"]}


def _tags(engines: dict[str, Any], slots: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    from octo.runtime.loader import servable_catalog

    rows, seen = [], set()
    for shown, slot in slots:
        seen.update({slot.name, *slot.aliases})
        if (slot.handle.task if slot.handle is not None else slot.task) not in OLLAMA_TASKS:
            continue
        rows.append(_row(shown, _describe(engines, slot.name, slot)))
    for entry in servable_catalog(engines):
        if entry["id"] not in seen and entry["task"] in OLLAMA_TASKS:
            rows.append(_row(entry["id"], _describe(engines, entry["id"])))
    return rows


async def tags(request: web.Request) -> web.Response:
    registry = request.app[STATE].registry
    slots = [(public_name(s, registry), s) for s in registry.slots]
    return json_response({"models": await asyncio.to_thread(_tags, registry.engines, slots)})


async def ps(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rows = []
    for slot in state.registry.loaded():
        row = _row(public_name(slot, state.registry),
                   await asyncio.to_thread(_describe, state.registry.engines, slot.name, slot))
        expires = slot.expires_at()
        row.update(expires_at=ollama.rfc3339(expires) if expires is not None else NEVER, size_vram=0,
                   context_length=slot.handle.info.n_ctx)
        row["size"] = row["size"] or slot.estimated_bytes
        rows.append(row)
    return json_response({"models": rows})


async def _body(request: web.Request) -> ModelRequest:
    req = parse(ModelRequest, await read_json_body(request, int(request.app[STATE].config.max_body_mb * 2**20)))
    if not req.target:
        raise InvalidRequest("model is required", param="model", code="missing_required_parameter")
    return req


def _capabilities(slot: Any, template: str) -> list[str]:
    task = slot.handle.task if slot.handle is not None else slot.task
    if task == "embeddings":
        return ["embedding"]
    if task != "chat":
        return []
    caps = ["completion", "tools"]  # octo serves tools on every chat model (in the template or the system prompt)
    if slot.handle is not None and getattr(slot.handle.info, "takes_images", False):  # (known once loaded)
        caps.append("vision")
    if "enable_thinking" in template or "<think>" in template:  # as octo.text.reasoning.supports_thinking reads it
        caps.append("thinking")
    return caps


async def show(request: web.Request) -> web.Response:
    req = await _body(request)
    name = ollama.model_name(req.target)
    state = request.app[STATE]
    slot = await state.registry.route(name)
    desc = await asyncio.to_thread(_describe, state.registry.engines, slot.name, slot)
    engine = getattr(slot.handle, "engine", None)  # in the gateway (--isolation thread): the engine's own template
    path = desc["path"]
    template = template_source(engine) if engine is not None else \
        await asyncio.to_thread(_template_file, path, path.stat().st_mtime) if path is not None else ""
    info = {k: v for k, v in desc["meta"].items() if not k.startswith("tokenizer.")}
    family = desc["details"]["family"]
    if slot.handle is not None and family:
        info.setdefault("general.architecture", family)
        info.setdefault(f"{family}.context_length", slot.handle.info.n_ctx)
    source = tagged(public_name(slot, state.registry))  # a name, never a path on the server
    return json_response({"modelfile": f"# Modelfile generated by octo\nFROM {source}\n", "parameters": "",
                          "template": template, "details": desc["details"], "model_info": info,
                          "capabilities": _capabilities(slot, template), "modified_at": desc["modified_at"]})


# -- pull and delete --------------------------------------------------------------------------------------------
PULLING: set[str] = set()  # canonical names this server is pulling now (deleting one of them is refused: 409)


def _busy(message: str) -> InvalidRequest:
    err = InvalidRequest(message, param="model", code="model_busy")
    err.status = 409
    return err


async def pull(request: web.Request) -> web.StreamResponse:
    """Catalog names only; a Hugging Face id with the operator's --allow-pull-hf, within --max-pull-gb (checked
    against the hub's metadata before the stream starts, and while downloading); recorded (octo.models.pulled)."""
    from octo.models import pulling
    from octo.models.servable import unknown_model

    req = await _body(request)
    state = request.app[STATE]
    config = state.config
    name = ollama.model_name(req.target)
    plan = await asyncio.to_thread(pulling.plan, name, state.registry.engines, config.allow_pull_hf,
                                   lambda n: unknown_model(n, config.models_dirs))  # 404/403 before any stream byte
    cap = int(config.max_pull_gb * pulling.GB) if plan.hub_id else 0
    if plan.hub_id:
        await asyncio.to_thread(pulling.check_size, plan.artifacts, cap)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    last: dict[str, float] = {}

    def report(file: str, total: int, done: int) -> None:  # huggingface_hub's threads
        now = time.monotonic()
        if done < total and now - last.get(file, 0.0) < 0.1:
            return
        last[file] = now
        shown = file.rsplit("/", 1)[-1]  # huggingface_hub's bar names the URL, shortened with "(…)": its file name
        loop.call_soon_threadsafe(queue.put_nowait, {"status": f"pulling {shown}", "digest": shown, "total": total,
                                                     "completed": min(done, total) if total else done})

    budget = pulling.Budget(cap)

    def work() -> None:
        for art in plan.artifacts:
            pulling.fetch_recorded(plan.name, art, progress=pulling.progress_class(report, budget), max_bytes=cap)

    PULLING.add(plan.name.lower())
    job = loop.run_in_executor(None, work)
    job.add_done_callback(lambda _: PULLING.discard(plan.name.lower()))
    return await _stream_pull(request, req, job, queue)


async def _stream_pull(request: web.Request, req: ModelRequest, job: asyncio.Future,
                       queue: asyncio.Queue) -> web.StreamResponse:
    resp = None
    if req.stream is not False:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await start_stream(request, resp)
        await resp.write(dumps({"status": "pulling manifest"}) + b"\n")
    while not job.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            continue
        if resp is not None:
            await resp.write(dumps(getter.result()) + b"\n")
    try:
        job.result()
    except OctoError as exc:
        if resp is None:
            raise
        await resp.write(dumps({"error": exc.message}) + b"\n")
        return resp
    if resp is None:
        return json_response({"status": "success"})
    await resp.write(b"".join(dumps({"status": s}) + b"\n" for s in ("verifying sha256 digest", "writing manifest",
                                                                       "success")))
    return resp


async def delete(request: web.Request) -> web.Response:
    """Deletes what octo pulled (the record of pulls), by the names /api/tags lists; everything is checked (pulled,
    not being pulled, not a start-up model, no request in flight) before anything is unloaded or deleted, so a
    refused delete changes nothing. Never by path: a name that octo did not pull is the same 404 however it reads."""
    from octo.models import pulled, pulling

    req = await _body(request)
    registry = request.app[STATE].registry
    name = ollama.model_name(req.target)
    found = await asyncio.to_thread(pulling.canonical, name)
    record = await asyncio.to_thread(pulled.find, found[0]) if found is not None else None
    slot = registry.find(name) or (registry.find(found[0]) if found is not None else None)
    if record is None:
        if slot is not None or await asyncio.to_thread(pulling.on_disk, name):  # listed here, not pulled by octo
            raise InvalidRequest(f"'{req.target}' was not pulled by octo, so octo does not delete it (it deletes "
                                 "only what `octo pull` or /api/pull downloaded).", param="model",
                                 code="model_not_pulled")
        raise NotFound(f"model '{req.target}' not found: octo deletes only the models it pulled", param="model",
                       code="model_not_found")
    if record.name.lower() in PULLING:
        raise _busy(f"'{req.target}' is being pulled; delete it when the pull is done.")
    if slot is not None and slot.spec.declared:
        raise _busy(f"'{req.target}' is served as a model named at start; it is not deleted while the server runs.")
    if slot is not None and (slot.inflight or slot.loading is not None):
        raise _busy(f"'{req.target}' has requests in flight or is loading; delete it when they are done.")
    if slot is not None and slot.handle is not None:
        await registry.unload(slot.name)  # (checks again: a request that came meanwhile makes it a 409, nothing done)
    failed = await asyncio.to_thread(pulled.delete_files, record)
    await asyncio.to_thread(pulled.forget, record.name, failed)
    if slot is not None:
        registry.forget(slot)  # (no longer listed: its files are gone)
    if failed:
        raise OctoError(f"'{req.target}': {len(failed)} of its files could not be deleted (see the server's log).")
    return web.Response(status=200)


async def _refuse(request: web.Request) -> web.Response:
    what = {"/api/create": "creating models from a Modelfile", "/api/push": "pushing models to a registry",
            "/api/copy": "copying models", "/api/blobs": "uploading blobs"}
    key = next((k for k in what if request.path.startswith(k)), request.path)
    err = InvalidRequest(f"octo does not support {what.get(key, key)}: octo serves catalog models, local files and "
                         "Hugging Face ids (see `octo models`, `octo pull`)", code="unsupported_endpoint")
    raise err


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/api/tags", tags)
    router.add_get("/api/ps", ps)
    router.add_post("/api/show", show)
    router.add_post("/api/pull", pull)
    router.add_delete("/api/delete", delete)
    for path in ("/api/create", "/api/push", "/api/copy"):
        router.add_post(path, _refuse)
    router.add_route("*", "/api/blobs/{digest}", _refuse)
