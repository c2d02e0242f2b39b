"""POST /tokenize and /detokenize, the model side: they run where the model is (this process or its worker), on
its handle; the routes are octo.server.routes.tokens."""

from __future__ import annotations

from typing import Any

from octo.errors import InvalidRequest
from octo.serving.openai import check_token_ids
from octo.text.reasoning import template_source


# -- model side (a ModelHandle: in the gateway or in the model's worker process) -------------------------------
def tokenize(handle: Any, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> dict[str, Any]:
    engine = handle.engine
    try:
        tokens = list(engine.tokenize(text, special=parse_special))
        added = [] if add_special else list(engine.tokenize("", special=False))  # what it adds to every text
        probe = list(engine.tokenize("x", special=False)) if added else []
    except NotImplementedError:
        raise _no_tokenizer(handle) from None
    names: dict[int, str] | None = None
    if added:
        names = _special_names(engine)
        k = 0  # added = head (BOS: what "x" starts with too) + tail (the EOS a few models add)
        while k < len(added) and k < len(probe) and added[k] == probe[k]:
            k += 1
        tokens = _strip_added(tokens, added[:k], added[k:], text if parse_special else "", names)
    out: list[Any] = tokens
    if with_pieces:
        names = names if names is not None else _special_names(engine)
        out = [{"id": t, "piece": _piece(engine.token_bytes(t), t, names)} for t in tokens]
    return {"tokens": out, "count": len(tokens), "max_model_len": handle.info.n_ctx or None}


def detokenize(handle: Any, tokens: list[int]) -> str:
    if not tokens:
        return ""
    check_token_ids(tokens, handle.info.n_vocab, "tokens", handle.engine)
    engine, names, parts = handle.engine, None, []
    try:
        for t in tokens:
            piece = engine.token_bytes(t)
            if not piece:  # a special token: its text
                names = names if names is not None else _special_names(engine)
                piece = names.get(t, "").encode()
            parts.append(piece)
    except NotImplementedError:
        raise _no_tokenizer(handle) from None
    return b"".join(parts).decode("utf-8", "replace")


def _no_tokenizer(handle: Any) -> InvalidRequest:
    return InvalidRequest(f"Model '{handle.name}' ({handle.engine_name}) has no text tokenizer.", param="model",
                          code="unsupported_task")


def _special_names(engine: Any) -> dict[int, str]:
    try:
        return {tok: name for name, tok in engine.special_tokens().items()}
    except Exception:  # noqa: BLE001 - optional for an engine; without it special tokens have no text
        return {}


def _strip_added(tokens: list[int], head: list[int], tail: list[int], special_text: str,
                 names: dict[int, str]) -> list[int]:
    """``tokens`` without the engine's own additions at the start (``head``: BOS) and at the end (``tail``). A head
    the text itself starts with, written as special-token text (``special_text``: the text when special tokens were
    parsed; llama.cpp does not double a BOS), is the text's own and stays."""
    if head and tokens[:len(head)] == head and not (special_text and names.get(head[0])
                                                    and special_text.startswith(names[head[0]])):
        tokens = tokens[len(head):]
    if tail and tokens[-len(tail):] == tail:
        tokens = tokens[:-len(tail)]
    return tokens


def _piece(data: bytes, token: int, names: dict[int, str]) -> str | list[int]:
    if not data:
        return names.get(token, "")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def tokenizer_info(handle: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info of the served model: its special tokens as text, whether it adds a BOS to every text,
    its context length and chat template. The pad token is the EOS (octo pads nothing: as most causal LMs)."""
    engine = handle.engine
    try:
        added = list(engine.tokenize("", special=False))
    except NotImplementedError:
        raise _no_tokenizer(handle) from None
    names = _special_names(engine)
    eos_ids = sorted(handle.info.eos_token_ids)
    eos = names.get(eos_ids[0]) or _text(engine, eos_ids[0]) if eos_ids else None
    bos = names.get(added[0]) or _text(engine, added[0]) if added else None
    unk = next((n for n in ("<unk>", "[UNK]") if n in names.values()), None)
    return {"tokenizer_class": f"{type(engine).__name__}Tokenizer", "bos_token": bos, "eos_token": eos,
            "pad_token": eos, "unk_token": unk, "add_bos_token": bool(added),
            "model_max_length": handle.info.n_ctx or None, "chat_template": template_source(engine) or None}


def _text(engine: Any, token: int) -> str | None:
    return engine.token_bytes(token).decode("utf-8", "replace") or None
