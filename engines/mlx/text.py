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
from octo.tokenbytes import decoder_kind, token_byte_table


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
        self.kind = decoder_kind({"decoder": decoder})

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
        return token_byte_table(self._special, self.n_vocab, self.kind)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template through the Hugging Face tokenizer's ``apply_chat_template`` (``tools`` becomes the
        template's ``tools`` variable)."""
        from jinja2.exceptions import TemplateError

        if not self.wrapper.has_chat_template:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="messages")
        try:
            return self.wrapper.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as e:
            raise InvalidRequest(f"The model's chat template rejected the messages: {e}", param="messages") from None

    def chat_template(self) -> str | None:
        """The Jinja source of the tokenizer's chat template (a named set: its "default"), or None."""
        source = getattr(self.wrapper._tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default")
        return source if isinstance(source, str) else None

    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special added tokens (control tokens: their bytes are b"") by their text."""
        return {
            t.content: int(i)
            for i, t in self._special.get_added_tokens_decoder().items()
            if t.special and 0 <= int(i) < self.n_vocab
        }
