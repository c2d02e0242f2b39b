"""Batch windows of onnxruntime-genai's own ``og.Generator`` (``-o backend=generator``).

On CPU, onnxruntime-genai 0.18 cannot add a sequence to a running ``og.Generator`` (nor to its ``og.Engine``,
whose continuous batching needs a paged-attention build, CUDA/WebGPU only), so this backend declares
``batching = "window"``: the scheduler admits a group of up to ``max_batch`` sequences only when the previous
group has finished, and feeds every prompt whole in the group's first step. The group becomes one Generator
(``batch_size=N``, prompts right-padded with the pad token as ``Tokenizer.encode_batch`` pads them); each step
is one ``generate_next_token()`` for the whole batch.

Sampling: a window whose sequences are all plain greedy (no output constraint, no logprobs) uses the library's own
argmax. Otherwise the raw logits of the step are read (``get_logits``), every live row is sampled by octo's sampler
(the same one as the session backend, so every sampling parameter, ``Feed.mask`` and ``Feed.logprobs`` mean the
same), and the choice is written back (``set_logits``, all other tokens at -inf) for the Generator's argmax to
pick. Prompt logprobs come from the model's ``logits`` output of the prompt pass (``get_output``: every position of
every right-padded row).

Limits, measured and kept honest: a row whose sequence left (finished or cancelled) keeps being computed until
the whole window ends (a Generator cannot drop a row); there is no prefix reuse (a Generator's KV cannot be
copied out, so ``save`` returns None); a prompt that contains the pad token is masked there by the library.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from octo.engine import Feed, KVHandle, Sequence
from octo.errors import EngineError

from .folder import DecoderSpec
from .sampler import SAMPLING_PARAMS, RowSampler, prompt_entries


class _Member:
    __slots__ = ("row", "sampler", "live")

    def __init__(self, sampler: RowSampler) -> None:
        self.row = -1
        self.sampler = sampler
        self.live = True


class GeneratorBackend:
    batching = "window"
    scheme = "window:generator"
    sampling_params = SAMPLING_PARAMS
    # masks and logprobs: octo samples from get_logits() and forces its choice; prompt logprobs: the prompt pass's
    # logits output holds every position
    supports_masks = supports_logprobs = supports_prompt_logprobs = True

    def __init__(self, folder: Path, spec: DecoderSpec, max_batch: int, n_ctx: int, threads: int,
                 penalty_last_n: int) -> None:
        import json

        import onnxruntime_genai as og

        self._og = og
        config = og.Config(str(folder))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.spec = spec
        self.max_batch = max_batch
        self.n_ctx = n_ctx
        self.n_vocab = spec.vocab_size
        self.penalty_last_n = penalty_last_n
        self.pad = spec.pad_token_id if spec.pad_token_id is not None else 0
        self.gen = None
        self.members: list[Sequence] = []  # the current window, in Generator row order
        self.waiting: list[Sequence] = []  # added, not yet started

    def describe(self) -> str:
        return f"onnxruntime-genai {self._og.__version__} og.Generator batch windows"

    def add(self, seq: Sequence) -> None:
        if self.gen is not None:
            raise EngineError("A batch window is running; the generator backend cannot add a sequence to it.")
        if len(self.waiting) >= self.max_batch:
            raise EngineError(f"A window holds at most {self.max_batch} sequences.")
        seq.slot = _Member(RowSampler(seq.sampling, self.n_vocab, self.penalty_last_n))
        seq.n_cached = 0
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        m = seq.slot
        if m is None:
            return
        seq.slot = None
        m.live = False
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.gen is not None and not any(s.slot is not None for s in self.members):
            self.gen = None  # the window is over: its Generator (and KV) goes
            self.members = []

    def step(self, feeds: list[Feed]) -> list[int | BaseException | None]:
        if self.gen is None:
            self._start(feeds)
        else:
            for f in feeds:
                if f.seq not in self.members or len(f.tokens) != 1 or f.tokens[0] != self._last[f.seq.slot.row]:
                    raise EngineError(f"Sequence {f.seq.id}: unexpected feed for a running og.Generator window.")
                if f.prompt_logprobs >= 0:
                    f.prompt_out = []  # a decode feed: its next token is not known yet
        rows = {f.seq.slot.row: f for f in feeds}
        failed: dict[int, BaseException] = {}
        if all(f.seq.slot.sampler.fast(f) for f in feeds):
            self.gen.generate_next_token()
        else:  # octo samples every row (masks, logprobs, its sampler) and forces the choice
            logits = np.array(self.gen.get_logits(), dtype=np.float32)  # [batch, 1, vocab], raw
            forced = logits  # each row is sampled before it is overwritten
            for row, f in rows.items():
                try:
                    tok = f.seq.slot.sampler.sample_feed(f, logits[row, -1])
                except EngineError as e:  # this sequence fails; its row still needs a token
                    failed[row], tok = e, int(np.argmax(logits[row, -1]))
                forced[row, -1, :] = -np.inf
                forced[row, -1, tok] = 0.0
            self.gen.set_logits(forced)
            self.gen.generate_next_token()
        self._last = self.gen.get_next_tokens().tolist()
        out: list[int | BaseException | None] = []
        for f in feeds:
            f.seq.n_cached += len(f.tokens)
            row = f.seq.slot.row
            out.append(failed.get(row, int(self._last[row])))
        return out

    def _start(self, feeds: list[Feed]) -> None:
        og = self._og
        seqs = [f.seq for f in feeds]
        if set(map(id, seqs)) != set(map(id, self.waiting)):
            raise EngineError("The first step of a window must feed every sequence of the window.")
        for f in feeds:
            if f.seq.n_cached != 0 or len(f.tokens) != len(f.seq.tokens) or not f.sample:
                raise EngineError("The first step of a window must feed each whole prompt and sample.")
        width = max(len(f.tokens) for f in feeds)
        ids = np.full((len(feeds), width), self.pad, np.int32)
        for row, f in enumerate(feeds):
            ids[row, :len(f.tokens)] = f.tokens
            f.seq.slot.row = row
        params = og.GeneratorParams(self.model)
        # rows are right-padded to ``width``: room for n_ctx positions of the shortest prompt's row
        max_length = min(self.n_ctx + width, self.spec.context_length)
        params.set_search_options(do_sample=False, max_length=max_length, batch_size=len(feeds))
        gen = og.Generator(self.model, params)
        gen.append_tokens(og.Tensor(ids))
        self.gen, self.members, self.waiting = gen, seqs, []
        if any(f.prompt_logprobs >= 0 for f in feeds):
            full = np.asarray(gen.get_output("logits"), dtype=np.float32)  # the prompt pass: every position
            if full.shape[:2] != ids.shape:
                raise EngineError(f"og.Generator gave prompt logits of shape {full.shape}, not {ids.shape} + vocab: "
                                  "no prompt logprobs from this folder.")
            for row, f in enumerate(feeds):
                if f.prompt_logprobs >= 0:
                    f.prompt_out = prompt_entries(f, 0, full[row, :len(f.tokens)])

    def save(self, seq: Sequence) -> KVHandle | None:
        return None

    def restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        raise NotImplementedError("the generator backend keeps no prefix cache")

    def free(self, handle: KVHandle) -> None:
        handle.data = None

    def close(self) -> None:
        self.gen = None
        self.members = []
        self.waiting = []
        self.model = None
