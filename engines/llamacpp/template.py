"""Chat templates from GGUF metadata, rendered as Hugging Face transformers renders them (octo.chat_template)."""

from __future__ import annotations

from octo.chat_template import ChatTemplate

__all__ = ["ChatTemplate"]
