"""Tokenizer side of the MLX engine: encoding, token bytes and the chat template, from mlx-lm's tokenizer.

Encoding uses the fast tokenizer's ``tokenizers`` backend directly (thread-safe, so the serving layer may call
it from the event loop): one copy parses special-token text, a clone encodes it as plain text. Token bytes
follow the tokenizer's decoder, as mlx-lm's streaming detokenizers do: byte-level BPE (GPT-2 byte map),
SentencePiece (``▁`` is a space, ``<0xNN>`` a byte), else the token's decoded text.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from octo.errors import InvalidRequest


class TextCodec:
    def __init__(self, wrapper: Any, n_vocab: int) -> None:
        """``wrapper``: mlx-lm's ``TokenizerWrapper``; ``n_vocab``: rows of the model's output layer."""
        from tokenizers import Tokenizer

        self.wrapper = wrapper
        hf = wrapper._tokenizer
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(hf).__name__} has no fast (tokenizers) backend")
        self._special = backend
        self._plain = Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self.n_vocab = max(n_vocab, backend.get_vocab_size(with_added_tokens=True))
        self._bytes: list[bytes] | None = None
        self._lock = threading.Lock()
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        self.kind = _decoder_kind(decoder)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        tok = self._special if special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token: int) -> bytes:
        table = self._bytes if self._bytes is not None else self._table()
        return table[token] if 0 <= token < len(table) else b""

    def _table(self) -> list[bytes]:
        with self._lock:
            if self._bytes is None:
                self._bytes = self._build_table()
        return self._bytes

    def _build_table(self) -> list[bytes]:
        from mlx_lm.tokenizer_utils import _byte_decoder

        backend = self._special
        added = backend.get_added_tokens_decoder()
        byte_map = _byte_decoder()
        table: list[bytes] = []
        for i in range(self.n_vocab):
            piece = backend.id_to_token(i)
            if piece is None:  # rows past the tokenizer (padded output layers)
                table.append(b"")
            elif i in added:
                table.append(b"" if added[i].special else added[i].content.encode())
            elif self.kind == "bytelevel" and all(c in byte_map for c in piece):
                table.append(bytes(byte_map[c] for c in piece))
            elif self.kind == "spm" and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table.append(bytes([int(piece[3:5], 16)]))
            elif self.kind == "spm":
                table.append(piece.replace("\u2581", " ").encode())
            else:
                table.append(backend.decode([i], skip_special_tokens=False).encode())
        return table

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.wrapper.has_chat_template:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="messages")
        return self.wrapper.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _decoder_kind(decoder: dict) -> str:
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "bytelevel"
    if (
        "ByteFallback" in types
        or "Metaspace" in types
        or any(p.get("type") == "Replace" and p.get("pattern", {}).get("String") == "\u2581" for p in parts)
    ):
        return "spm"
    return "other"
