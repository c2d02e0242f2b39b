"""POST /tokenize and /detokenize (also under /v1): the served model's own tokenizer, in llama-server's shapes, with
vLLM's names accepted too, so clients of either work.

- tokenize: ``{"content": str, "add_special": false, "parse_special": true, "with_pieces": false, "model"?}``
  (llama-server) or ``{"prompt": str, "add_special_tokens": true, "model"?}`` (vLLM) -> ``{"tokens": [ids],
  "count": n, "max_model_len": n_ctx}``; with ``with_pieces`` each token is ``{"id", "piece"}`` (the piece as text,
  or its bytes as a list of integers when they are not UTF-8 by themselves).
- detokenize: ``{"tokens": [ids], "model"?}`` -> ``{"content": str, "prompt": str}`` (llama-server's and vLLM's key).
- GET /tokenizer_info (``?model=``; vLLM's): the tokenizer's configuration as vLLM serves it (``tokenizer_class``,
  ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ``add_bos_token``, ``model_max_length``,
  ``chat_template``), what lm-evaluation-harness's remote tokenizer (``tokenizer_backend=remote``) reads.

``add_special`` keeps what the engine adds to every prompt it tokenizes (the BOS of most llama.cpp models; engines on
Hugging Face tokenizers add none: their chat templates write it); without it those tokens are left out. Special
tokens show as their text (``<|im_start|>``) in pieces and detokenized text, as llama-server shows them.

The handlers run in the gateway; :func:`tokenize` and :func:`detokenize` run where the model is (this process, or
its worker: ``op_tokenize``), on the model's handle.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from octo.errors import InvalidRequest
from octo.protocol.openai import _Model, parse
from octo.server.routes import openai as api
from octo.server.state import STATE
from octo.serving.openai import check_token_ids
from octo.text.reasoning import template_source


class TokenizeRequest(_Model):
    content: str | None = None
    prompt: str | None = None  # vLLM's name for content
    model: str | None = None
    add_special: bool | None = None  # default false (llama-server), true when the text came as prompt (vLLM)
    add_special_tokens: bool | None = None  # vLLM's name for add_special
    parse_special: bool = True
    with_pieces: bool = False
    keep_alive: float | str | None = None


class DetokenizeRequest(_Model):
    tokens: list[int]
    model: str | None = None
    keep_alive: float | str | None = None


def add_routes(router: web.UrlDispatcher) -> None:
    # create_app adds /tokenize and /detokenize (llama-server's and vLLM's paths) as it does every /v1 alias
    router.add_post("/v1/tokenize", tokenize_route)
    router.add_post("/v1/detokenize", detokenize_route)
    router.add_get("/v1/tokenizer_info", tokenizer_info_route)


async def tokenize_route(request: web.Request) -> web.Response:
    req = parse(TokenizeRequest, await api._body(request))
    if req.content is not None and req.prompt is not None:
        raise InvalidRequest("Send the text as content or as prompt, not both.", param="prompt")
    if req.add_special is not None and req.add_special_tokens is not None:
        raise InvalidRequest("Send add_special or add_special_tokens, not both.", param="add_special_tokens")
    text = req.content if req.content is not None else req.prompt
    if text is None:
        raise InvalidRequest("content is required: the text to tokenize.", param="content")
    add_special = req.add_special if req.add_special is not None else req.add_special_tokens
    if add_special is None:
        add_special = req.prompt is not None  # each API's own default
    async with request.app[STATE].registry.use(req.model, req.keep_alive) as handle:
        return api.json_response(await handle.tokenize(text, add_special, req.parse_special, req.with_pieces))


async def detokenize_route(request: web.Request) -> web.Response:
    req = parse(DetokenizeRequest, await api._body(request))
    async with request.app[STATE].registry.use(req.model, req.keep_alive) as handle:
        text = await handle.detokenize(req.tokens)
    return api.json_response({"content": text, "prompt": text})


async def tokenizer_info_route(request: web.Request) -> web.Response:
    model = request.query.get("model")
    async with request.app[STATE].registry.use(model, None) as handle:
        return api.json_response(await handle.call("tokenizer_info", None))


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
