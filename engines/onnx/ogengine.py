"""onnxruntime-genai's own continuous-batching ``og.Engine`` (``-o backend=engine``).

Chosen by ``backend=auto`` for folders built with paged attention (``genai_config.json`` has
``engine.dynamic_batching``: the model builder's ``use_paged_attention``, CUDA/WebGPU builds), whose flattened
inputs neither the session nor the generator backend can drive. There ``og.Engine`` schedules sequences itself:
every octo sequence is one ``og.Request`` with one turn (its prompt), requests join and leave between any two
``Engine.run`` calls, and each run yields at most one new token per running request.

On a CPU folder (forced with ``-o backend=engine``) onnxruntime-genai 0.18 runs a fixed batch: a request that
arrives while others run is held inside the library until they finish (measured: it starts with no token until
then). The scheduler sees that honestly as a sequence whose step returned no token yet.

Sampling is the library's (``TurnOptions``): temperature, top_k, top_p, repetition penalty, and seed on
paged-attention builds (the library refuses a per-turn seed elsewhere, so a request with ``seed`` gets a 400
there); stop strings, ``max_tokens`` and EOS stay with the shared scheduler. No prefix reuse is claimed: the
library's KV is not octo's to copy (``save`` returns None). Nor constrained decoding or logprobs: ``Engine.run``
samples inside the library and shows no logits, so an engine on this backend declares ``supports_masks``,
``supports_logprobs`` and ``supports_prompt_logprobs`` False (the library's own ``TurnOptions.set_guidance`` is a
different, library-side grammar layer that octo does not use).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from octo.engine import Feed, KVHandle, Sequence
from octo.errors import EngineError

from .folder import DecoderSpec

SAMPLING = frozenset({"temperature", "top_p", "top_k", "seed", "repetition_penalty"})


def has_dynamic_batching(folder: Path) -> bool:
    """Whether the folder was built for ``og.Engine`` (paged attention: ``engine.dynamic_batching``)."""
    try:
        config = json.loads((folder / "genai_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("engine"), dict) and "dynamic_batching" in config["engine"]


class _Slot:
    __slots__ = ("request", "turn", "prompt", "ready", "finish")

    def __init__(self, request) -> None:
        self.request = request
        self.turn: int | None = None
        self.prompt: list[int] = []  # prompt chunks gathered until the last one (the turn starts whole)
        self.ready: list[int] = []  # tokens the library produced, not yet handed to the scheduler
        self.finish = None  # the library's FinishReason once the turn ended on its side


class EngineBackend:
    batching = "continuous"
    scheme = "continuous:og.Engine"
    sampling_params = SAMPLING
    # the library samples inside Engine.run and shows no logits: no octo masks, no logprobs
    supports_masks = supports_logprobs = supports_prompt_logprobs = False

    def __init__(self, folder: Path, spec: DecoderSpec, max_batch: int, n_ctx: int, threads: int) -> None:
        import onnxruntime_genai as og

        self._og = og
        config = og.Config(str(folder))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.max_batch = max_batch
        self.engine = None  # created in the thread that runs it (the library checks), see _engine()
        self._owner: int | None = None
        self.buffer = None
        self.paged = has_dynamic_batching(folder)
        # the library takes a per-turn seed only from an Engine configured for dynamic batching
        self.sampling_params = SAMPLING if self.paged else SAMPLING - {"seed"}
        self.n_ctx = n_ctx
        self.eos = sorted(spec.eos_token_ids)
        self.live: dict[int, Sequence] = {}  # id(og.Request) -> sequence

    def describe(self) -> str:
        mode = ("paged attention: sequences join between runs" if self.paged else
                "CPU build: the library runs a fixed batch, later requests wait inside it")
        return f"onnxruntime-genai {self._og.__version__} og.Engine ({mode})"

    def _engine(self):
        """The og.Engine, owned by the calling thread: the library wants every call from the thread that made
        it, and the start-up benchmark runs in another thread than the scheduler's."""
        tid = threading.get_ident()
        if self.engine is None or self._owner != tid:
            if self.live:
                raise EngineError("og.Engine was called from another thread while it had running requests.")
            self.engine = self.buffer = None  # the old one (and its KV) goes first
            self.engine = self._og.Engine(self.model)
            self.buffer = self.engine.create_event_buffer(max(64, 4 * self.max_batch))
            self._owner = tid
        return self.engine

    def add(self, seq: Sequence) -> None:
        seq.slot = _Slot(self._engine().create_request())
        seq.n_cached = 0

    def _begin(self, seq: Sequence) -> None:
        og, slot, sp = self._og, seq.slot, seq.sampling
        opts = og.TurnOptions(slot.request)
        opts.set_max_generated_tokens(max(1, self.n_ctx - len(slot.prompt)))  # octo applies max_tokens itself
        opts.set_do_sample(not sp.greedy)
        if not sp.greedy:
            opts.set_temperature(sp.temperature)
            opts.set_top_p(sp.top_p)
            opts.set_top_k(sp.top_k)
        if sp.seed is not None:
            opts.set_seed(sp.seed)
        if sp.repetition_penalty != 1.0:
            opts.set_repetition_penalty(sp.repetition_penalty)
        slot.turn = slot.request.begin_turn(np.asarray(slot.prompt, dtype=np.int32), opts)
        self.live[id(slot.request)] = seq

    def step(self, feeds: list[Feed]) -> list[int | None]:
        for f in feeds:
            slot = f.seq.slot
            if slot.turn is None:  # prompt chunks: gathered, the turn starts with the whole prompt
                slot.prompt.extend(f.tokens)
                if f.sample:
                    self._begin(f.seq)
            elif len(f.tokens) != 1 or f.tokens[0] != f.seq.tokens[-1]:
                raise EngineError(f"Sequence {f.seq.id}: og.Engine already holds its tokens; expected its last one.")
        engine = self._engine()
        if any(not s.slot.ready for s in self.live.values()) and engine.has_pending_requests():
            for ev in engine.run(self.buffer):
                seq = self.live.get(id(ev.request))
                if seq is None:
                    continue  # a request octo already removed
                if ev.error_code != self._og.EngineErrorCode.NONE:
                    raise EngineError(f"og.Engine failed sequence {seq.id}: {ev.error_code.name}")
                if ev.flags & self._og.EngineEventFlags.TOKEN:
                    seq.slot.ready.append(int(ev.token))
                if ev.flags & self._og.EngineEventFlags.TURN_FINISHED:
                    seq.slot.finish = ev.finish_reason
        out: list[int | None] = []
        for f in feeds:
            seq, slot = f.seq, f.seq.slot
            if not f.sample:
                seq.n_cached += len(f.tokens)
                out.append(None)
                continue
            if slot.ready:
                out.append(slot.ready.pop(0))
            elif slot.finish is not None:  # the library ended the turn and has no token left for it
                if slot.finish != self._og.FinishReason.EOS:
                    raise EngineError(f"og.Engine ended sequence {seq.id}: {slot.finish.name}")
                out.append(self.eos[0])
            else:
                out.append(None)  # not scheduled by the library yet: fed again next step
            seq.n_cached = len(seq.tokens) - (out[-1] is None)
        return out

    def remove(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot is None:
            return
        seq.slot = None
        self.live.pop(id(slot.request), None)
        if slot.turn is not None and slot.finish is None:
            slot.request.cancel_turn(slot.turn)
        slot.request.close()

    def save(self, seq: Sequence) -> KVHandle | None:
        return None

    def restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        raise NotImplementedError("the og.Engine backend keeps no octo prefix cache")

    def free(self, handle: KVHandle) -> None:
        handle.data = None

    def close(self) -> None:
        for seq in list(self.live.values()):
            self.remove(seq)
        self.engine = self.buffer = None
        self.model = None
