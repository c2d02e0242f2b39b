"""Hugging Face chat templates for engine plugins: the Jinja environment transformers renders them in.

The same environment as ``transformers.utils.chat_template_utils._compile_jinja_template``: a sandboxed
environment with ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, a pass-through
``{% generation %}`` tag, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII
characters. The template sees ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt`` and whatever
variables the engine passes (``tools``, ``documents``...). Part of the plugin surface: an engine whose model ships
a Jinja chat template renders it with :class:`ChatTemplate` (see docs/engines.md).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from octo.errors import InvalidRequest


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
           sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: non-ASCII characters stay as they are."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class ChatTemplate:
    """A chat template compiled once; :meth:`render` turns a template error into a 400 naming ``messages``."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):  # transformers' AssistantTracker, minus the mask bookkeeping
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.compiled = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                        **variables)
        except TemplateError as e:
            raise InvalidRequest(f"The model's chat template rejected the messages: {e}", param="messages") from None
