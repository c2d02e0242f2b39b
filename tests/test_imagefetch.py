"""Remote image URLs (octo.server.imagefetch): off unless the operator names hosts (``--allow-image-urls``); never an
address that is not public, checked on the address each connection goes to (a name that resolves to loopback, an IP
literal, a redirect's target); the size and the time bounded. Every fetch here goes to a server of the test on
loopback: the server's own check refuses it (loopback is never fetched), so the fetches that must succeed use an
``ImageFetcher`` given a check that lets the test server's address through (``address_ok``, the seam for tests
documented in the module); nothing is ever sent to an address that is not loopback."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from aiohttp import web
from test_vision_apis import BLUE, MODEL, RED, make_app, post, word

from octo.errors import InvalidRequest
from octo.server import imagefetch
from octo.server.imagefetch import ImageFetcher, public_address

LOOPBACK = ipaddress.ip_address("127.0.0.1")


def only_loopback(ip) -> bool:  # the tests' check: their own server's address, nothing else
    return ip == LOOPBACK


@pytest.mark.parametrize("address, public", [
    ("127.0.0.1", False), ("127.8.9.10", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.251", False),
    ("255.255.255.255", False), ("240.0.0.1", False), ("192.0.2.1", False), ("198.18.0.1", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False), ("2002:a00:1::", False),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),  # Teredo, whose client is 127.0.0.1
    ("64:ff9b::a00:1", False), ("64:ff9b::7f00:1", False),
    ("93.184.215.14", True), ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True), ("2002:5db8:d70e::", True),
])
def test_public_addresses_only(address, public):
    assert public_address(ipaddress.ip_address(address)) is public


def test_the_allow_list():
    f = ImageFetcher(("images.example.com", "*.cdn.example", "Upper.Example."), 1, 1)
    assert f.allows("images.example.com") and f.allows("IMAGES.example.com.") and f.allows("upper.example")
    assert f.allows("a.cdn.example") and f.allows("a.b.cdn.example") and not f.allows("cdn.example")
    assert not f.allows("example.com") and not f.allows("images.example.com.evil.net")
    assert ImageFetcher(("*",), 1, 1).allows("anything.at.all")


@pytest.fixture
async def images(aiohttp_server):
    """An image server on loopback; ``hits`` counts the requests it got."""
    hits: list[str] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        name = request.match_info["name"]
        if name == "red.png":
            return web.Response(body=RED, content_type="image/png")
        if name == "blue.png":
            return web.Response(body=BLUE, content_type="image/png")
        if name.startswith("to-"):  # a redirect: /to-HOST:PORT/name or /to-/name (same server)
            target = request.query["url"]
            raise web.HTTPFound(target)
        if name == "huge":  # announced
            return web.Response(body=b"x" * 5000, content_type="image/png")
        if name == "stream":  # not announced: chunked, more than the cap
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(100):
                await resp.write(b"y" * 1000)
            await resp.write_eof()
            return resp
        if name == "slow":
            await asyncio.sleep(3)
            return web.Response(body=RED, content_type="image/png")
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{name}", serve)
    server = await aiohttp_server(app, host="127.0.0.1")
    server.hits = hits
    return server


async def refused(fetcher: ImageFetcher, url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        await fetcher.fetch(url, "messages[0].content[1]")
    assert err.value.param == "messages[0].content[1]"
    return err.value


async def test_loopback_is_never_fetched_even_when_allowed_by_name(images):
    f = ImageFetcher(("127.0.0.1", "localhost"), 10**6, 5)  # the server's own check
    try:
        for host in ("127.0.0.1", "localhost"):  # an IP literal; a name that resolves to loopback
            err = await refused(f, f"http://{host}:{images.port}/red.png")
            assert err.code == "image_url_refused" and "not a public address" in err.message, err.message
        assert images.hits == []  # no connection was made
    finally:
        await f.close()


async def test_only_allowed_hosts_on_every_hop(images):
    f = ImageFetcher(("127.0.0.1", "127.0.0.2"), 10**6, 5, address_ok=only_loopback)
    base = f"http://127.0.0.1:{images.port}"
    try:
        assert await f.fetch(f"{base}/red.png", "p") == (RED, "image/png")
        assert (await f.fetch(f"{base}/to-same?url={base}/blue.png", "p"))[0] == BLUE
        err = await refused(f, "http://evil.example/red.png")  # (refused before any lookup)
        assert err.code == "image_url_not_allowed" and "'evil.example'" in err.message
        err = await refused(f, f"{base}/to-evil?url=http://evil.example/red.png")
        assert err.code == "image_url_not_allowed"
        # allowed by name, but its address is not one the check lets through: refused when it would connect
        err = await refused(f, f"{base}/to-other?url=http://127.0.0.2:{images.port}/red.png")
        assert err.code == "image_url_refused" and "127.0.0.2" in err.message
        for bad in ("ftp://127.0.0.1/x.png", f"http://user:pw@127.0.0.1:{images.port}/red.png"):
            assert (await refused(f, bad)).code == "invalid_image_url"
        assert images.hits.count("/red.png") == 1 and "/to-other" in images.hits
    finally:
        await f.close()


async def test_the_check_sees_the_address_connected_to(images):
    seen = []

    def check(ip) -> bool:
        seen.append(ip)
        return ip == LOOPBACK

    f = ImageFetcher(("localhost",), 10**6, 5, address_ok=check)
    try:  # "localhost" resolves (to ::1 and 127.0.0.1): each address is checked as it is connected to
        assert (await f.fetch(f"http://localhost:{images.port}/red.png", "p"))[0] == RED
        assert LOOPBACK in seen and all(ip.is_loopback for ip in seen)
    finally:
        await f.close()


async def test_size_time_and_status_are_bounded(images):
    f = ImageFetcher(("127.0.0.1",), 4000, 0.5, address_ok=only_loopback)
    base = f"http://127.0.0.1:{images.port}"
    try:
        for path in ("/huge", "/stream"):  # announced, and counted while reading
            err = await refused(f, base + path)
            assert err.code == "image_too_large" and "--max-image-mb" in err.message, (path, err.message)
        err = await refused(f, base + "/slow")
        assert err.code == "image_url_fetch_failed" and "--image-url-timeout" in err.message
        err = await refused(f, base + "/missing.png")
        assert err.code == "image_url_fetch_failed" and "HTTP 404" in err.message
    finally:
        await f.close()


# -- through the server's routes (in process: the picture engine of tests/test_vision_apis.py) ------------------------
@pytest.fixture
async def served(aiohttp_client, tmp_path, monkeypatch, images):
    """The picture model's server with --allow-image-urls 127.0.0.1, its fetcher given the tests' check."""
    app = make_app(tmp_path, monkeypatch, allow_image_urls=("127.0.0.1",))
    fetcher = ImageFetcher(("127.0.0.1",), 10**6, 5, address_ok=only_loopback)
    app[imagefetch.FETCHER] = fetcher
    client = await aiohttp_client(app)
    yield client, f"http://127.0.0.1:{images.port}"
    await fetcher.close()


async def test_fetched_images_on_every_api(served, images):
    client, base = served
    out = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "two"}, {"type": "image_url", "image_url": {"url": f"{base}/red.png"}},
        {"type": "image_url", "image_url": {"url": f"{base}/blue.png"}}]}]})
    assert out["choices"][0]["message"]["content"] == f"two {word(RED)} {word(BLUE)}"
    out = await post(client, "/v1/messages", {"max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": f"{base}/blue.png"}}, {"type": "text", "text": "?"}]}]})
    assert out["content"][0]["text"] == f"{word(BLUE)}?"
    out = await post(client, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": f"{base}/red.png", "detail": "auto"}]}]})
    assert out["output"][0]["content"][0]["text"] == word(RED)
    items = await client.get(f"/v1/responses/{out['id']}/input_items?include=message.input_image.image_url")
    stored = (await items.json())["data"][0]["content"][0]["image_url"]
    assert stored.startswith("data:image/png;base64,")  # the conversation keeps what the model saw
    err = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "http://evil.example/a.png"}}]}]},
        400)
    assert err["error"]["param"] == "messages[0].content[1]" and err["error"]["code"] == "image_url_not_allowed"


async def test_the_servers_own_check_and_a_text_only_model_fetch_nothing(aiohttp_client, tmp_path, monkeypatch,
                                                                          images):
    from octo.engines.echo import EchoEngine

    from octo.engine import EngineConfig

    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{images.port}/red.png"}}]}]}
    client = await aiohttp_client(make_app(tmp_path, monkeypatch, allow_image_urls=("127.0.0.1",)))
    err = await post(client, "/v1/chat/completions", body, 400)
    assert err["error"]["code"] == "image_url_refused" and err["error"]["param"] == "messages[0].content[0]"
    text_only = await aiohttp_client(make_app(tmp_path, monkeypatch, EchoEngine(EngineConfig()),
                                              allow_image_urls=("127.0.0.1",)))
    err = await post(text_only, "/v1/chat/completions", body, 400)
    assert err["error"]["code"] == "model_not_multimodal" and f"'{MODEL}'" in err["error"]["message"]
    assert images.hits == []
