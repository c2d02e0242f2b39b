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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octo.engine import MediaChunk, Sequence
from octo.scheduler.jobs import Ticket

log = logging.getLogger("octo.scheduler.admission")


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

    def __init__(self, engine: Any, wake: Callable[[], None]) -> None:
        self.engine = engine
        self.wake = wake  # wakes the engine thread (an encode is done, or failed)
        self._lock = threading.Lock()
        self._queued: dict[str, _Encode] = {}  # by digest: queued or running
        self._failed: list[tuple[Ticket, BaseException]] = []
        self._pool: ThreadPoolExecutor | None = None
        self.encodes = 0
        self.encode_s = 0.0

    @property
    def busy(self) -> bool:
        """Whether an encode is queued or running."""
        return bool(self._queued)

    def start(self, t: Ticket) -> None:
        """(engine thread) At a sequence's start: encode the items it has yet to feed (not in its restored prefix)."""
        seq = t.seq
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
            if not any(t.state == "active" for t in job.tickets):  # every sequence that wanted it is gone
                del self._queued[digest]
                return
        t0 = time.perf_counter()
        try:
            embedding, err = self.engine.encode_media(job.chunks[0]), None
        except BaseException as exc:  # noqa: BLE001 - the sequences that wait for it fail with it
            log.warning("encoding a %s (%s) failed: %s", job.chunks[0].kind, digest[:12], exc)
            embedding, err = None, exc
        with self._lock:
            del self._queued[digest]
            self.encodes += 1
            self.encode_s += time.perf_counter() - t0
            if err is None:
                for c in job.chunks:
                    c.embedding = embedding
            else:
                self._failed += [(t, err) for t in job.tickets]
        self.wake()

    def failed(self) -> list[tuple[Ticket, BaseException]]:
        """(engine thread) The running sequences whose item's encode failed since the last call, with the error."""
        if not self._failed:
            return []
        with self._lock:
            out, self._failed = self._failed, []
        return [(t, err) for t, err in out if t.state == "active"]

    def stats(self) -> dict[str, Any]:
        return {"encodes": self.encodes, "encode_s": round(self.encode_s, 3), "queued": len(self._queued)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
