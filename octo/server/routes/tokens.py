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

from aiohttp import web

from octo.errors import InvalidRequest
from octo.protocol.openai import Model, parse
from octo.server.routes import openai as api
from octo.server.state import STATE


class TokenizeRequest(Model):
    content: str | None = None
    prompt: str | None = None  # vLLM's name for content
    model: str | None = None
    add_special: bool | None = None  # default false (llama-server), true when the text came as prompt (vLLM)
    add_special_tokens: bool | None = None  # vLLM's name for add_special
    parse_special: bool = True
    with_pieces: bool = False
    keep_alive: float | str | None = None


class DetokenizeRequest(Model):
    tokens: list[int]
    model: str | None = None
    keep_alive: float | str | None = None


def add_routes(router: web.UrlDispatcher) -> None:
    # create_app adds /tokenize and /detokenize (llama-server's and vLLM's paths) as it does every /v1 alias
    router.add_post("/v1/tokenize", tokenize_route)
    router.add_post("/v1/detokenize", detokenize_route)
    router.add_get("/v1/tokenizer_info", tokenizer_info_route)


async def tokenize_route(request: web.Request) -> web.Response:
    req = parse(TokenizeRequest, await api.json_body(request))
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
    req = parse(DetokenizeRequest, await api.json_body(request))
    async with request.app[STATE].registry.use(req.model, req.keep_alive) as handle:
        text = await handle.detokenize(req.tokens)
    return api.json_response({"content": text, "prompt": text})


async def tokenizer_info_route(request: web.Request) -> web.Response:
    model = request.query.get("model")
    async with request.app[STATE].registry.use(model, None) as handle:
        return api.json_response(await handle.call("tokenizer_info", None))
















