"""Supervision of a scheduler's engine thread, from the event loop.

The engine thread marks the start and end of every engine call (a step, an embeddings or audio call). The
scheduler's sweeper (every 50 ms on the event loop) asks :meth:`Watchdog.check` whether the current call has run
far longer than it should: a step is *wedged* after ``max(MIN_STEP_S, 20 x`` the slowest time per token seen so
far ``x`` its tokens``)``, a call after ``CALL_S``, the engine calls between two steps (``add_sequence``,
``remove_sequence``, ``kv_save``, ...) after ``max(MIN_STEP_S, 20 x`` the slowest step seen``)``. A thread that
ended with an error is *dead*. Either way, every request waiting on the model gets a 503 at once, new ones get a 503
without queueing, and ``on_fault`` tells the owner: an engine worker process exits so the gateway reloads the model
in a fresh one; in the gateway (``--isolation thread``) a dead loop is restarted and a wedged one is reported until
its step returns.

The watchdog talks to its owner (the scheduler) only through :class:`WatchdogOwner`: ``stopping``, ``on_loop``,
``fail_everything`` and ``restart_loop``; the engine thread tells it about each engine call with ``busy`` / ``idle``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from octo.errors import ModelFailed, OctoError

log = logging.getLogger("octo.scheduler.watchdog")

MIN_STEP_S = 5.0  # no step is called wedged before this
FIRST_STEP_S = 300.0  # before any step was timed (a big model's first prompt chunk on a slow CPU)
CALL_S = 600.0  # embeddings and audio calls (an hour of audio on a slow host takes minutes)
STEP_MARGIN = 20.0  # times the slowest seconds per token seen
MAX_RESTARTS = 3  # dead loops restarted in-process before the model is declared failed


class WatchdogOwner(Protocol):
    """What the watchdog needs of the scheduler it supervises."""

    @property
    def stopping(self) -> bool:
        """The scheduler is shutting down: its engine thread ending is no fault."""
        ...

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the scheduler's event loop, from any thread."""
        ...

    def fail_everything(self, err: OctoError) -> None:
        """(event loop) Fail every job the model holds, queued or in flight, with ``err``."""
        ...

    def restart_loop(self) -> None:
        """(event loop) Run the step loop again on the model's engine thread after it died."""
        ...


class Watchdog:
    def __init__(self, owner: WatchdogOwner) -> None:
        self.owner = owner
        self.state = "ok"  # ok | wedged | dead
        self.reason: str | None = None
        self.on_fault: Callable[[str, str], Any] | None = None  # (state, reason), on the event loop
        self.min_step_s = MIN_STEP_S
        self.restarts = 0
        self._since = 0.0  # monotonic start of the engine call in progress; 0.0 when none
        self._tokens: int | None = 0  # what it is: a step's fed tokens, 0 between steps, None a call
        self._per_token = 0.0  # the slowest seconds per fed token seen
        self._slowest = 0.0  # the slowest step seen, in seconds
        self._wedged_at = 0.0  # the _since of the call that was declared wedged

    # -- engine thread ---------------------------------------------------------------------------------
    # (a few calls a step: two writes each; the limit of the call in progress is worked out by check, which only
    # the event loop's sweeper calls, from what it is and what the steps before it took)
    def busy(self, tokens: int | None) -> None:
        """An engine call starts: a step feeding ``tokens`` tokens, a call (None), or (0) the engine calls between
        two steps."""
        self._tokens = tokens
        self._since = time.monotonic()

    def idle(self, between: bool = False) -> None:
        """The engine call ended; ``between``: the engine thread goes on with the calls between two steps."""
        since, tokens = self._since, self._tokens
        now = time.monotonic()
        if since and tokens:
            took = now - since
            if took / tokens > self._per_token:
                self._per_token = took / tokens
            if took > self._slowest:
                self._slowest = took
        if between:  # busy(0), without the call
            self._tokens = 0
            self._since = now
        else:
            self._since = 0.0

    def _limit(self, tokens: int | None) -> tuple[float, str]:
        """How long the engine call in progress (``tokens`` as given to ``busy``) may take, and what it is."""
        if tokens is None:
            return CALL_S, "a call"
        if not self._per_token:
            return max(self.min_step_s, FIRST_STEP_S), "a step" if tokens else "an engine call"
        if tokens:
            return max(self.min_step_s, STEP_MARGIN * self._per_token * tokens), "a step"
        return max(self.min_step_s, STEP_MARGIN * self._slowest), "an engine call between steps"

    def thread_exited(self, done: Any) -> None:
        """Done-callback of the engine loop's future (runs on the engine thread)."""
        exc = done.exception() if not done.cancelled() else None
        if exc is None and self.owner.stopping:
            return
        log.error("the engine thread died: %s", _describe(exc), exc_info=exc)
        self.owner.on_loop(self._dead, _describe(exc))

    # -- event loop --------------------------------------------------------------------------------------
    def check(self) -> None:
        since = self._since
        if self.state == "wedged":
            if since != self._wedged_at:  # the call returned after all
                log.warning("the engine thread is responsive again (%s)", self.reason)
                self.state, self.reason = "ok", None
            return
        if self.state != "ok" or not since:
            return
        tokens = self._tokens
        if self._since != since:  # a new call started meanwhile: look again at the next sweep
            return
        limit, what = self._limit(tokens)
        took = time.monotonic() - since
        if took > limit:
            self._wedged_at = since
            self._fault("wedged", f"the engine thread has been stuck in {what} for {took:.1f} s")

    def check_open(self) -> None:
        if self.state != "ok":
            raise ModelFailed(f"The model cannot serve requests now: {self.reason}.", headers={"Retry-After": "5"})

    def _dead(self, why: str) -> None:
        self._fault("dead", f"the engine thread died ({why})")
        if self.on_fault is None and self.restarts < MAX_RESTARTS and not self.owner.stopping:
            self.restarts += 1  # in the gateway: start the loop again on the model's engine thread
            log.warning("restarting the engine loop (%d of %d)", self.restarts, MAX_RESTARTS)
            self.owner.restart_loop()
            self.state, self.reason = "ok", None

    def _fault(self, state: str, reason: str) -> None:
        """Fail everything the model holds with a 503 and tell the owner."""
        self.state, self.reason = state, reason
        log.error("%s", reason)
        self.owner.fail_everything(ModelFailed(f"The model stopped serving: {reason}.",
                                                   headers={"Retry-After": "5"}))
        if self.on_fault is not None:
            self.on_fault(state, reason)


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "its loop returned"
