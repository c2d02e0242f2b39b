"""Messages between the gateway and its engine workers: pickled objects, each framed by its 4-byte length.

Two Unix socket pairs join the gateway and a worker: "down" (gateway -> worker: requests, cancellations, calls),
read by the worker's event loop, and "up" (worker -> gateway: one message per engine step with every sequence's
new text, and replies), written with blocking sends from the worker's engine thread and event loop and read by
the gateway's event loop. Pickle (protocol 5) is the encoder: it carries the protocol requests, results, numpy
audio and OctoError exceptions without a schema to keep in step, and both ends are the same octo install.
A socket that reaches EOF means the other side is gone: the gateway fails that worker's requests, a worker exits.
A worker's heartbeat thread sends ``HEARTBEAT`` up every few hundred milliseconds (``start_heartbeat``): the
gateway judges liveness by what it hears (``octo.runtime.supervision``).
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

_HEADER = 4
HEARTBEAT = ("hb",)


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return len(data).to_bytes(_HEADER, "little") + data


class FrameReader(asyncio.Protocol):
    """Asyncio side of a socket: calls ``on_message(obj)`` for each complete frame, ``on_lost()`` at EOF."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        messages = []
        with memoryview(buf) as view:
            while end - pos >= _HEADER:
                size = int.from_bytes(view[pos:pos + _HEADER], "little")
                if end - pos - _HEADER < size:
                    break
                messages.append(pickle.loads(view[pos + _HEADER:pos + _HEADER + size]))
                pos += _HEADER + size
        if pos:
            del buf[:pos]
        for msg in messages:
            self._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()

    def send(self, obj: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(obj))


async def open_reader(sock: socket.socket, on_message: Callable[[Any], None],
                      on_lost: Callable[[], None]) -> FrameReader:
    """Attach a FrameReader (which can also ``send``) to ``sock`` on the running loop."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_unix_connection(lambda: FrameReader(on_message, on_lost), sock=sock)
    return proto


class BlockingSender:
    """Thread-safe blocking sends on a socket used for writing only (the worker's "up" socket)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        self.lock = threading.Lock()

    def send(self, obj: Any) -> None:
        data = frame(obj)
        with self.lock:
            self._sock.sendall(data)

    def send_locked(self, obj: Any) -> None:
        """Send while the caller already holds ``lock`` (to keep an order across threads)."""
        self._sock.sendall(frame(obj))

    def send_frame_locked(self, data: bytes) -> None:
        """Send a frame made beforehand (``frame``) while the caller holds ``lock``."""
        self._sock.sendall(data)


def start_heartbeat(sender: BlockingSender, interval: float) -> threading.Thread:
    """Send ``HEARTBEAT`` every ``interval`` seconds from a daemon thread of its own, whatever the engine thread and
    the event loop do (a beat is skipped while another thread is sending: its message is a sign of life too). It
    stops only with the process, or when the socket is gone; a process stopped or a C call holding the GIL stops it,
    which is what the gateway must see."""
    beat = frame(HEARTBEAT)

    def run() -> None:
        while True:
            time.sleep(interval)
            if not sender.lock.acquire(timeout=interval):
                continue
            try:
                sender.send_frame_locked(beat)
            except OSError:
                return
            finally:
                sender.lock.release()

    thread = threading.Thread(target=run, name="octo-heartbeat", daemon=True)
    thread.start()
    return thread
