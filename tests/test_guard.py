"""The way in (octo.server.guard): every route is behind it, with no middleware chain; where a plugin adds middlewares
its checks still come first, and what a plugin's route streams is stamped too."""

from __future__ import annotations

import pytest
from aiohttp import web

from octo.hookspecs import hookimpl

KEY = "sk-guard"


def _app(tmp_path, monkeypatch, plugin=None, **config):
    from octo.engines.echo import EchoEngine

    from octo.config import ServerConfig
    from octo.engine import EngineConfig
    from octo.plugins import load_plugins
    from octo.runtime.model import ModelHandle
    from octo.server.app import create_app

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    engine = EchoEngine(EngineConfig())
    engine.load("bench", "bench")
    pm = None
    if plugin is not None:
        pm = load_plugins(None)
        pm.register(plugin)
    return create_app(ServerConfig(model="bench", **config), ModelHandle("bench", (), "echo", engine, "x"),
                      plugin_manager=pm)


def _paths(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route, a dynamic part filled in."""
    out = []
    for resource in app.router.resources():
        path = resource.canonical.replace("{name}", "bench").replace("{file}", "x.js")
        path = path.replace("{response_id}", "resp_1").replace("{id}", "x")
        for route in resource:
            if route.method != "HEAD":
                out.append(("GET" if route.method == "*" else route.method, path))
    return out


def test_no_middleware_chain_and_every_route_guarded(tmp_path, monkeypatch):
    app = _app(tmp_path, monkeypatch)
    assert not app.middlewares and not app.on_response_prepare
    unguarded = [(r.method, r.resource.canonical) for r in app.router.routes()
                 if getattr(r.handler, "octo_route", None) is None]
    assert not unguarded, unguarded


async def test_every_route_refuses_a_foreign_host_and_a_missing_key(aiohttp_client, tmp_path, monkeypatch):
    from octo.server.routes.dashboard import is_public

    app = _app(tmp_path, monkeypatch, api_key=KEY)
    client = await aiohttp_client(app)
    paths = _paths(app)
    assert len(paths) > 40  # (the routes were found)
    for method, path in paths:
        r = await client.request(method, path, headers={"Host": "attacker.example"})
        assert r.status == 403, (method, path, r.status)
        assert "error" in await r.json(), (method, path)
        assert r.headers["X-Request-Id"]
    for method, path in paths:
        if path == "/health" or is_public(path):  # open: load balancers' probe; the dashboard page and its files
            continue
        r = await client.request(method, path, json={})
        assert r.status == 401, (method, path, r.status)
        assert "error" in await r.json(), (method, path)


async def test_404_405_and_options_anywhere_in_the_api_shape(aiohttp_client, tmp_path, monkeypatch):
    client = await aiohttp_client(_app(tmp_path, monkeypatch))
    r = await client.get("/v1/no/such/thing")
    assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
    r = await client.get("/v1/chat/completions")
    assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    for path in ("/v1/chat/completions", "/no/such/thing", "/api/chat"):
        r = await client.options(path)
        assert r.status == 204 and r.headers["X-Request-Id"], path


async def test_a_request_target_without_a_slash_is_answered_too(aiohttp_client, tmp_path, monkeypatch):
    import asyncio

    client = await aiohttp_client(_app(tmp_path, monkeypatch))
    for line, want in ((b"OPTIONS * HTTP/1.1", b" 204 "),):  # (only OPTIONS may name "*": aiohttp's 400 otherwise)
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
        head, _, _ = raw.partition(b"\r\n\r\n")
        assert want in head.split(b"\r\n")[0], raw
        assert b"X-Request-Id" in head


async def test_streams_and_answers_carry_the_request_id(aiohttp_client, tmp_path, monkeypatch):
    client = await aiohttp_client(_app(tmp_path, monkeypatch))
    chat = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                       ("/api/chat", {**chat, "stream": True}), ("/v1/responses", {"model": "bench", "input": "hi",
                                                                                     "stream": True})):
        r = await client.post(path, json=body, headers={"X-Request-Id": "req-mine"})
        await r.read()
        assert r.status == 200 and r.headers["X-Request-Id"] == "req-mine", path
        assert r.headers.getall("X-Request-Id") == ["req-mine"], path  # stamped once


class _Plugin:
    """A plugin with a middleware and a streaming route."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl
    def register_routes(self, app: web.Application) -> None:
        @web.middleware
        async def record(request: web.Request, handler):
            self.seen.append(request.path)
            return await handler(request)

        app.middlewares.append(record)
        app.router.add_get("/plugin/tail", _tail)


@pytest.mark.parametrize("with_middleware", [True, False])
async def test_a_plugins_middleware_runs_after_the_checks_and_its_streams_are_stamped(
        aiohttp_client, tmp_path, monkeypatch, with_middleware):
    plugin = _Plugin()
    if not with_middleware:
        plugin.register_routes = hookimpl(lambda app: app.router.add_get("/plugin/tail", _tail))
    client = await aiohttp_client(_app(tmp_path, monkeypatch, plugin=plugin, api_key=KEY))
    r = await client.get("/plugin/tail")
    assert r.status == 401 and plugin.seen == []  # refused before the plugin's code
    r = await client.get("/plugin/tail", headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-p"})
    assert r.status == 200 and await r.read() == b"x" and r.headers["X-Request-Id"] == "req-p"
    assert plugin.seen == (["/plugin/tail"] if with_middleware else [])
    r = await client.get("/v1/models", headers={"Host": "attacker.example"})
    assert r.status == 403


async def _tail(request: web.Request) -> web.StreamResponse:
    """A plugin's route that streams (it prepares its response itself)."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"x")
    return resp


class _Breaking:
    """A plugin whose routes meet a connection error: one after its client's connection closed (the client left
    while its answer was written), one while the connection is open (a fault of the server's)."""

    @hookimpl
    def register_routes(self, app: web.Application) -> None:
        async def left(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"first")
            request.transport.close()  # as when the client's close is seen before the handler is cancelled
            await resp.write(b"second")  # aiohttp raises ClientConnectionResetError
            return resp

        async def broken(request: web.Request) -> web.Response:
            raise ConnectionResetError("an upstream connection of the server's own")

        app.router.add_get("/plugin/left", left)
        app.router.add_get("/plugin/broken", broken)


async def test_a_client_that_left_mid_stream_ends_it_quietly(aiohttp_client, tmp_path, monkeypatch, caplog):
    """A write to a connection its client closed is the client's leaving, not an error: no traceback in the log
    (aiohttp logs one for any exception a handler raises), counted as 499; a connection error of the server's own
    while the client is still there is an ordinary 500 in the API's shape, logged."""
    import aiohttp

    app = _app(tmp_path, monkeypatch, plugin=_Breaking())
    client = await aiohttp_client(app)
    caplog.set_level("DEBUG")
    with pytest.raises(aiohttp.ClientPayloadError):
        r = await client.get("/plugin/left")
        await r.read()
    r = await client.get("/plugin/broken")
    assert r.status == 500 and (await r.json())["error"]["type"] == "server_error"
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert [rec.getMessage() for rec in errors] == ["unhandled error on GET /plugin/broken"], errors
    assert any("the client closed the connection" in rec.getMessage() for rec in caplog.records)
