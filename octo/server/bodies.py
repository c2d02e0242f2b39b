"""Request bodies read with bounds: size, compression, content type, and time between chunks.

The server turns aiohttp's automatic decompression off (``auto_decompress=False`` in ``create_app``): aiohttp's
``client_max_size`` counts the bytes after its own decompression only once they are all in memory, and its
decompressor runs on past the limit. Here a compressed body is inflated in bounded steps
(``zlib.decompressobj().decompress(data, max_length)``), and reading stops at the body limit: 413 with no more
CPU or memory spent on the rest (aiohttp then discards the unread raw bytes for a few seconds, undecoded).
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from octo.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

MB = 2**20
BODY_IDLE_TIMEOUT = 30.0  # seconds a request body may stall between two chunks (408 after)
_STEP = MB  # most output of one decompression step
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
SUPPORTED_ENCODINGS = "identity, gzip, deflate"
BODY_KEY = web.RequestKey("octo_body", bytes)  # the JSON body as read (octo.server.app logs a refused one at DEBUG)


def content_encoding(request: web.Request, *, allow_compressed: bool = True) -> str:
    """The body's one content coding ("identity" when none); 415 for one octo cannot decode."""
    if "Content-Encoding" not in request.headers:  # (most requests)
        return "identity"
    codings = [c.strip().lower() for c in request.headers.getall("Content-Encoding", []) for c in c.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return "identity"
    if len(codings) > 1 or codings[0] not in _DECODERS or not allow_compressed:
        accepted = SUPPORTED_ENCODINGS if allow_compressed else "identity (an uncompressed body)"
        raise UnsupportedMediaType(f"Content-Encoding '{', '.join(codings)}' is not supported here; use {accepted}.")
    return codings[0]


def check_json_content_type(request: web.Request) -> None:
    """JSON endpoints take ``application/json`` (or ``application/*+json``): 415 for anything else, a missing
    Content-Type included. This keeps web pages from posting to a local server without a CORS preflight: a browser
    sends text/plain, form types and no type at all (a ``mode: "no-cors"`` fetch of a Blob) cross-origin unasked,
    application/json only after a preflight, which only --cors-origins answers."""
    given = request.headers.get("Content-Type")
    if given is None:
        raise UnsupportedMediaType("Content-Type must be application/json; the request has none.")
    mime = request.content_type.lower()
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got '{given}'.")


async def read_json_body(request: web.Request, limit: int) -> bytes:
    """The body of a JSON endpoint: content type checked, decompressed when it says so, at most ``limit`` bytes
    (kept on the request under ``BODY_KEY``: a refused request's body is logged at DEBUG)."""
    check_json_content_type(request)
    body = await read_body(request, limit)
    request[BODY_KEY] = body
    return body


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, decoded from its Content-Encoding, at most ``limit`` bytes before and after decoding (413)."""
    coding = content_encoding(request)
    length = request.content_length  # (a property that parses the header)
    if length is not None and length > limit:
        raise _too_large(limit)
    stream = request.content
    if coding == "identity" and stream.is_eof():  # the whole body came in with the headers (most requests)
        try:
            body = stream.read_nowait()
        except HttpProcessingError as exc:
            raise InvalidRequest(f"The request body is malformed or incomplete: {exc.message}") from None
        if len(body) > limit:
            raise _too_large(limit)
        return body
    inflater = zlib.decompressobj(_DECODERS[coding]) if coding != "identity" else None
    out = bytearray()
    raw = 0
    try:
        while True:
            try:
                async with asyncio.timeout(BODY_IDLE_TIMEOUT):
                    chunk = await stream.readany()
            except TimeoutError:
                raise RequestTimeout(f"The request body stalled for more than {BODY_IDLE_TIMEOUT:g} s.") from None
            if not chunk:
                break
            raw += len(chunk)
            if raw > limit:
                raise _too_large(limit)
            if inflater is None:
                out += chunk
                continue
            data = chunk
            while data:
                if inflater.eof:
                    raise InvalidRequest(f"The body has data after the end of its {coding} stream.")
                out += inflater.decompress(data, min(_STEP, limit + 1 - len(out)))
                if len(out) > limit:
                    raise _too_large(limit, coding)
                if inflater.unused_data:
                    raise InvalidRequest(f"The body has data after the end of its {coding} stream.")
                data = inflater.unconsumed_tail
    except zlib.error as exc:
        raise InvalidRequest(f"The body is not valid {coding} data (Content-Encoding: {coding}): {exc}.") from None
    except HttpProcessingError as exc:  # a body shorter than its Content-Length, broken chunked encoding
        raise InvalidRequest(f"The request body is malformed or incomplete: {exc.message}") from None
    if inflater is not None and not inflater.eof:
        raise InvalidRequest(f"The body is not valid {coding} data (Content-Encoding: {coding}): it is truncated.")
    return bytes(out)


def _too_large(limit: int, coding: str | None = None) -> PayloadTooLarge:
    after = f" once decompressed ({coding})" if coding else ""
    return PayloadTooLarge(f"The request body is larger than the limit of {limit / MB:g} MB{after} (--max-body-mb).")
