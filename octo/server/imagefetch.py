"""Remote image URLs, fetched by the gateway from the hosts the operator allows (``--allow-image-urls``).

A server that fetches what a request names is an SSRF surface, so this is off by default (a remote URL is a 400 that
names the flag: ``octo.serving.media.remote_refused``) and bounded when on:

- only the hosts listed (``images.example.com``; ``*.example.com`` for its subdomains; ``*`` for any host), on every
  hop of a redirect (at most :data:`MAX_REDIRECTS`), over http or https, a URL without credentials;
- never an address that is not public (:func:`public_address`): loopback, private, link-local, shared (CGNAT),
  multicast, reserved and unspecified addresses, also inside IPv4-mapped, 6to4, Teredo and NAT64 addresses. The
  check runs on the address each connection is about to connect to (the connector's socket factory), after the name
  was resolved, so a name that resolves to a public address once and to a private one later (DNS rebinding) never
  reaches the private one, and an IP literal or a redirect is checked the same way;
- ``--max-image-mb``: from ``Content-Length``, and while reading (the download stops there); no compressed transfer
  encodings (``Accept-Encoding: identity``), so what is read is what is counted;
- ``--image-url-timeout`` for the whole fetch, redirects included;
- no proxy from the environment (it would connect for the server, past the check), no cookies.

The gateway fetches because aiohttp lives here and the workers stay offline; a fetched image goes on to the worker as
a data URL, where it is checked as any other (``octo.serving.media``). The images of one request are fetched at once.

``ImageFetcher(address_ok=...)`` takes another address check: tests serve images on loopback and pass one that lets
their own port's loopback address through (tests/test_imagefetch.py). The server always uses :func:`public_address`.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from octo.errors import InvalidRequest
from octo.server.state import STATE
from octo.serving import media
from octo.serving.media import ImageRef

MAX_REDIRECTS = 5
CHUNK = 64 * 1024
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REFUSED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("octo_refused_addresses", default=None)
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def public_address(ip: Address) -> bool:
    """Whether ``ip`` is an address of the public Internet (and so is every IPv4 address it carries)."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None) or \
            (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        if inner is not None and not public_address(inner):
            return False
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


class RefusedAddress(OSError):
    """A connection to an address that is not public, stopped before it was made."""


class ImageFetcher:
    """Fetches image URLs from the allowed ``hosts``, ``max_bytes`` at most each, within ``timeout_s``."""

    def __init__(self, hosts: tuple[str, ...], max_bytes: int, timeout_s: float,
                 address_ok: Callable[[Address], bool] = public_address) -> None:
        self.hosts = tuple(h.strip().lower().rstrip(".") for h in hosts if h.strip())
        self.max_bytes, self.timeout_s, self.address_ok = max_bytes, timeout_s, address_ok
        self._session: aiohttp.ClientSession | None = None

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(h == "*" or h == host or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)

    def _socket(self, addr_info: Any) -> socket.socket:
        """The connector's socket factory: the address about to be connected to, checked."""
        family, type_, proto, _, sockaddr = addr_info
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if not self.address_ok(ip):
            refused = _REFUSED.get()
            if refused is not None:
                refused.append(str(ip))
            raise RefusedAddress(f"{ip} is not a public address")
        return socket.socket(family, type_, proto)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(socket_factory=self._socket, use_dns_cache=False, limit=16)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, url: str, param: str) -> tuple[bytes, str]:
        """The bytes of the image at ``url`` and their content type; a 400 naming ``param`` when it may not be
        fetched or could not be."""
        refused: list[str] = []
        token = _REFUSED.set(refused)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._follow(URL(url), param)
        except TimeoutError:
            raise _failed(param, f"it took more than {self.timeout_s:g} s (--image-url-timeout)") from None
        except aiohttp.ClientError as exc:
            if refused:
                raise InvalidRequest(f"The image URL's host resolves to {refused[0]}, which is not a public address: "
                                     "this server never fetches from loopback, private, link-local or reserved "
                                     "addresses.", param=param, code="image_url_refused") from None
            raise _failed(param, f"{type(exc).__name__}: {exc}") from None
        finally:
            _REFUSED.reset(token)

    async def _follow(self, url: URL, param: str) -> tuple[bytes, str]:
        for _ in range(MAX_REDIRECTS + 1):
            self._check(url, param)
            async with self.session().get(url, allow_redirects=False, headers={
                    "Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "octo"}) as resp:
                if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                    url = url.join(URL(resp.headers["Location"]))
                    continue
                if resp.status != 200:
                    raise _failed(param, f"it answered HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > self.max_bytes:
                    raise _too_big(resp.content_length, param, self.max_bytes)
                data = bytearray()
                async for chunk in resp.content.iter_chunked(CHUNK):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise _too_big(len(data), param, self.max_bytes)
                return bytes(data), resp.content_type
        raise _failed(param, f"it redirected more than {MAX_REDIRECTS} times")

    def _check(self, url: URL, param: str) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise InvalidRequest("Invalid image URL: only http and https URLs with a host are fetched.", param=param,
                                 code="invalid_image_url")
        if url.user is not None or url.password is not None:
            raise InvalidRequest("Invalid image URL: a URL with credentials is not fetched.", param=param,
                                 code="invalid_image_url")
        if not self.allows(url.host):
            raise InvalidRequest(f"Images are fetched only from the hosts of --allow-image-urls, and "
                                 f"{url.host[:200]!r} is not one of them.", param=param, code="image_url_not_allowed")

    async def fetch_all(self, refs: list[ImageRef]) -> None:
        """Fetch the remote images of ``refs`` at once; each becomes a data URL in the request (``ref.replace``)."""
        tasks = [asyncio.ensure_future(self.fetch(r.url, r.param)) for r in refs]
        try:
            fetched = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        loop = asyncio.get_running_loop()
        for ref, (data, ctype) in zip(refs, fetched, strict=True):
            b64 = await loop.run_in_executor(None, base64.b64encode, data) if len(data) > 2**20 else \
                base64.b64encode(data)
            mime = ctype if ctype.startswith("image/") else ""
            ref.replace(media.base64_url(b64.decode("ascii"), mime))


def _failed(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"The image URL could not be fetched: {why}.", param=param, code="image_url_fetch_failed")


def _too_big(n: int, param: str, max_bytes: int) -> InvalidRequest:
    return InvalidRequest(f"The image at the URL has more than {max_bytes / 2**20:g} MiB ({n / 2**20:.1f} MiB "
                          "read or announced; --max-image-mb).", param=param, code="image_too_large")


FETCHER = web.AppKey("octo_image_fetcher", ImageFetcher)


def setup(app: web.Application, config: Any) -> None:
    """An :class:`ImageFetcher` for ``--allow-image-urls`` (none without), closed with the app."""
    if not config.allow_image_urls:
        return
    fetcher = ImageFetcher(config.allow_image_urls, int(config.max_image_mb * 2**20), config.image_url_timeout)
    app[FETCHER] = fetcher

    async def close(app: web.Application) -> None:
        await fetcher.close()

    app.on_cleanup.append(close)


async def fetch_remote(request: web.Request, handle: Any, refs: list[ImageRef]) -> None:
    """Before a request goes to its model: fetch its remote images, when the model takes images and the request is
    within ``--max-images`` (otherwise the model refuses it, and nothing is fetched); a 400 naming
    ``--allow-image-urls`` when the server fetches none."""
    remote = [r for r in refs if r.remote]
    if not remote or not getattr(handle.info, "takes_images", False):
        return
    if len(refs) > request.app[STATE].config.max_images:
        return
    fetcher = request.app.get(FETCHER)
    if fetcher is None:
        raise media.remote_refused(remote[0].param)
    await fetcher.fetch_all(remote)
