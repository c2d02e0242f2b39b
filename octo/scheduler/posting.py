"""What the engine thread hands to the event loop, and the small helpers around the engine thread.

The engine loop collects *posts*, ``(function, target, value)`` triples, while it steps; the event loop runs them
(:func:`deliver`) after one ``loop.call_soon_threadsafe`` per batch of posts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octo.errors import EngineError, OctoError
from octo.scheduler.jobs import Job, Ticket

log = logging.getLogger("octo.scheduler.admission")


def safe_free(engine: Any) -> Callable[[Any], None]:
    """``engine.kv_free`` that logs instead of raising: a handle the engine cannot free is its leak, not a failure
    of the request (or of the prefix-cache index) that let it go."""
    def free(handle: Any) -> None:
        try:
            engine.kv_free(handle)
        except Exception:  # noqa: BLE001
            log.exception("kv_free failed")
    return free


def new_engine_thread() -> ThreadPoolExecutor:
    """A model's engine thread: one thread that runs its load, warm-up, benchmark and every step, in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="octo-engine")


def as_octo_error(exc: BaseException) -> OctoError:
    if isinstance(exc, OctoError):
        return exc
    return EngineError(f"The engine failed: {type(exc).__name__}: {exc}")


def fail_job(job: Job, err: OctoError) -> None:
    """On the event loop: a job that never ran gets ``err`` (its admission wait, and its result)."""
    if job.admitted is not None:
        set_exception(job.admitted, err)
    set_exception(job.result if isinstance(job, Ticket) else job.future, err)


def outcome(fut: asyncio.Future, result: Any) -> tuple:
    """The post that answers ``fut`` with ``result`` (an exception instance: with that error)."""
    if isinstance(result, BaseException):
        return (set_exception, fut, as_octo_error(result))
    return (set_result, fut, result)


def set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.add_done_callback(_consume)  # nobody may await it (client gone)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def deliver(posts: list) -> None:
    """(event loop) Run the posts."""
    for fn, target, value in posts:
        fn(target, value)
