"""How many prompt tokens one engine step may carry beside decoding sequences."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any


class Pacer:
    """How many prompt tokens one step may carry, from the measured cost of a decode-only step and of a prompt token:

    * beside decoding sequences, enough to stretch the step to at most ``stretch`` times a decode-only step
      (2.0: a long prompt never slows the running streams below half their speed, and gets the other half);
      beside a request that is nearly done (``urgent``: at most ``SHORT_WORK`` tokens left to feed and generate),
      at most ``short_stretch`` (1.25): a short request finishes at close to its own speed, shortest work first,
      while a long prompt still moves on every step; a prompt of at most ``max_step_s`` of work (``short``) goes in
      whole, so that requests arriving together start together;
    * in any step, at most ``max_step_s`` seconds of prompt work, so that a request arriving during a long prompt
      waits one short step, not a long chunk (on fast hardware this is more than ``prefill_chunk`` anyway);
    * a prompt alone (nothing else running or queued) reads chunks of at most ``lone_step_s`` seconds (at least
      ``LONE_MIN`` tokens): large enough to cost little prompt speed (128-token chunks read a 1,459-token prompt at
      0.94x the speed of 256-token ones on a 2-core host, 32-token ones at 0.68x), small enough that a request
      arriving meanwhile waits at most that long for the chunk in progress; but a long prompt alone (a coding agent's,
      17,000-42,000 tokens) gets chunks of at least ``1 / LONE_SHARE`` of its tokens (up to the engine's chunk): a
      request arriving meanwhile waits for at most that share of the long prompt's own work, and the prompt reads at
      the engine's full speed (0.6 s chunks are 64 tokens on a busy 2-core host, or deep into a long context: an agent's
      prompt then prefilled in 1.9x llama-server's time, with whole chunks in 0.8x; bench/agent_prefill.py).

    ``stretch`` 0 disables all of it (whole ``prefill_chunk`` steps: the most prompt throughput)."""

    MIN_TOKENS = 4
    LONE_MIN = 64
    LONE_SHARE = 40
    SHORT_WORK = 32
    GATHER_MIN_S = 1.0  # an idle engine's first prompt step of at least this much work waits for requests sent with it
    GATHER_SHARE = 0.02  # for at most this share of the step's estimated time
    GATHER_MAX_S = 0.05

    def __init__(self, stretch: float = 2.0, max_step_s: float = 0.25, lone_step_s: float = 0.6,
                 short_stretch: float = 1.25) -> None:
        self.stretch = stretch
        self.max_step_s = max_step_s
        self.lone_step_s = lone_step_s
        self.short_stretch = short_stretch
        self.decode_s = 0.0  # EWMA seconds of a decode-only step
        self.token_s = 0.0  # EWMA marginal seconds per prompt token in a step
        self.prompt_step_s = 0.0  # what the last step with prompt tokens cost beyond its decoding (see gather_s)

    def budgets(self, chunk: int, decoding: bool, alone: bool = False, urgent: bool = False,
                prompt: int = 0) -> tuple[int, int]:
        """(prompt tokens this step may carry, the part of them for long prompts). ``alone``: one prompt of ``prompt``
        tokens and nothing else running or queued; ``urgent``: a nearly done request runs (see the class)."""
        if self.stretch <= 0 or not self.token_s:
            return chunk, chunk
        if alone:
            lone = max(self.LONE_MIN, int(self.lone_step_s / self.token_s), prompt // self.LONE_SHARE)
            return min(chunk, lone), min(chunk, lone)
        step = self.short(chunk)
        if not (decoding or urgent) or not self.decode_s:
            return chunk, step
        stretch = min(self.stretch, self.short_stretch) if urgent else self.stretch
        return chunk, min(step, max(self.MIN_TOKENS, int((stretch - 1.0) * self.decode_s / self.token_s)))

    def short(self, chunk: int) -> int:
        """The longest prompt that goes in whole beside decoding requests, even a nearly done one: ``max_step_s`` of
        prompt work (what one request's prompt may cost the others: one such step). ``chunk`` until measured."""
        if self.stretch <= 0 or not self.token_s:
            return chunk
        return min(chunk, max(self.MIN_TOKENS, int(self.max_step_s / self.token_s)))

    def plan(self, budget: int, decoding: list[Any], prefilling: list[Any], n_ctx: int,
             queued: Sized) -> tuple[int, int, int]:
        """The prompt budget of a step beside the ``decoding`` sequences, the share of it a long prompt gets (``paced``)
        and the most work a prompt may have to go in whole (``least``); ``queued``: the jobs waiting for admission.

        Shortest remaining work first. A long prompt (see ``least``) gets at most the pacer's step time per step (so
        that a request arriving waits one short step), and beside decoding requests only what stretches the step to
        --step-stretch decode steps: a long prompt never stalls a short request. Short prompts go in whole (many
        streams arriving together join the batch at once, as llama-server's would)."""
        alone = not decoding and len(prefilling) == 1 and not queued
        urgent = any(work_left(t, n_ctx) <= self.SHORT_WORK for t in (*decoding, *prefilling))
        budget, paced = self.budgets(budget, decoding=bool(decoding), alone=alone, urgent=urgent,
                                     prompt=len(prefilling[0].seq.tokens) if alone else 0)
        # short: a prompt that fits one chunk while nothing decodes (nobody waits on it), or beside decoders one no
        # longer than one step's worth of prompt work (the pacer's `short`, never less than its share `paced`) or
        # the least work a decoding request has left (so streams that arrive just after a first one join it
        # together at its next step, instead of one by one behind it: 8 short streams took 1.9 s to all start,
        # against 0.8 s with llama-server)
        least = max(self.short(budget), min(work_left(t, n_ctx) for t in decoding)) if decoding else budget
        return budget, paced, least

    def gather_s(self, prompt_tokens: int) -> float:
        """How long an idle engine about to start a step with a prompt of ``prompt_tokens`` waits for requests that
        clients sent together with them (an agent's parallel conversations) but that arrive a few milliseconds
        later: 0 unless the step is long (``GATHER_MIN_S``: a chat request's prompt on a small model here is 0.5 s of
        work, which starts at once), else ``GATHER_SHARE`` of it, at most ``GATHER_MAX_S``.
        A request that misses a long first step waits for it, and then for the pacing of its prompt beside the
        decoding ones; joined, they share one step (at 2,000 tokens of context here, four 60-token prompts cost
        about what one costs alone)."""
        if self.stretch <= 0 or not self.token_s:
            return 0.0
        # a prompt step also costs what does not grow with its tokens: over a long context (an agent's next turn on
        # 2,000 restored tokens) 10 tokens took 2.1 s, 57 took 2.5 s and four times 57 took 2.6 s here, where the
        # marginal cost said 0.9 s for 57 (and the others were paced in behind it one by one); the last prompt
        # step's cost stands for that part
        estimate = max(prompt_tokens * self.token_s, self.prompt_step_s)
        return 0.0 if estimate < self.GATHER_MIN_S else min(self.GATHER_MAX_S, self.GATHER_SHARE * estimate)

    def observe(self, seconds: float, n_decode: int, n_prefill: int) -> None:
        if n_prefill == 0:
            if n_decode:
                self.decode_s = seconds if not self.decode_s else 0.8 * self.decode_s + 0.2 * seconds
            return
        base = self.decode_s if n_decode else 0.0
        if n_decode and not base:
            return
        self.prompt_step_s = max(seconds - base, 0.0)
        per = self.prompt_step_s / n_prefill
        self.token_s = per if not self.token_s else 0.8 * self.token_s + 0.2 * per


def work_left(t: Any, n_ctx: int) -> int:
    """Tokens ``t`` has left to feed and generate (its prompt's rest, and up to max_tokens)."""
    seq = t.seq
    limit = min(n_ctx, t.stop_len)  # the context, or the prompt plus max_tokens (Ticket.stop_len)
    return (len(seq.tokens) - seq.n_cached) + max(0, limit - len(seq.tokens))
