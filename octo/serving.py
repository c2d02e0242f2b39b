"""Serving layer: protocol requests -> GenerationRequest, and results -> response bodies. No aiohttp here.

Every parameter a request sets is either turned into engine/scheduler settings or refused with a 400
naming it; nothing is silently dropped.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from octo.engine import SamplingParams, Task
from octo.errors import ContextLengthExceeded, InvalidRequest, UnsupportedParameter
from octo.jobs import GenerationRequest, Result
from octo.protocol import (
    MAX_EMBEDDING_CHARS,
    MAX_EMBEDDING_INPUTS,
    MAX_EMBEDDING_TOKENS,
    AnthropicRequest,
    ChatCompletionRequest,
    CompletionRequest,
    TextBlock,
    TextPart,
)

# SamplingParams field -> the request parameter a user would recognise
_PARAM_NAMES = {"json_schema": "response_format", "repetition_penalty": "repetition_penalty"}


_ID_PREFIX = uuid.uuid4().hex[:12]
_id_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """Unique response id: a per-process random part and a counter (no syscall per request)."""
    return f"{prefix}-{_ID_PREFIX}{next(_id_counter):012x}"


def _unsupported_if(req: Any, names: tuple[str, ...], why: str = "") -> None:
    given = req.model_fields_set  # only what the request sent can be set
    for name in names:
        if name in given and getattr(req, name) not in (None, False, [], {}):
            raise UnsupportedParameter(name, why)


_PLAIN_SAMPLING = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
# every request field sampling_params reads: a request that sets none of them gets the defaults at once
_SAMPLING_FIELDS = frozenset({"temperature", "top_p", *_PLAIN_SAMPLING, "logit_bias", "response_format"})


def sampling_params(req: Any, engine: Any, n_vocab: int = 0) -> SamplingParams:
    """SamplingParams from an OpenAI-style request; 400 for what the engine cannot honour."""
    sp = SamplingParams()
    if not req.model_fields_set.intersection(_SAMPLING_FIELDS):
        return sp  # the request sets no sampling parameter
    if req.temperature is not None:
        sp.temperature = float(req.temperature)
    if req.top_p is not None:
        sp.top_p = float(req.top_p)
    for name in _PLAIN_SAMPLING:
        value = getattr(req, name, None)
        if value is not None:
            setattr(sp, name, value)
    if sp.seed is not None:
        sp.seed &= 2**63 - 1  # any int64, as OpenAI's API takes it; engines see a non-negative int64
    if getattr(req, "logit_bias", None):
        bias = {}
        for key, value in req.logit_bias.items():
            tok = int(key)
            if tok < 0 or (n_vocab and tok >= n_vocab):
                raise InvalidRequest(f"logit_bias: token id {tok} is outside the vocabulary (0..{n_vocab - 1}).",
                                     param="logit_bias")
            bias[tok] = float(value)
        sp.logit_bias = bias
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            sp.json_schema = {}
        else:
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object.",
                                     param="response_format.json_schema.schema")
            sp.json_schema = schema
    for name in sorted(sp.changed()):
        if name not in engine.sampling_params:
            raise UnsupportedParameter(_PARAM_NAMES.get(name, name), f"the {engine.name} engine cannot honour it")
    return sp


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_stream_options(req: Any) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")


def _require(handle: Any, task: Task) -> None:
    if task not in handle.tasks:
        raise InvalidRequest(
            f"Model '{handle.name}' ({handle.engine_name}) does not support {task.value}; it serves: "
            f"{', '.join(sorted(t.value for t in handle.tasks))}.", param="model", code="unsupported_task")


# -- chat ----------------------------------------------------------------------------------------------
def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages -> plain {role, content[, name]} dicts for a chat template."""
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role in ("tool", "function") or msg.tool_calls or msg.function_call:
            raise UnsupportedParameter(f"messages[{i}]", "tool and function messages need tool support, "
                                       "which this server does not have")
        if msg.audio is not None:
            raise UnsupportedParameter(f"messages[{i}].audio")
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, TextPart):
                    raise UnsupportedParameter(f"messages[{i}].content[{j}]",
                                               f"content parts of type '{part.type}' are not supported")
                texts.append(part.text)
            content = "".join(texts)
        item = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            item["name"] = msg.name
        out.append(item)
    return out


def chat_generation(handle: Any, req: ChatCompletionRequest) -> GenerationRequest:
    _require(handle, Task.CHAT)
    _check_stream_options(req)
    _unsupported_if(req, ("audio", "functions", "function_call", "prediction", "web_search_options",
                          "reasoning_effort", "verbosity", "logprobs", "top_logprobs", "store"))
    if req.tools:
        raise UnsupportedParameter("tools", "tool calling is not supported by this server")
    if req.tool_choice not in (None, "none"):
        raise UnsupportedParameter("tool_choice")
    if req.modalities not in (None, ["text"]):
        raise UnsupportedParameter("modalities", "only text output is supported")
    if req.service_tier not in (None, "auto", "default"):
        raise UnsupportedParameter("service_tier")
    sampling = sampling_params(req, handle.engine, handle.info.n_vocab)
    prompt = handle.engine.render_chat(chat_messages(req), add_generation_prompt=True)
    tokens = handle.engine.tokenize(prompt, special=True)
    max_tokens = req.max_completion_tokens or req.max_tokens
    return GenerationRequest(tokens, sampling, max_tokens, _stops(req.stop), req.stream)


def usage(results: list[Result]) -> dict[str, Any]:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max((r.cached_tokens for r in results), default=0)}}


def chat_response(rid: str, model: str, fingerprint: str, results: list[Result]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": i, "message": {"role": "assistant", "content": r.text, "refusal": None},
                     "logprobs": None, "finish_reason": r.finish_reason} for i, r in enumerate(results)],
        "usage": usage(results),
    }


def chat_chunk(rid: str, model: str, fingerprint: str, created: int, index: int, delta: dict,
               finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


# -- completions ---------------------------------------------------------------------------------------
def completion_generations(handle: Any, req: CompletionRequest) -> list[GenerationRequest]:
    """One GenerationRequest per prompt (a list of prompts is a batch)."""
    _require(handle, Task.COMPLETION)
    _check_stream_options(req)
    _unsupported_if(req, ("suffix",))
    if req.logprobs is not None:
        raise UnsupportedParameter("logprobs")
    if req.best_of not in (None, req.n):
        raise UnsupportedParameter("best_of", "only best_of == n is supported")
    sampling = sampling_params(req, handle.engine, handle.info.n_vocab)
    prompt = req.prompt
    if not prompt:
        raise InvalidRequest("prompt must not be empty.", param="prompt")
    n_vocab, n_ctx = handle.info.n_vocab, handle.info.n_ctx
    if isinstance(prompt, str):
        token_lists = [handle.engine.tokenize(prompt, special=False)]
    elif all(isinstance(p, int) for p in prompt):
        token_lists = [check_token_ids(prompt, n_vocab, "prompt", handle.engine)]
    elif all(isinstance(p, list) for p in prompt):
        token_lists = [check_token_ids(p, n_vocab, "prompt", handle.engine) for p in prompt]
    else:
        token_lists = [handle.engine.tokenize(p, special=False) for p in prompt]
    for i, toks in enumerate(token_lists):
        where = "The prompt" if len(token_lists) == 1 else f"Prompt {i}"
        if not toks:
            raise InvalidRequest(f"{where} is empty{' after tokenization' if prompt_is_text(prompt) else ''}; "
                                 "send at least one token.", param="prompt")
        if n_ctx and len(toks) >= n_ctx:
            raise ContextLengthExceeded(f"This model's maximum context length is {n_ctx} tokens, but "
                                        f"{where[0].lower() + where[1:]} has {len(toks)} tokens.", param="prompt")
    return [GenerationRequest(t, sampling, req.max_tokens, _stops(req.stop), req.stream) for t in token_lists]


def prompt_is_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or any(isinstance(p, str) for p in prompt)


def check_token_ids(tokens: list[int], n_vocab: int, param: str, engine: Any = None) -> list[int]:
    """``tokens`` as a list, or a 400 naming ``param`` for an id outside the vocabulary (0..n_vocab-1). For an
    engine that does not say its vocabulary size (``n_vocab`` 0), an id is in it when ``engine.token_bytes`` knows it
    (without the engine, only negative ids are refused)."""
    if not tokens:
        raise InvalidRequest(f"{param} must not contain an empty list of token ids.", param=param)
    low, high = min(tokens), max(tokens)
    bad = low if low < 0 else high if n_vocab and high >= n_vocab else None
    if bad is None and not n_vocab and engine is not None:
        for tok in set(tokens):
            try:
                engine.token_bytes(tok)
            except Exception:  # noqa: BLE001 - IndexError, KeyError, a native error: not a token of this model
                bad = tok
                break
    if bad is not None:
        bound = f" (0..{n_vocab - 1})" if n_vocab else ""
        raise InvalidRequest(f"Token id {bad} in '{param}' is outside the model's vocabulary{bound}.", param=param)
    return list(tokens)


def check_embedding_input(inp: Any, n_vocab: int) -> None:
    """The limits of an embeddings ``input`` that need no tokenizer: the number of inputs, token ids inside the
    vocabulary, token ids and characters per request (each input's token count is the engine's to check against
    its context)."""
    if isinstance(inp, str):
        items: list[Any] = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        items = [inp]
    else:
        items = list(inp)
    if not items:
        raise InvalidRequest("input must not be empty.", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"input has {len(items)} items; at most {MAX_EMBEDDING_INPUTS} are allowed per request.",
                             param="input")
    n_ids = n_chars = 0
    for item in items:
        if isinstance(item, list):
            check_token_ids(item, n_vocab, "input")
            n_ids += len(item)
        else:
            n_chars += len(item)
    if n_ids > MAX_EMBEDDING_TOKENS:
        raise InvalidRequest(f"input has {n_ids} token ids; at most {MAX_EMBEDDING_TOKENS} are allowed per request.",
                             param="input")
    if n_chars > MAX_EMBEDDING_CHARS:
        raise InvalidRequest(f"input has {n_chars} characters of text; at most {MAX_EMBEDDING_CHARS} are allowed "
                             "per request.", param="input")


def prompt_texts(handle: Any, req: CompletionRequest) -> list[str]:
    """The prompt text of each prompt, for ``echo``."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [_detok(handle, p, "prompt")]
    return [x if isinstance(x, str) else _detok(handle, x, "prompt") for x in p]


def _detok(handle: Any, tokens: list[int], param: str = "input") -> str:
    """The text of token ids (a prompt for ``echo``, an embeddings input): 400 naming ``param`` for an id outside
    the vocabulary."""
    check_token_ids(tokens, handle.info.n_vocab, param, handle.engine)
    return b"".join(handle.engine.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def completion_response(rid: str, model: str, fingerprint: str, results: list[Result],
                        prefixes: list[str], n: int) -> dict[str, Any]:
    """``results`` are prompt-major (prompt i, choice j at i*n + j); ``prefixes`` one per result (echo)."""
    choices = [{"index": i, "text": prefixes[i] + r.text, "logprobs": None, "finish_reason": r.finish_reason}
               for i, r in enumerate(results)]
    total_prompt = sum(r.prompt_tokens for r in results[::n])
    u = usage(results)
    u["prompt_tokens"] = total_prompt
    u["total_tokens"] = total_prompt + u["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": u}


def completion_chunk(rid: str, model: str, fingerprint: str, created: int, index: int, text: str,
                     finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


# -- any generation kind ---------------------------------------------------------------------------------
def prepare(handle: Any, kind: str, req: Any) -> tuple[list[GenerationRequest], int]:
    """The generation requests of an API request of ``kind`` ("chat", "completion", "messages") and the
    number of sequences (choices) per prompt."""
    if kind == "chat":
        return [chat_generation(handle, req)], req.n
    if kind == "completion":
        return completion_generations(handle, req), req.n
    if kind == "messages":
        return [anthropic_generation(handle, req)], 1
    raise ValueError(f"unknown generation kind {kind!r}")


def sequence_count(kind: str, req: Any) -> int:
    """How many sequences ``prepare`` makes for ``req`` (at least 1, so an error always has a receiver)."""
    if kind != "completion":
        return req.n if kind == "chat" else 1
    p = req.prompt
    prompts = len(p) if isinstance(p, list) and p and not all(isinstance(x, int) for x in p) else 1
    return max(1, prompts) * req.n


# -- Anthropic messages ------------------------------------------------------------------------------
_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}


def anthropic_generation(handle: Any, req: AnthropicRequest) -> GenerationRequest:
    _require(handle, Task.CHAT)
    _unsupported_if(req, ("tools", "thinking", "container", "mcp_servers"))
    if req.tool_choice is not None:
        raise UnsupportedParameter("tool_choice")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _anthropic_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages.append({"role": m.role, "content": _anthropic_text(m.content, f"messages[{i}].content")})
    sp = SamplingParams()
    if req.temperature is not None:
        sp.temperature = req.temperature
    if req.top_p is not None:
        sp.top_p = req.top_p
    if req.top_k is not None:
        sp.top_k = req.top_k
    for name in sorted(sp.changed()):
        if name not in handle.engine.sampling_params:
            raise UnsupportedParameter(name, f"the {handle.engine.name} engine cannot honour it")
    tokens = handle.engine.tokenize(handle.engine.render_chat(messages, True), special=True)
    return GenerationRequest(tokens, sp, req.max_tokens, list(req.stop_sequences or []), req.stream)


def _anthropic_text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise UnsupportedParameter(f"{where}[{j}]", f"content blocks of type '{block.type}' are not supported")
        parts.append(block.text)
    return "".join(parts)


def anthropic_stop(result: Result) -> tuple[str, str | None]:
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return _ANTHROPIC_STOP.get(result.finish_reason, "end_turn"), None


def anthropic_response(mid: str, model: str, result: Result) -> dict[str, Any]:
    reason, seq = anthropic_stop(result)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": result.text}], "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                      "cache_read_input_tokens": result.cached_tokens}}
