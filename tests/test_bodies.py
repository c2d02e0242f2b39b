"""octo/bodies.py in-process: compressed bodies inflate in bounded steps, stop at the limit, and stall with a 408."""

import gzip
import json
import time
import zlib

import pytest


def _request(headers: dict[str, str], chunks: list[bytes], eof: bool = True):
    import asyncio
    from unittest import mock

    from aiohttp import streams
    from aiohttp.test_utils import make_mocked_request

    payload = streams.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    for c in chunks:
        payload.feed_data(c)
    if eof:
        payload.feed_eof()
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers, payload=payload)


async def test_bodies_inflate_in_bounded_steps():
    from octo.errors import InvalidRequest, PayloadTooLarge
    from octo.server import bodies

    data = json.dumps({"x": "y" * 5000}).encode()
    packed = gzip.compress(data)
    chunks = [packed[i:i + 7] for i in range(0, len(packed), 7)]
    assert await bodies.read_body(_request({"Content-Encoding": "gzip"}, chunks), 10_000) == data
    with pytest.raises(PayloadTooLarge, match="once decompressed"):
        await bodies.read_body(_request({"Content-Encoding": "gzip"}, [packed]), 4_000)
    with pytest.raises(PayloadTooLarge):  # the raw bytes count too
        await bodies.read_body(_request({}, [data]), 4_000)
    deflated = zlib.compress(data)
    assert await bodies.read_body(_request({"Content-Encoding": "Deflate"}, [deflated]), 10_000) == data
    with pytest.raises(InvalidRequest, match="after the end"):
        await bodies.read_body(_request({"Content-Encoding": "gzip"}, [packed, b"x"]), 10_000)
    with pytest.raises(InvalidRequest, match="truncated"):
        await bodies.read_body(_request({"Content-Encoding": "gzip"}, [packed[:20]]), 10_000)
    with pytest.raises(bodies.UnsupportedMediaType):
        await bodies.read_body(_request({"Content-Encoding": "zstd"}, [data]), 10_000)
    assert await bodies.read_body(_request({"Content-Encoding": "identity"}, [data]), 10_000) == data


async def test_a_stalled_body_is_408(monkeypatch):
    from octo.server import bodies

    monkeypatch.setattr(bodies, "BODY_IDLE_TIMEOUT", 0.2)
    t0 = time.monotonic()
    with pytest.raises(bodies.RequestTimeout):
        await bodies.read_body(_request({}, [b'{"a": '], eof=False), 10_000)
    assert time.monotonic() - t0 < 2
