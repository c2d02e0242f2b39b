"""Reasoning text (the ``<think>...</think>`` of models whose chat template reasons) kept apart from the answer: a
streaming splitter used by the worker for chat (``reasoning_content``, ``--reasoning-format``) and by the Anthropic
surface (``thinking`` blocks). Server-free: engines' templates are read through ``Engine.chat_template()``."""

from __future__ import annotations

from typing import Any


def template_source(engine: Any) -> str:
    try:
        return engine.chat_template() or ""
    except Exception:  # noqa: BLE001 - an engine without the method's data: no template
        return ""


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an opened ``<think>`` block (templates that start the answer thinking)."""
    tail = prompt.rstrip()
    return tail.endswith(ThinkSplitter.OPEN)


def supports_thinking(engine: Any) -> bool:
    """Whether the model's chat template has a reasoning mode (it mentions ``enable_thinking`` or ``<think>``).
    Cached on the engine for its loaded model (``engine.info``): every chat request asks."""
    info = getattr(engine, "info", None)
    cached = getattr(engine, "_octo_thinks", None)
    if cached is not None and info is not None and cached[0] is info:
        return cached[1]
    source = template_source(engine)
    thinks = "enable_thinking" in source or "<think>" in source
    if info is not None:
        try:
            engine._octo_thinks = (info, thinks)
        except AttributeError:  # an engine with __slots__: asked every time
            pass
    return thinks


class ThinkSplitter:
    """Splits generated text into ("thinking", str) and ("text", str) pieces: ``<think>...</think>`` at the start of
    the answer is thinking. Without an opening tag, text before a ``</think>`` is thinking too (templates that open the
    block in the prompt), so such text is held until a closing tag or the end decides it. Pieces are emitted as soon as
    they are decided; a partial tag is held."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, opened: bool | None = None) -> None:
        """``opened``: whether the prompt ends inside an opened ``<think>`` block (True: the answer starts as thinking;
        False: only an answer that opens the block itself thinks, anything else is text at once, so a stream is not
        held; None: not known, text before a ``</think>`` is thinking)."""
        self.state = "lead" if opened else "start"  # start -> (lead -> think | maybe) -> after -> text
        self.opened = opened
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.OPEN):
                    self.buf, self.state = stripped[len(self.OPEN):], "lead"
                    continue
                if self.OPEN.startswith(stripped):
                    break  # whitespace, or a tag still arriving
                self.state = "maybe" if self.opened is None else "text"
                if self.state == "text":
                    continue
            if self.state == "lead":  # whitespace after the opening tag is not thinking
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "think"
            if self.state in ("think", "maybe"):
                k = self.buf.find(self.CLOSE)
                if k >= 0:
                    if self.buf[:k]:
                        out.append(("thinking", self.buf[:k]))
                    self.buf, self.state = self.buf[k + len(self.CLOSE):], "after"
                    continue
                if self.state == "maybe":
                    break
                keep = next((n for n in range(min(len(self.buf), len(self.CLOSE) - 1), 0, -1)
                             if self.CLOSE.startswith(self.buf[-n:])), 0)
                if len(self.buf) > keep:
                    out.append(("thinking", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "text":
                out.append(("text", self.buf))
                self.buf = ""
                break
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "text"
            out.append(("text", self.buf))
            self.buf = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        """Decide what is held as if the text ended here (before a tool call); the text may go on after it."""
        buf, self.buf = self.buf, ""
        if self.state == "think":
            return [("thinking", buf)] if buf else []
        if self.state in ("start", "maybe"):
            self.state = "text"
        return [("text", buf)] if buf.strip() else []

    def finish(self) -> list[tuple[str, str]]:
        return self.flush()


def split_thinking(text: str, opened: bool | None = None) -> tuple[str | None, str]:
    """(the thinking, or None, and the rest) of a whole answer."""
    s = ThinkSplitter(opened)
    thinking, rest = [], []
    for kind, piece in s.feed(text) + s.finish():
        (thinking if kind == "thinking" else rest).append(piece)
    return ("".join(thinking) if thinking else None), "".join(rest)
