"""Incremental detokenization and stop strings matched across token boundaries.

Token bytes go through an incremental UTF-8 decoder, so a character split over two tokens is emitted
once whole. Text that could be the start of a stop string is held back until it is known not to be.

Stop matching is linear in the generated text: each stop string keeps a Knuth-Morris-Pratt state (the
length of the longest suffix of the text so far that is a prefix of the stop), advanced over the new
characters only, so a push costs O(new characters x stops) amortised, however long the stops or the
text held back. The stop that completes first in the text wins (the longest one when several complete
at the same character), whatever the token boundaries.
"""

from __future__ import annotations

import codecs
from functools import lru_cache

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


@lru_cache(maxsize=256)
def _links(stop: str) -> tuple[int, ...]:
    """Knuth's strong failure links: ``links[q]`` is where the matcher of ``stop`` goes from state ``q`` (``q``
    characters matched) on a character other than ``stop[q]``: the longest proper border of ``stop[:q]`` whose next
    character is not ``stop[q]`` either (so a mismatch follows O(log len(stop)) links, not up to len(stop))."""
    n = len(stop)
    fail = [0] * n  # fail[i]: the longest proper border of stop[:i + 1]
    k = 0
    for i in range(1, n):
        c = stop[i]
        while k and stop[k] != c:
            k = fail[k - 1]
        if stop[k] == c:
            k += 1
        fail[i] = k
    links = [0] * n
    for q in range(1, n):
        b = fail[q - 1]
        links[q] = links[b] if b and stop[b] == stop[q] else b
    return tuple(links)


def _advance(stop: str, links: tuple[int, ...], state: int, text: str) -> tuple[int, int]:
    """Feed ``text`` to the matcher of ``stop`` in ``state``: (new state, index in ``text`` of the character that
    completes the first match, or -1)."""
    n, first = len(stop), stop[0]
    i, end = 0, len(text)
    while i < end:
        if state == 0:  # nothing partly matched: jump to the next place the stop can start (C speed)
            i = text.find(first, i)
            if i == -1:
                return 0, -1
        c = text[i]
        while state and stop[state] != c:
            state = links[state]
        if stop[state] == c:
            state += 1
            if state == n:  # generation ends at a stop: no need to go on matching
                return 0, i
        i += 1
    return state, -1


class TextStream:
    __slots__ = ("_decoder", "_stops", "_links", "_states", "_held", "matched")

    def __init__(self, stops: list[str] | None = None) -> None:
        self._decoder = None  # an incremental UTF-8 decoder, from the first non-ASCII token on
        if stops:
            self._stops = list(dict.fromkeys(s for s in stops if s))
            self._links = [_links(s) for s in self._stops]
            self._states = [0] * len(self._stops)
        else:  # most requests (one per sequence): nothing to build
            self._stops = self._links = self._states = ()
        self._held = ""  # the longest suffix of the text that is a proper prefix of a stop: not emitted yet
        self.matched: str | None = None  # the stop string that ended generation

    def push(self, data: bytes, can_stop: bool = True) -> tuple[str, bool]:
        """Add a token's bytes; return (text safe to emit, whether a stop string was hit). With ``can_stop`` false
        (``min_tokens`` not reached yet) a stop string that completes is text like any other."""
        if self._decoder is None:
            if data.isascii():  # the common case, without the codec machinery
                text = data.decode("ascii")
            else:
                self._decoder = _Utf8Decoder("replace")
                text = self._decoder.decode(data)
        else:
            text = self._decoder.decode(data)
        if not self._stops or not text:
            return text, False
        best_end, best = -1, -1
        states = self._states
        for k, stop in enumerate(self._stops):
            states[k], end = _advance(stop, self._links[k], states[k], text)
            while end != -1 and not can_stop:  # not yet: match on after it
                states[k], nxt = _advance(stop, self._links[k], 0, text[end + 1:])
                end = -1 if nxt == -1 else end + 1 + nxt
            if end != -1 and (best_end == -1 or end < best_end
                              or (end == best_end and len(stop) > len(self._stops[best]))):
                best_end, best = end, k
        buf = self._held + text
        if best != -1:
            stop = self._stops[best]
            self.matched = stop
            self._held = ""
            return buf[: len(buf) - len(text) + best_end + 1 - len(stop)], True
        keep = max(states)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Everything still held back (called when generation ends for another reason than a stop)."""
        text = self._held + (self._decoder.decode(b"", final=True) if self._decoder is not None else "")
        self._held = ""
        self._states = [0] * len(self._stops)
        return text
