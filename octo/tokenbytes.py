"""The bytes each token of a Hugging Face ``tokenizers`` tokenizer stands for (an engine-side helper).

Engines that tokenize with ``tokenizers`` (onnx, mlx) stream generated tokens as bytes; this follows the
tokenizer's decoder as transformers' and mlx-lm's streaming detokenizers do: byte-level BPE (GPT-2 byte map),
SentencePiece (``▁`` is a space, ``<0xNN>`` a byte), else the token's decoded text. Special added tokens are
b"". Like ``octo.engine``, this module has no server dependencies, so engines may import it.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Any


def decoder_kind(tokenizer_json: str | dict) -> str:
    """"bytelevel", "spm" or "other", from a tokenizer.json text (or its parsed ``decoder`` section)."""
    data = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    decoder = (data.get("decoder") if "decoder" in data else data) or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "bytelevel"
    if "ByteFallback" in types or "Metaspace" in types or any(
        p.get("type") == "Replace" and (p.get("pattern") or {}).get("String") == "\u2581" for p in parts
    ):
        return "spm"
    return "other"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_byte_table(tok: Any, n_vocab: int, kind: str) -> list[bytes]:
    """Bytes of every token id below ``n_vocab`` for a ``tokenizers.Tokenizer`` ``tok`` (ids past it: b"")."""
    added = tok.get_added_tokens_decoder()
    byte_map = _unicode_to_byte()
    table: list[bytes] = []
    for i in range(n_vocab):
        piece = tok.id_to_token(i)
        if piece is None:  # rows past the tokenizer (padded output layers)
            table.append(b"")
        elif i in added:
            table.append(b"" if added[i].special else added[i].content.encode())
        elif kind == "bytelevel" and all(c in byte_map for c in piece):
            table.append(bytes(byte_map[c] for c in piece))
        elif kind == "spm" and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        elif kind == "spm":
            table.append(piece.replace("\u2581", " ").encode())
        else:
            table.append(tok.decode([i], skip_special_tokens=False).encode())
    return table


class TokenizerText:
    """Encoding and token bytes through one ``tokenizers`` Tokenizer, for engines whose models ship a
    ``tokenizer.json`` (the onnx and mlx engines derive their text codecs from it).

    ``tokenizers`` is thread-safe, so the serving layer may encode on the event loop: one copy parses special-token
    text (``<|im_start|>`` becomes its id), a clone encodes it as plain text. The byte table is built once, on first
    use, under a lock (0.5-1 s for 151,936 tokens)."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        from tokenizers import Tokenizer

        self.special_tokenizer = tokenizer
        self.plain_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.plain_tokenizer.encode_special_tokens = True
        self.n_vocab = max(n_vocab, tokenizer.get_vocab_size(with_added_tokens=True))
        self.kind = decoder_kind({"decoder": json.loads(tokenizer.to_str()).get("decoder") or {}})
        self.byte_table: list[bytes] | None = None
        self.table_lock = threading.Lock()

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        tok = self.special_tokenizer if special else self.plain_tokenizer
        return tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token: int) -> bytes:
        table = self.byte_table if self.byte_table is not None else self.table()
        return table[token] if 0 <= token < len(table) else b""

    def table(self) -> list[bytes]:
        with self.table_lock:
            if self.byte_table is None:
                self.byte_table = token_byte_table(self.special_tokenizer, self.n_vocab, self.kind)
        return self.byte_table

    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special added tokens (control tokens: their bytes are b"") by their text."""
        return {t.content: int(i) for i, t in self.special_tokenizer.get_added_tokens_decoder().items()
                if t.special and 0 <= int(i) < self.n_vocab}
