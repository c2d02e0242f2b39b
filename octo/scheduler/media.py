"""Media in the batch: the encodes of a prompt's images, and where its prompt chunks stop.

A prompt's media items (``GenerationRequest.media``: :class:`octo.engine.MediaChunk`) take positions of its tokens,
whose ids are placeholders derived from the item's digest, so the prefix cache, in-flight sharing and KV pressure
count and key an image as the tokens it takes. Before its positions can be fed, an item is encoded
(``Engine.encode_media``: a vision tower and projector). :class:`MediaEncoder`, a part of
:class:`octo.scheduler.engine_loop.EngineLoop` (``sched.media``), runs the encodes on a thread of its own, one at a
time, while the engine thread goes on stepping the other sequences: an image's encode never stalls their decoding
(they share the cores with it). A sequence starts its encodes at admission, after its prefix was restored (an image
the prefix cache held needs none), so they run while its text before the image is fed; the same image queued twice
(by several requests, or the choices of one) is encoded once. :func:`take` cuts prompt chunks: text stops before an
item, and an item goes whole, as one feed (``Feed.media``), once encoded.

The encode thread is supervised as the engine thread is (:mod:`octo.scheduler.watchdog`), from the scheduler's
sweeper (:meth:`MediaEncoder.check`): an encode that raises fails the sequences waiting for it; one that runs far
longer than it should (``FIRST_ENCODE_S`` before any encode was timed, then ``max(MIN_ENCODE_S, 20 x`` the slowest
seconds per position seen ``x`` its positions``)``) is *wedged*: the sequences waiting for it and for the encodes
queued behind it fail with a 503, and new sequences with media get the same 503 at their start, while the other
streams go on decoding, until the stuck call returns. (A native crash ends the process, as a crashing step does: an
engine worker's requests fail with ``engine_crashed`` and the gateway restarts it.) An encode is compute like a step:
where models in workers take turns on the cores (``--share-cores turns``), it runs in this worker's turn
(:class:`octo.runtime.arbiter.ComputeGate`, which both threads hold and release together).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octo.engine import MediaChunk, Sequence
from octo.errors import ModelFailed
from octo.scheduler.jobs import Ticket

log = logging.getLogger("octo.scheduler.admission")
FIRST_ENCODE_S = 300.0  # no encode is called stuck before this, until one was timed (a big vision tower on a slow CPU)
MIN_ENCODE_S = 30.0  # ... and before this afterwards
ENCODE_MARGIN = 20.0  # times the slowest seconds per position seen


def in_media(seq: Sequence) -> bool:
    """Whether ``seq``'s next position to feed is one of a media item."""
    n = seq.n_cached
    return any(c.pos <= n < c.end for c in seq.media)


def take(seq: Sequence, n: int, budget: int, alone: bool) -> tuple[int, MediaChunk | None]:
    """How many of ``seq``'s next positions (from ``n_cached``) a step feeds, given that it could take ``n`` text
    tokens: text stops before the next media item; an item goes whole (the rest of it, from ``n_cached``) with the
    item, once encoded, within the step's ``budget`` or ``alone`` (the step's first prompt feed: an image larger than
    a prompt chunk still goes in). 0: nothing this step (an encode not done yet, or no room left)."""
    at = seq.n_cached
    for c in seq.media:
        if c.end <= at:
            continue
        if c.pos > at:  # text before the next item
            return min(n, c.pos - at), None
        if c.embedding is None:
            return 0, None
        k = c.end - at
        return (k, c) if k <= budget or alone else (0, None)
    return n, None


class _Encode:
    __slots__ = ("chunks", "tickets")

    def __init__(self) -> None:
        self.chunks: list[MediaChunk] = []  # every queued chunk with this digest: they share the embedding
        self.tickets: list[Ticket] = []


class MediaEncoder:
    """The encodes of the running sequences' media items, on one thread of their own (``octo-encode``)."""

    def __init__(self, engine: Any, wake: Callable[[], None], gate: Callable[[], Any] = lambda: None) -> None:
        self.engine = engine
        self.wake = wake  # wakes the engine thread (an encode is done, or failed)
        self.gate = gate  # the worker's ComputeGate now (None: no turns), read at each encode
        self._lock = threading.Lock()
        self._queued: dict[str, _Encode] = {}  # by digest: queued or running
        self._failed: list[tuple[Ticket, BaseException]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._running: tuple[float, int, _Encode] | None = None  # (monotonic start, positions, job) of the encode
        self._per_token = 0.0  # the slowest seconds per position seen
        self.wedged: ModelFailed | None = None  # why media sequences are refused (an encode is stuck), or None
        self.encodes = 0
        self.encode_s = 0.0

    @property
    def busy(self) -> bool:
        """Whether an encode is queued or running."""
        return bool(self._queued)

    def start(self, t: Ticket) -> None:
        """(engine thread) At a sequence's start: encode the items it has yet to feed (not in its restored prefix); a
        stuck encode fails it instead (:meth:`check`)."""
        seq = t.seq
        if self.wedged is not None and any(c.end > seq.n_cached and c.embedding is None for c in seq.media):
            with self._lock:
                self._failed.append((t, self.wedged))
            self.wake()
            return
        for chunk in seq.media:
            if chunk.end <= seq.n_cached or chunk.embedding is not None:
                continue
            with self._lock:
                job = self._queued.get(chunk.digest)
                new = job is None
                if new:
                    job = self._queued[chunk.digest] = _Encode()
                if chunk not in job.chunks:
                    job.chunks.append(chunk)
                job.tickets.append(t)
            if new:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="octo-encode")
                self._pool.submit(self._run, chunk.digest, job)

    def _run(self, digest: str, job: _Encode) -> None:
        with self._lock:
            if not any(t.state == "active" for t in job.tickets):  # every sequence that wanted it is gone (or failed)
                if self._queued.get(digest) is job:
                    del self._queued[digest]
                return
            n = job.chunks[0].n_tokens
            self._running = (time.monotonic(), n, job)
        t0 = time.perf_counter()
        gate = self.gate()
        try:
            if gate is not None:  # models taking turns on the cores: an encode computes in this worker's turn
                gate.enter()
            embedding, err = self.engine.encode_media(job.chunks[0]), None
        except BaseException as exc:  # noqa: BLE001 - the sequences that wait for it fail with it
            log.warning("encoding a %s (%s) failed: %s", job.chunks[0].kind, digest[:12], exc)
            embedding, err = None, exc
        finally:
            if gate is not None:
                gate.exit()
        took = time.perf_counter() - t0
        with self._lock:
            self._running = None
            if self._queued.get(digest) is job:
                del self._queued[digest]
            self.encodes += 1
            self.encode_s += took
            if err is None:
                self._per_token = max(self._per_token, took / max(1, n))
                for c in job.chunks:
                    c.embedding = embedding
            else:
                self._failed += [(t, err) for t in job.tickets]
            if self.wedged is not None:
                log.warning("the image encoder is responsive again (its encode returned after %.1f s)", took)
                self.wedged = None
        self.wake()

    def limit(self, n_tokens: int) -> float:
        """How long an encode of ``n_tokens`` positions may take before it counts as stuck."""
        if not self._per_token:
            return FIRST_ENCODE_S
        return max(MIN_ENCODE_S, ENCODE_MARGIN * self._per_token * n_tokens)

    def check(self) -> None:
        """(event loop, the scheduler's sweeper) An encode running past its :meth:`limit` is stuck: the sequences
        waiting for it and for the encodes queued behind it (on the same thread) fail with a 503, and sequences with
        media are refused until it returns; the other streams go on."""
        run = self._running
        if run is None or self.wedged is not None:
            return
        since, n, job = run
        took = time.monotonic() - since
        if took <= self.limit(n):
            return
        err = ModelFailed(f"The model's image encoder has been stuck in an encode for {took:.0f} s; requests with "
                          "images cannot be served until it returns.", code="encoder_stuck",
                          headers={"Retry-After": "5"})
        with self._lock:
            if self._running is not run:  # it returned meanwhile
                return
            self.wedged = err
            for j in self._queued.values():
                self._failed += [(t, err) for t in j.tickets]
                j.tickets = []
            self._queued.clear()
        log.error("the image encoder is stuck (an encode of %d positions has run %.1f s); failing the requests that "
                  "wait for it and refusing new requests with images until it returns", n, took)
        self.wake()

    def failed(self) -> list[tuple[Ticket, BaseException]]:
        """(engine thread) The running sequences whose item's encode failed since the last call, with the error."""
        if not self._failed:
            return []
        with self._lock:
            out, self._failed = self._failed, []
        return [(t, err) for t, err in out if t.state == "active"]

    def stats(self) -> dict[str, Any]:
        return {"encodes": self.encodes, "encode_s": round(self.encode_s, 3), "queued": len(self._queued),
                "encoder": "stuck" if self.wedged is not None else "ok"}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
