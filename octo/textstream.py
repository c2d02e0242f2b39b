"""Incremental detokenization and stop strings matched across token boundaries.

Token bytes go through an incremental UTF-8 decoder, so a character split over two tokens is emitted
once whole. Text that could be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

import codecs

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


class TextStream:
    __slots__ = ("_decoder", "_stops", "_held", "_max_stop", "matched")

    def __init__(self, stops: list[str] | None = None) -> None:
        self._decoder = None  # an incremental UTF-8 decoder, from the first non-ASCII token on
        self._stops = [s for s in (stops or []) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended generation

    def push(self, data: bytes) -> tuple[str, bool]:
        """Add a token's bytes; return (text safe to emit, whether a stop string was hit)."""
        if self._decoder is None:
            if data.isascii():  # the common case, without the codec machinery
                text = data.decode("ascii")
            else:
                self._decoder = _Utf8Decoder("replace")
                text = self._decoder.decode(data)
        else:
            text = self._decoder.decode(data)
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.matched = i, stop
        if cut != -1:
            self._held = ""
            return buf[:cut], True
        keep = self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Everything still held back (called when generation ends for another reason than a stop)."""
        text = self._held + (self._decoder.decode(b"", final=True) if self._decoder is not None else "")
        self._held = ""
        return text

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
