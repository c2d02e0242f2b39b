"""Cross-request batching on CTranslate2: several requests' windows through one encoder call, their decodes together.

Each request runs faster-whisper's own long-form loop (``WhisperModel.transcribe``: 30-second windows, OpenAI's
temperature fallback with its thresholds, previous text as prompt) in a thread of its own, on a view of the model
whose CTranslate2 calls go to a :class:`Rendezvous`. When every request's loop waits on a call, the engine thread
runs them as batches: every waiting window through the encoder at once, and the decodes with the same settings
and the same prompt layout in one ``generate`` (CTranslate2 requires ``<|startoftranscript|>`` at the same position
in every row, so windows whose previous text differs in length decode apart; first windows always agree). The
loop being faster-whisper's own, a request has the same decoding batched or alone: CTranslate2's rows do not
depend on their batch (tests compare the two).

A request whose client went away stops at its next CTranslate2 call (:class:`Abandoned` in its thread); the
others go on. A failed batched call fails the requests in it, not the others.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octo.engine import TranscriptionRequest
from octo.errors import EngineError, OctoError

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np


class Abandoned(Exception):
    """The request's client went away: its loop stops at this CTranslate2 call."""


@dataclass(eq=False)
class Op:
    """One CTranslate2 call a request's loop waits on."""

    kind: str  # "encode" | "generate"
    key: Any  # calls with equal keys may share a batch
    features: np.ndarray  # mel window (encode) or encoder output (generate), batch dimension 1
    prompt: list[int] | None = None
    kwargs: dict | None = None
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class Rendezvous:
    """Where the request threads' calls meet; :meth:`serve` (the engine thread) runs them in batches."""

    def __init__(self, ct2: Any, n_requests: int, max_batch: int, sot: int) -> None:
        self.ct2, self.max_batch, self.sot = ct2, max(1, max_batch), sot
        self.cv = threading.Condition()
        self.running = n_requests  # request threads neither waiting on a call nor finished
        self.waiting: list[Op] = []
        self.closed = False
        self.rounds = self.calls = 0  # batched CTranslate2 calls and the requests' calls they served

    def call(self, op: Op) -> Any:
        with self.cv:
            if self.closed:
                raise EngineError("The batch this request was in has stopped.")
            self.waiting.append(op)
            self.running -= 1
            self.cv.notify_all()
            while not op.done:
                self.cv.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def leave(self) -> None:
        """A request thread has finished."""
        with self.cv:
            self.running -= 1
            self.cv.notify_all()

    def serve(self, report: Callable[[], None]) -> None:
        """Run the waiting calls, a round at a time, until every request has finished."""
        ops: list[Op] = []
        try:
            while True:
                with self.cv:
                    while self.running > 0:
                        self.cv.wait()
                    ops, self.waiting = self.waiting, []
                report()
                if not ops:
                    return
                self.run(ops)
                with self.cv:
                    for op in ops:
                        op.done = True
                    self.running += len(ops)
                    self.cv.notify_all()
        finally:  # an interrupted engine thread: no request thread may wait forever
            with self.cv:
                self.closed = True
                for op in ops + self.waiting:
                    if not op.done:
                        op.error, op.done = EngineError("The batched transcription was interrupted."), True
                self.cv.notify_all()

    def run(self, ops: list[Op]) -> None:
        groups: dict[Any, list[Op]] = {}
        for op in ops:
            groups.setdefault(op.key, []).append(op)
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                chunk = group[i : i + self.max_batch]
                try:
                    self.encode(chunk) if chunk[0].kind == "encode" else self.generate(chunk)
                except Exception as exc:  # noqa: BLE001 - the error goes to the requests in this call
                    for op in chunk:
                        op.error = exc
                self.rounds += 1
                self.calls += len(chunk)

    def encode(self, chunk: list[Op]) -> None:
        import numpy as np
        to_cpu = self.ct2.device != "cpu"  # rows are split on the host
        out = np.asarray(self.ct2.encode(storage([op.features for op in chunk]), to_cpu=to_cpu))
        for i, op in enumerate(chunk):
            op.result = storage([out[i : i + 1]])

    def generate(self, chunk: list[Op]) -> None:
        results = self.ct2.generate(storage([op.features for op in chunk]), [op.prompt for op in chunk],
                                    **chunk[0].kwargs)
        for op, result in zip(chunk, results, strict=True):
            op.result = [result]


def storage(rows: list[np.ndarray]) -> Any:
    """The rows as one CTranslate2 StorageView (imported here: the gateway imports this module, and CTranslate2
    brings its own OpenMP runtime)."""
    import ctranslate2
    import numpy as np

    return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.concatenate(rows)))


class BatchedModel:
    """The CTranslate2 model as one request's loop sees it: ``encode`` and ``generate`` wait for the batch."""

    def __init__(self, ct2: Any, rendezvous: Rendezvous, cancelled: Callable[[], bool] | None) -> None:
        self.ct2, self.rendezvous, self.cancelled = ct2, rendezvous, cancelled

    def __getattr__(self, name: str) -> Any:  # is_multilingual, device, detect_language, align ...: the model's
        return getattr(self.ct2, name)

    def encode(self, features: Any, to_cpu: bool = False) -> Any:
        import numpy as np
        self.check()
        return self.rendezvous.call(Op("encode", "encode", np.asarray(features)))

    def generate(self, features: Any, prompts: list[list[int]], **kwargs: Any) -> Any:
        import numpy as np
        self.check()
        if len(prompts) != 1:
            raise EngineError(f"faster-whisper decoded {len(prompts)} prompts in one call; the batch expects one.")
        prompt = list(prompts[0])
        sot = prompt.index(self.rendezvous.sot) if self.rendezvous.sot in prompt else -1
        key = ("generate", sot, len(prompt), repr(sorted(kwargs.items())))
        return self.rendezvous.call(Op("generate", key, np.asarray(features), prompt, kwargs))

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise Abandoned


def transcribe_together(model: Any, requests: list[TranscriptionRequest],
                        run: Callable[[Any, TranscriptionRequest], Any],
                        on_done: Callable[[int, Any], None] | None, max_batch: int) -> list[Any]:
    """``run(view, request)`` for every request, each in a thread on a view of ``model`` (a faster-whisper
    ``WhisperModel``) whose CTranslate2 calls are batched with the others'; ``on_done(i, result)`` from the
    calling thread as each finishes. An OctoError stands in its request's place."""
    sot = model.hf_tokenizer.token_to_id("<|startoftranscript|>")
    rendezvous = Rendezvous(model.model, len(requests), max_batch, sot)
    out: list[Any] = [None] * len(requests)
    finished: list[int] = []

    def work(i: int) -> None:
        view = copy.copy(model)
        view.model = BatchedModel(model.model, rendezvous, requests[i].cancelled)
        try:
            out[i] = run(view, requests[i])
        except OctoError as exc:
            out[i] = exc
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own
            out[i] = EngineError(f"faster-whisper failed: {type(exc).__name__}: {exc}")
        finally:
            with rendezvous.cv:
                finished.append(i)
            rendezvous.leave()

    def report() -> None:
        with rendezvous.cv:
            done = finished[:]
            finished.clear()
        for i in done:
            if on_done is not None:
                on_done(i, out[i])

    threads = [threading.Thread(target=work, args=(i,), name=f"octo-fw-{i}", daemon=True)
               for i in range(len(requests))]
    for t in threads:
        t.start()
    rendezvous.serve(report)
    for t in threads:
        t.join()
    report()
    return out
