"""Constrained decoding on llguidance: JSON schemas, ``json_object``, regexes, Lark/GBNF grammars and tool calls.

One layer for every text engine (issue 13), in the order a request meets it:

- :class:`Vocab`: an engine's vocabulary (``token_bytes(id)``, ``n_vocab``, EOS ids) as an llguidance tokenizer.
  Special tokens (octo decodes them to b"") are never allowed in constrained output, except EOS once the output is
  complete and special tokens a grammar names by id (``[TOOL_CALLS]``). Building one holds the GIL (0.5-1 s for
  151,936 tokens), so :func:`vocab_for` caches it per engine and model; a worker should build it at load time.
- :class:`Constraint` (``octo.text.grammars``, with its checks and grammar text) says what to enforce;
  :func:`compile_constraint` checks it (an :class:`InvalidRequest` naming the request field, never a silently looser
  constraint) and compiles it for a vocabulary into a cached :class:`Grammar`.
  Call it off the event loop before admission, so a bad schema is a 400 before any stream byte.
- :class:`Matcher` (``grammar.matcher()``) follows one sequence: ``apply(logits)`` or ``fill(row)`` before sampling,
  ``accept(token)`` after; ``is_done()`` once nothing but EOS may follow (finish without sampling it).
  :func:`fill_masks` fills a batch's ``(batch, words)`` int32 bitmask, :func:`apply_bitmask` applies it to logits.

Threads: a matcher is used from one engine thread. llguidance computes masks with the GIL released
(``unsafe_compute_mask_ptr``; ``LLExecutor`` for a batch; checked: a Python thread kept ~70% of its speed while masks
were computed), so masks can be computed in a helper thread while a native forward pass runs. The executor's thread
pool pays off only for big batches on many cores (this busy 2-core host: 8 matchers 0.08 ms serially, 0.7 ms
through it), so :func:`fill_masks` goes parallel from 16 sequences on >4 cores.

Measured here (2 busy cores, llguidance 1.9.1) on a dense synthetic 151,936-token vocabulary (tests/test_constrain.py:
the 4k trained tokens plus generated words, CJK and punctuation; 9 bytes per token on average): tokenizer build
0.5-1.0 s (0.06 s for the 4k vocabulary padded to 151,936 rows, and for the tiny GGUF); compiling a 10-property
JSON schema 5 ms (1 ms again: cached); a matcher from it 0.04 ms. Next-token mask: median 0.02-0.05 ms, mean 0.3 ms
along a realistic document; random walks: median 0.02 ms, p99 1.8 ms, max 4.3 ms. Unbounded strings and numbers are
cheap thanks to llguidance's precomputed token "slices" (without them 4.5 ms inside strings); the 2-4 ms steps are
strings with ``maxLength``/``pattern``, which need a walk of the whole token trie. Accepting a token: 0.005 ms.
Applying a bitmask to a float32 logits row: 0.12 ms (bit operations, 5x faster than boolean indexing).

llguidance notes: ``LLMatcher`` never raises for grammar errors or forbidden tokens but enters an error state
(checked here); ``validate_tokens([eos])`` says 0 once the matcher is stopped although consuming EOS works; its
tokenizer has one EOS id (the others are mapped onto it here); the tokenize callback it wants (for forced tokens)
defaults here to llguidance's greedy tokenizer (``Engine.tokenize`` may add a BOS).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from octo.errors import InvalidRequest
from octo.logits import apply_bitmask  # noqa: F401 - re-exported: the engine-side half
from octo.text.grammars import JSON_WHITESPACE, Constraint, available, grammar_text, ll_grammar  # noqa: F401 - re-exported

if TYPE_CHECKING:  # (numpy is imported where it is used: not on the start-up's path)
    import numpy as np


# -- vocabulary -------------------------------------------------------------------------------------------------
class Vocab:
    """An engine vocabulary as an llguidance tokenizer. ``tokens[i]`` are the bytes of token ``i`` (b"" for special
    tokens); ``special_tokens`` optionally names control tokens (``{"[TOOL_CALLS]": 5}``) so grammars can ask for
    them; the first of ``eos_ids`` is llguidance's EOS, the others are allowed wherever it is."""

    def __init__(self, tokens: Sequence[bytes], eos_ids: Sequence[int], special_tokens: Mapping[str, int] | None = None,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        ll = ll_grammar()
        if not eos_ids:
            raise ValueError("a vocabulary for constrained decoding needs at least one EOS token id")
        self.n_vocab = len(tokens)
        self.words = (self.n_vocab + 31) // 32  # int32 words of one bitmask row
        self.eos_ids = tuple(dict.fromkeys(int(t) for t in eos_ids))
        self.eos = self.eos_ids[0]
        self.special = {name: int(i) for name, i in (special_tokens or {}).items()
                        if 0 <= int(i) < self.n_vocab and not tokens[int(i)]}
        table = list(tokens)
        for name, i in self.special.items():
            table[i] = b"\xff" + name.encode()  # llguidance's marker of a special token
        for i in self.eos_ids:
            table[i] = b""
        self.tokens = tokens
        self._by_bytes: dict[bytes, int] | None = None
        holder: list[Any] = []

        class _Wrapped:  # what llguidance.TokenizerWrapper reads
            eos_token_id = self.eos
            bos_token_id = None
            special_token_ids: list[int] = []

            def __call__(self, text: str) -> list[int]:
                return tokenize(text) if tokenize else holder[0].greedy_tokenize(text)

        _Wrapped.tokens = table
        self.ll = ll.LLTokenizer(ll.TokenizerWrapper(_Wrapped()))
        holder.append(self.ll)

    def token_for(self, text: str) -> tuple[int, bool] | None:
        """(id, is_special) of the single token spelling ``text``: a named special token or a token with those bytes."""
        if text in self.special:
            return self.special[text], True
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, b in enumerate(self.tokens):
                self._by_bytes.setdefault(b, i)
        i = self._by_bytes.get(text.encode())
        return (i, False) if i is not None and text else None

    def new_bitmask(self, batch: int = 1) -> np.ndarray:
        """An all-allowed ``(batch, words)`` int32 bitmask (bit ``t % 32`` of word ``t // 32`` is token ``t``)."""
        import numpy as np
        return np.full((batch, self.words), -1, dtype=np.int32)

    def _extend_eos(self, row: np.ndarray) -> None:
        """Allow every EOS id where llguidance allows its one EOS."""
        import numpy as np
        if len(self.eos_ids) > 1 and (row[self.eos >> 5] >> (self.eos & 31)) & 1:
            for t in self.eos_ids[1:]:
                row.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))


_VOCABS: OrderedDict[bytes, Vocab] = OrderedDict()
_VOCAB_LOCK = threading.Lock()
_ENGINE_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BUILD_LOCK = threading.Lock()


def build_vocab(token_bytes: Callable[[int], bytes] | Sequence[bytes], n_vocab: int, eos_ids: Sequence[int],
                special_tokens: Mapping[str, int] | None = None,
                tokenize: Callable[[str], list[int]] | None = None) -> Vocab:
    """A :class:`Vocab` for ``n_vocab`` tokens, shared by every caller with the same vocabulary (content-hashed)."""
    tokens = [bytes(token_bytes(i)) for i in range(n_vocab)] if callable(token_bytes) else list(token_bytes)
    if len(tokens) != n_vocab:
        tokens = (tokens + [b""] * n_vocab)[:n_vocab]
    h = hashlib.blake2b(digest_size=20)
    for t in tokens:
        h.update(len(t).to_bytes(4, "little") + t)
    h.update(json.dumps([sorted(eos_ids), sorted((special_tokens or {}).items())]).encode())
    key = h.digest()
    with _VOCAB_LOCK:
        vocab = _VOCABS.get(key)
        if vocab is None or tokenize is not None:
            vocab = Vocab(tokens, eos_ids, special_tokens, tokenize)
            _VOCABS[key] = vocab
            while len(_VOCABS) > 4:
                _VOCABS.popitem(last=False)
        _VOCABS.move_to_end(key)
        return vocab


def vocab_built(engine: Any) -> bool:
    """Whether :func:`vocab_for` has the vocabulary of ``engine``'s loaded model already."""
    cached = _ENGINE_VOCABS.get(engine)
    return cached is not None and cached[0] is engine.info


def vocab_for(engine: Any, token_bytes: Callable[[int], bytes] | None = None) -> Vocab:
    """The :class:`Vocab` of a loaded engine (cached on the engine until it loads another model). Uses
    ``engine.token_bytes`` (or ``token_bytes``, which may raise to stop the build), ``engine.info.n_vocab`` and
    ``eos_token_ids``, and ``engine.special_tokens()`` (name -> id of control tokens) when the engine has that
    optional method."""
    info = engine.info
    cached = _ENGINE_VOCABS.get(engine)
    if cached is not None and cached[0] is info:
        return cached[1]
    with _BUILD_LOCK:  # a background build at load and a first request: one builds, the other waits for it
        cached = _ENGINE_VOCABS.get(engine)
        if cached is not None and cached[0] is info:
            return cached[1]
        special = engine.special_tokens() if callable(getattr(engine, "special_tokens", None)) else None
        vocab = build_vocab(token_bytes or engine.token_bytes, info.n_vocab, sorted(info.eos_token_ids), special)
        _ENGINE_VOCABS[engine] = (info, vocab)
    return vocab

# -- compiled grammars and matchers ---------------------------------------------------------------------------------
class Grammar:
    """A constraint compiled for one vocabulary; ``matcher()`` starts a sequence (a copy of a ready matcher)."""

    def __init__(self, vocab: Vocab, text: str, template: Any) -> None:
        self.vocab, self.text, self._template = vocab, text, template
        self._lock = threading.Lock()

    def matcher(self) -> Matcher:
        with self._lock:
            return Matcher(self._template.deep_copy(), self.vocab)


_GRAMMARS: OrderedDict[tuple[int, str], Grammar] = OrderedDict()
_GRAMMAR_LOCK = threading.Lock()
GRAMMAR_CACHE_SIZE = 64


def compile_constraint(c: Constraint, vocab: Vocab) -> Grammar:
    """Check and compile ``c`` for ``vocab`` (cached per vocabulary and grammar). Raises :class:`InvalidRequest`."""
    ll = ll_grammar()
    text = grammar_text(c, vocab)
    key = (id(vocab), text)
    with _GRAMMAR_LOCK:
        hit = _GRAMMARS.get(key)
        if hit is not None and hit.vocab is vocab:
            _GRAMMARS.move_to_end(key)
            return hit
    template = ll.LLMatcher(vocab.ll, text, log_level=0)  # compiles (GIL released)
    if template.is_error():
        raise InvalidRequest(f"Invalid {c.kind.replace('_', ' ')} in {c.param}: {_first_line(template.get_error())}",
                             param=c.param)
    grammar = Grammar(vocab, text, template)
    with _GRAMMAR_LOCK:
        _GRAMMARS[key] = grammar
        while len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
            _GRAMMARS.popitem(last=False)
    return grammar


def _first_line(error: str) -> str:
    return error.strip().split("\n")[0][:500]


class Matcher:
    """The constraint state of one sequence. Per step: ``fill(row)`` or ``apply(logits)`` before sampling, then
    ``accept(token)``. Not thread-safe (one engine thread uses it)."""

    __slots__ = ("_m", "vocab", "_row", "_fresh", "n_tokens")

    def __init__(self, ll_matcher: Any, vocab: Vocab) -> None:
        import numpy as np
        self._m = ll_matcher
        self.vocab = vocab
        self._row = np.empty(vocab.words, dtype=np.int32)
        self._fresh = False  # _row holds the mask of the current state
        self.n_tokens = 0

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask of the next token into ``row`` (``vocab.words`` C-contiguous int32)."""
        import numpy as np
        if row.dtype != np.int32 or row.shape != (self.vocab.words,) or not row.flags.c_contiguous:
            raise ValueError(f"bitmask row must be C-contiguous int32 of shape ({self.vocab.words},)")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.vocab._extend_eos(row)
        if row is not self._row:
            self._row[:] = row
        self._fresh = True

    def bitmask(self) -> np.ndarray:
        """The next token's bitmask (an internal buffer, valid until the next call)."""
        if not self._fresh:
            self.fill(self._row)
        return self._row

    def mask(self) -> np.ndarray:
        """The next token's allowed tokens as a bool array of ``n_vocab``."""
        import numpy as np
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little", count=self.vocab.n_vocab)
        return bits.view(bool)

    def allowed_tokens(self) -> np.ndarray:
        import numpy as np
        return np.flatnonzero(self.mask())

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Set the logits of forbidden tokens to -inf, in place (a 1-D row of at least ``n_vocab``); returns it."""
        apply_bitmask(logits, self.bitmask())
        return logits

    def accept(self, token: int) -> bool:
        """Advance by the sampled ``token``. False (and no change) when the constraint forbids it."""
        token = int(token)
        if token in self.vocab.eos_ids:
            token = self.vocab.eos
            if not self._m.is_accepting():  # (validate_tokens says 0 for EOS once the matcher is stopped)
                return False
        elif self._fresh:
            if not 0 <= token < self.vocab.n_vocab or not (self._row[token >> 5] >> (token & 31)) & 1:
                return False
        elif self._m.validate_tokens([token]) != 1:
            return False
        if not self._m.consume_token(token):
            return False
        self._fresh = False
        self.n_tokens += 1
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Advance by as many of ``tokens`` as the constraint allows; returns how many."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding, stop strings that cut tokens)."""
        if n < 0 or n > self.n_tokens:
            raise ValueError(f"cannot roll back {n} tokens (accepted {self.n_tokens})")
        if n and not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back: {self._m.get_error()}")
        self.n_tokens -= n
        self._fresh = False

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint forces from here (feed them without sampling, then ``accept_tokens`` them)."""
        return list(self._m.compute_ff_tokens())

    def forced_bytes(self) -> bytes:
        return bytes(self._m.compute_ff_bytes())

    def accepting(self) -> bool:
        """Whether the output could end here (EOS is allowed)."""
        return bool(self._m.is_accepting())

    def is_done(self) -> bool:
        """Nothing but EOS can follow (the output is complete, or the matcher is in error): finish the sequence."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None

    def copy(self) -> Matcher:
        """An independent matcher in the same state (``n`` > 1 choices sharing a prompt)."""
        other = Matcher(self._m.deep_copy(), self.vocab)
        other.n_tokens = self.n_tokens
        return other


# -- batches ----------------------------------------------------------------------------------------------------
PARALLEL_MIN = 16
_EXECUTOR: Any = None


def fill_masks(matchers: Sequence[Matcher | None], out: np.ndarray | None = None,
               parallel: bool | None = None) -> np.ndarray:
    """Bitmasks of a batch into ``out`` (``(len(matchers), words)`` int32; allocated when None): row ``i`` is
    matcher ``i``'s mask, all-allowed where the matcher is None. ``parallel`` uses llguidance's thread pool
    (default: from :data:`PARALLEL_MIN` sequences up, on hosts with more than 4 cores)."""
    import numpy as np
    live = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if out is None:
        words = live[0][1].vocab.words if live else 1
        out = np.full((len(matchers), words), -1, dtype=np.int32)
    if parallel is None:
        parallel = len(live) >= PARALLEL_MIN and (os.cpu_count() or 1) > 4
    for i, m in enumerate(matchers):
        if m is None:
            out[i] = -1
    if parallel and live:
        global _EXECUTOR
        with _VOCAB_LOCK:
            if _EXECUTOR is None:
                _EXECUTOR = ll_grammar().LLExecutor()
        if not out.flags.c_contiguous or out.dtype != np.int32:
            raise ValueError("bitmask must be C-contiguous int32")
        _EXECUTOR.unsafe_compute_mask_ptr([(m._m, i) for i, m in live], out.ctypes.data, out.shape[1] * 4,
                                          out.shape[0])
        for i, m in live:
            m.vocab._extend_eos(out[i])
            m._row[:] = out[i]
            m._fresh = True
    else:
        for i, m in live:
            m.fill(out[i])
    return out
