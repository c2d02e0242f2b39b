"""Tokenizer side of the MLX engine: encoding, token bytes and the chat template, from mlx-lm's tokenizer.

Encoding uses the fast tokenizer's ``tokenizers`` backend directly (thread-safe, so the serving layer may call
it from the event loop): one copy parses special-token text, a clone encodes it as plain text. Token bytes
follow the tokenizer's decoder, as mlx-lm's streaming detokenizers do: byte-level BPE (GPT-2 byte map),
SentencePiece (``▁`` is a space, ``<0xNN>`` a byte), else the token's decoded text.
"""

from __future__ import annotations

from typing import Any

from octo.errors import InvalidRequest
from octo.tokenbytes import TokenizerText


class TextCodec(TokenizerText):
    def __init__(self, wrapper: Any, n_vocab: int) -> None:
        """``wrapper``: mlx-lm's ``TokenizerWrapper``; ``n_vocab``: rows of the model's output layer."""
        self.wrapper = wrapper
        hf = wrapper._tokenizer
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(hf).__name__} has no fast (tokenizers) backend")
        super().__init__(backend, n_vocab)

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
