"""Sharing the host's cores between models: one model computes at a time, in turns, when several are loaded.

Two busy thread pools on the same cores collapse both (llama.cpp at 2 threads on 2 cores: 56 -> 21 tok/s with one
busy neighbour), so engine workers do not compute at the same time: before an engine step a worker's engine thread
asks the gateway's arbiter for the cores (one byte on its own socket pair) and waits for the grant; it keeps them
for a quantum (several steps, ``QUANTUM`` seconds) or until it has nothing to do, then hands them back. Grants go in
arrival order, so two busy models alternate, and a model alone pays one round trip per quantum. It is on with
``--share-cores turns`` while two or more models are loaded in workers. Measured on a 2-core host
(bench/multimodel.py) it is no better than ``--share-cores os`` (the default, where models busy together split the
cores by thread count, ``Registry._busy_changed``): llama.cpp's OpenMP threads and ONNX Runtime's pool spin-wait
after their own steps, so the idle model's threads still take cores during the other's turn, and a model whose turn
comes must wake its sleeping threads.

Gateway side: :class:`Arbiter` (one per gateway) and a :class:`Member` protocol per worker. Worker side:
:class:`ComputeGate`, which the scheduler calls around each ``Engine.step`` and each image encode.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections import deque

QUANTUM = 0.05  # seconds a worker may keep the cores while others wait


class Member(asyncio.Protocol):
    """The gateway's end of one worker's arbiter socket: b"a" asks for the cores, b"r" gives them back."""

    def __init__(self, arbiter: Arbiter, label: str) -> None:
        self.arbiter = arbiter
        self.label = label
        self.transport: asyncio.Transport | None = None
        self.turns = 0
        self.waited = 0.0
        self.asked_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for byte in data:
            if byte == 0x61:  # "a"
                self.asked_at = time.monotonic()
                self.arbiter.acquire(self)
            elif byte == 0x72:  # "r"
                self.arbiter.release(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.arbiter.lost(self)

    def grant(self) -> None:
        self.turns += 1
        self.waited += time.monotonic() - self.asked_at
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"g")


class Arbiter:
    def __init__(self) -> None:
        self.holder: Member | None = None
        self.waiting: deque[Member] = deque()

    async def attach(self, sock: socket.socket, label: str) -> Member:
        loop = asyncio.get_running_loop()
        _, member = await loop.create_unix_connection(lambda: Member(self, label), sock=sock)
        return member

    def acquire(self, member: Member) -> None:
        if self.holder is None:
            self.holder = member
            member.grant()
        elif member is not self.holder and member not in self.waiting:
            self.waiting.append(member)

    def release(self, member: Member) -> None:
        if self.holder is member:
            self.holder = None
            if self.waiting:
                self.holder = self.waiting.popleft()
                self.holder.grant()

    def lost(self, member: Member) -> None:
        if member in self.waiting:
            self.waiting.remove(member)
        self.release(member)


ARBITER = Arbiter()


class ComputeGate:
    """The worker's end, used by its engine thread and its encode thread (``octo.scheduler.media``; ``enabled`` is
    switched by the worker's event loop): the first of them to compute asks for the cores, and they go back once
    neither computes (after the quantum, or at once when the engine thread has nothing to do)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        self.enabled = False
        self._since = 0.0  # when this worker's turn began; 0: not holding the cores
        self._inside = 0  # threads computing now (between enter and exit)
        self._lock = threading.Lock()  # (held while waiting for the turn: the other thread waits for it too)

    def enter(self) -> None:
        with self._lock:
            self._inside += 1
            if not self.enabled:  # no turns: nothing to hold
                if self._since:
                    self._release()
                return
            if not self._since:
                self._sock.sendall(b"a")
                if not self._sock.recv(1):  # the gateway is gone
                    os._exit(0)
                self._since = time.monotonic()

    def exit(self) -> None:
        with self._lock:
            self._inside = max(0, self._inside - 1)
            if self._since and not self._inside and time.monotonic() - self._since >= QUANTUM:
                self._release()

    def idle(self) -> None:
        """The engine thread has nothing to compute: hand the cores back at once (unless an encode computes)."""
        with self._lock:
            if self._since and not self._inside:
                self._release()

    def _release(self) -> None:
        self._since = 0.0
        self._sock.sendall(b"r")
