"""Speculative decoding with a draft model (``-o draft=PATH``, ``--draft``): a smaller model with the same vocabulary
proposes ``n_draft`` tokens per decoding sequence; the target model checks them all in the same batched decode and
keeps the longest run it would have produced itself, plus its own next token. A row stops drafting at the first token
the draft gives less than ``p_min`` probability (llama-server's ``--draft-p-min``): a draft that is unsure of its
proposals costs verification compute for tokens that are mostly rejected.

Exactness: at every drafted position the target samples with the sequence's own sampler chain, exactly as it would
without a draft, and a draft token is kept only when it equals that sample; so the output is the target's (greedy:
identical tokens; sampled: the same distribution), the draft only decides how many positions one step verifies.

The drafter keeps a KV sequence per target sequence id in a context of its own; before proposing it catches up with
the tokens the target accepted (dropping what the target rejected), so a sequence's prompt is prefilled once in the
draft too. Drafting is greedy (argmax of the draft's logits)."""

from __future__ import annotations

import ctypes
from typing import Any

from octo.errors import ConfigError

from .native import Batch, LogTap, check_gguf


class Drafter:
    def __init__(self, L: Any, path: str, target_vocab: Any, *, n_draft: int, max_batch: int, n_ctx: int,
                 n_threads: int, repack: bool, n_batch: int, p_min: float = 0.0) -> None:
        self._L = L
        self.n_draft = n_draft
        self.p_min = p_min
        model_path = check_gguf(path)
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack
        LogTap.recent.clear()
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise ConfigError(f"llama.cpp could not load the draft model {path}: {LogTap.tail() or 'no details'}",
                              param="draft")
        self.ctx = None
        try:
            self.vocab = L.llama_model_get_vocab(self.model)
            self._check_vocab(target_vocab, path)
            cp = L.llama_context_default_params()
            cp.n_ctx = n_ctx * max_batch
            cp.n_batch = cp.n_ubatch = n_batch
            cp.n_seq_max = max_batch
            cp.kv_unified = True
            cp.n_threads = cp.n_threads_batch = n_threads
            cp.no_perf = True
            self.ctx = L.llama_init_from_model(self.model, cp)
            if not self.ctx:
                raise ConfigError(f"llama.cpp could not create the draft model's context: {LogTap.tail()}",
                                  param="draft")
        except BaseException:
            self.close()
            raise
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = Batch(n_batch)
        self.cached: dict[int, list[int]] = {}  # target seq id -> the tokens in this sequence's draft KV
        self.proposed = 0  # draft tokens proposed
        self.accepted = 0  # of which the target kept

    def _check_vocab(self, target: Any, path: str) -> None:
        """The draft must spell every token as the target does (llama-server checks the same)."""
        L = self._L
        n_t, n_d = L.llama_vocab_n_tokens(target), L.llama_vocab_n_tokens(self.vocab)
        if n_t != n_d:
            raise ConfigError(f"The draft model {path} has a vocabulary of {n_d} tokens, the model {n_t}: speculative "
                              "decoding needs the same vocabulary.", param="draft")
        for name in ("bos", "eos"):
            a, b = getattr(L, f"llama_vocab_{name}")(target), getattr(L, f"llama_vocab_{name}")(self.vocab)
            if a != b:
                raise ConfigError(f"The draft model {path} has another {name.upper()} token ({b}, the model {a}).",
                                  param="draft")
        for t in range(n_t):
            if L.llama_vocab_get_text(target, t) != L.llama_vocab_get_text(self.vocab, t):
                raise ConfigError(f"The draft model {path} spells token {t} differently: speculative decoding needs "
                                  "the same vocabulary.", param="draft")

    def _logits_argmax(self, i: int) -> tuple[int, float]:
        """The draft's most likely next token at batch row ``i`` and its probability (1.0 when ``p_min`` is 0: not
        computed)."""
        import numpy as np
        ptr = self._L.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        tok = int(row.argmax())
        if self.p_min <= 0:
            return tok, 1.0
        return tok, float(1.0 / np.exp(row - row[tok]).sum())

    def _decode(self, rows: list[tuple[int, list[int], int]]) -> list[tuple[int, float]]:
        """Append ``tokens`` at ``pos`` to each ``(seq_id, tokens, pos)`` and return each row's argmax next token and
        its probability; rows longer than the batch are fed in chunks (the argmax is of the last chunk)."""
        b, L = self.batch, self._L
        out: dict[int, tuple[int, float]] = {}
        pending = [(sid, list(toks), pos) for sid, toks, pos in rows]
        while pending:
            n, take, last = 0, [], []
            for sid, toks, pos in pending:
                k = min(len(toks), b.capacity - n)
                if k <= 0:
                    break
                b.token[n:n + k] = toks[:k]
                b.pos[n:n + k] = range(pos, pos + k)
                b.seq[n:n + k] = sid
                b.logits[n:n + k] = 0
                if k == len(toks):
                    b.logits[n + k - 1] = 1
                    last.append((sid, n + k - 1))
                take.append((sid, toks[k:], pos + k))
                n += k
            b.struct.n_tokens = n
            if L.llama_decode(self.ctx, b.struct) != 0:
                raise RuntimeError("the draft model's decode failed")
            for sid, i in last:
                out[sid] = self._logits_argmax(i)
            pending = [r for r in take if r[1]] + pending[len(take):]
        return [out[sid] for sid, _, _ in rows]

    def propose(self, seqs: list[tuple[int, list[int]]], n_draft: list[int]) -> list[list[int]]:
        """Draft tokens for each ``(seq_id, tokens)`` (all its tokens, the last one not yet in the target's KV), at
        most ``n_draft[i]`` for row ``i``."""
        L = self._L
        drafts: list[list[int]] = [[] for _ in seqs]
        active, rows = [], []
        for i, (sid, tokens) in enumerate(seqs):
            if n_draft[i] <= 0:
                continue
            have = self.cached.get(sid, [])
            keep = 0
            limit = min(len(have), len(tokens) - 1)
            while keep < limit and have[keep] == tokens[keep]:
                keep += 1
            if keep < len(have):
                L.llama_memory_seq_rm(self.mem, sid, keep, -1)
            self.cached[sid] = list(tokens)
            active.append(i)
            rows.append((sid, tokens[keep:], keep))
        while rows:
            nxt = self._decode(rows)
            next_active, next_rows = [], []
            for i, (tok, p) in zip(active, nxt, strict=True):
                if p < self.p_min:  # not confident: verifying it would most likely be wasted (llama-server's p_min)
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < n_draft[i]:  # feed it to draft the next one
                    sid = seqs[i][0]
                    cached = self.cached[sid]
                    next_rows.append((sid, [tok], len(cached)))
                    cached.append(tok)
                    next_active.append(i)
            active, rows = next_active, next_rows
        self.proposed += sum(len(d) for d in drafts)
        return drafts

    def drop(self, seq_id: int) -> None:
        if self.cached.pop(seq_id, None) is not None:
            self._L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def close(self) -> None:
        L = self._L
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
