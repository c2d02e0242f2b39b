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
from octo.protocol.openai import (
    MAX_EMBEDDING_CHARS,
    MAX_EMBEDDING_INPUTS,
    MAX_EMBEDDING_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ImageUrlPart,
    NamedToolChoice,
    TextPart,
)
from octo.scheduler.jobs import GenerationRequest, Result
from octo.serving import chatprep, media
from octo.serving.media import ImageRef
from octo.text.reasoning import prompt_opens_thinking, supports_thinking

# SamplingParams field -> the request parameter a user would recognise
_PARAM_NAMES = {"repetition_penalty": "repetition_penalty"}


_ID_PREFIX = uuid.uuid4().hex[:12]
_id_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """Unique response id: a per-process random part and a counter (no syscall per request)."""
    return f"{prefix}-{_ID_PREFIX}{next(_id_counter):012x}"


def unsupported_if(req: Any, names: tuple[str, ...], why: str = "") -> None:
    given = req.model_fields_set  # only what the request sent can be set
    for name in names:
        if name in given and getattr(req, name) not in (None, False, [], {}):
            raise UnsupportedParameter(name, why)


_PLAIN_SAMPLING = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
# every request field sampling_params reads: a request that sets none of them gets the defaults at once
_SAMPLING_FIELDS = frozenset({"temperature", "top_p", *_PLAIN_SAMPLING, "logit_bias"})


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


def require(handle: Any, task: Task) -> None:
    if task not in handle.tasks:
        raise InvalidRequest(
            f"Model '{handle.name}' ({handle.engine_name}) does not support {task.value}; it serves: "
            f"{', '.join(sorted(t.value for t in handle.tasks))}.", param="model", code="unsupported_task")


# -- chat ----------------------------------------------------------------------------------------------
def chat_messages(req: ChatCompletionRequest, images: list[ImageRef] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages -> plain {role, content[, name, tool_calls, tool_call_id]} dicts for a chat template; image
    parts (when ``images`` collects them) become markers in the text (``octo.serving.media``)."""
    out = []
    tool_turns = False  # any assistant tool_calls or tool message: their pairing is checked
    for i, msg in enumerate(req.messages):
        if msg.role == "function" or msg.function_call:
            raise UnsupportedParameter(f"messages[{i}]", "the deprecated function-call messages are not supported; "
                                       "use tool_calls and tool messages")
        if msg.tool_calls and msg.role != "assistant":
            raise InvalidRequest("Only assistant messages can have tool_calls.", param=f"messages[{i}].tool_calls")
        if msg.role == "tool" and not msg.tool_call_id:
            raise InvalidRequest("A tool message needs the tool_call_id of the call it answers.",
                                 param=f"messages[{i}].tool_call_id")
        if msg.audio is not None:
            raise UnsupportedParameter(f"messages[{i}].audio")
        content = msg.content
        if isinstance(content, list):
            content = _content_text(content, i, msg.role, images)
        item = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            item["name"] = msg.name
        if msg.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
            tool_turns = True
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        tool_turns = tool_turns or msg.role == "tool"
        out.append(item)
    if tool_turns:
        _check_tool_turns(out)
    return out


def _content_text(parts: list[Any], i: int, role: str, images: list[ImageRef] | None) -> str:
    texts: list[str | int] = []  # an int: an image (its number in the request)
    for j, part in enumerate(parts):
        if isinstance(part, ImageUrlPart) and images is not None:
            if role not in ("user", "tool"):  # (a tool's result may be a picture: llama-server and vLLM take it)
                raise InvalidRequest(f"Image parts are allowed in user and tool messages only, not in a {role} "
                                     "message.", param=f"messages[{i}].content[{j}]")
            images.append(ImageRef(f"messages[{i}].content[{j}]", part.image_url.url))
            texts.append(len(images) - 1)
        elif isinstance(part, TextPart):
            texts.append(part.text)
        else:
            raise UnsupportedParameter(f"messages[{i}].content[{j}]",
                                       f"content parts of type '{part.type}' are not supported")
    if any(isinstance(t, int) for t in texts):  # (an image: as llama-server joins them)
        return media.join_parts(texts)
    return "".join(texts)  # type: ignore[arg-type]


def image_refs(req: ChatCompletionRequest) -> list[ImageRef]:
    """The request's images in order (``replace`` sets a part's URL), for the gateway to fetch the remote ones."""
    refs = []
    for i, msg in enumerate(req.messages):
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else ()):
            if isinstance(part, ImageUrlPart):
                refs.append(ImageRef(f"messages[{i}].content[{j}]", part.image_url.url,
                                     lambda url, p=part: setattr(p.image_url, "url", url)))
    return refs


def _check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """As OpenAI's API: an assistant message's tool calls are answered by the tool messages right after it, one per
    call id, and a tool message answers a call of that assistant message."""
    open_calls: dict[str, int] = {}  # id -> the assistant message that made the call, until its tool message
    for i, msg in enumerate(messages):
        if msg["role"] == "tool":
            if msg["tool_call_id"] not in open_calls:
                raise InvalidRequest(f"messages[{i}]: a message with role 'tool' must answer a call in the "
                                     "'tool_calls' of the assistant message just before it; no such call has id "
                                     f"{msg['tool_call_id']!r}.", param=f"messages[{i}].tool_call_id")
            del open_calls[msg["tool_call_id"]]
            continue
        if open_calls:
            raise _unanswered(open_calls)
        open_calls = {c["id"]: i for c in msg.get("tool_calls") or ()}
    if open_calls:
        raise _unanswered(open_calls)


def _unanswered(open_calls: dict[str, int]) -> InvalidRequest:
    i = next(iter(open_calls.values()))
    return InvalidRequest(f"An assistant message with 'tool_calls' must be followed by tool messages answering each "
                          f"'tool_call_id'; no tool message answers: {', '.join(open_calls)}.",
                          param=f"messages[{i}].tool_calls")


def _hold_end(engine: Any, param: str) -> None:
    """``param`` keeps a sequence from ending: an engine that can (masks, or ``Feed.no_eos``), else a 400 naming it."""
    if not (getattr(engine, "supports_masks", False) or getattr(engine, "supports_min_tokens", False)):
        raise UnsupportedParameter(param, f"the {engine.name} engine cannot keep a sequence from ending")


def ignore_eos(engine: Any, value: bool | None) -> bool:
    """``ignore_eos`` checked: an engine that can keep a sequence from ending (as for ``min_tokens``)."""
    if value:
        _hold_end(engine, "ignore_eos")
    return bool(value)


def min_tokens(engine: Any, value: int | None, max_tokens: int | None, max_param: str = "max_tokens") -> int:
    """``min_tokens`` checked: at most the request's max_tokens, and an engine that can keep a sequence from ending."""
    if not value:
        return 0
    if max_tokens is not None and value > max_tokens:
        raise InvalidRequest(f"min_tokens ({value}) must be less than or equal to {max_param} ({max_tokens}).",
                             param="min_tokens")
    _hold_end(engine, "min_tokens")
    return value


# every field whose check or feature chat_generation applies beyond sampling and the prompt: a request that sets none
# of them (most requests) skips those steps, which could neither refuse it nor change what it generates
_CHAT_FEATURES = frozenset({"audio", "functions", "function_call", "prediction", "web_search_options",
                            "reasoning_effort", "verbosity", "store", "modalities", "service_tier", "stream_options",
                            "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                            "response_format"})


def _check_chat_options(req: ChatCompletionRequest) -> None:
    _check_stream_options(req)
    unsupported_if(req, ("audio", "functions", "function_call", "prediction", "web_search_options", "verbosity",
                          "store"))
    if req.modalities not in (None, ["text"]):
        raise UnsupportedParameter("modalities", "only text output is supported")
    if req.service_tier not in (None, "auto", "default"):
        raise UnsupportedParameter("service_tier")


def _chat_features(engine: Any, req: ChatCompletionRequest, fmt: Any) -> tuple[int, list | None, list[str], Any, Any]:
    """(logprobs, tools, their names, tool_choice, grammar) of a request that sets any of them, checked."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    logprobs = chatprep.logprobs_count(engine, (req.top_logprobs or 0) if req.logprobs else None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    names = chatprep.check_tools(tools) if tools else []
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    chatprep.check_tool_choice(choice, names, bool(tools))
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) if req.response_format else None
    grammar = chatprep.compile_for(engine, chatprep.constraint_for(rf, tools, choice, req.parallel_tool_calls, fmt))
    return logprobs, tools, names, choice, grammar


def chat_generation(handle: Any, req: ChatCompletionRequest) -> GenerationRequest:
    require(handle, Task.CHAT)
    plain = req.model_fields_set.isdisjoint(_CHAT_FEATURES)
    if not plain:
        _check_chat_options(req)
    engine = handle.engine
    sampling = sampling_params(req, engine, handle.info.n_vocab)
    fmt = chatprep.tool_format(engine, getattr(handle, "tool_format", None))
    logprobs, tools, names, choice, grammar = (-1, None, [], None, None) if plain else _chat_features(engine, req, fmt)
    refs: list[ImageRef] = []
    messages = chat_messages(req, refs)
    images = media.load_images(handle, refs) if refs else None  # 400s naming the part, or the model without images
    kwargs = chatprep.reasoning_kwargs(handle, req.reasoning_effort) if req.reasoning_effort is not None else None
    prompt = chatprep.render(engine, messages, tools, fmt, choice, kwargs)
    tokens, chunks = media.tokenize(engine, prompt, images) if images else (engine.tokenize(prompt, special=True), ())
    max_tokens = req.max_completion_tokens or req.max_tokens
    # --reasoning-format parsed (the default): a reasoning model's <think> text is reasoning_content, not content
    reasons = getattr(handle, "reasoning_format", "parsed") != "none" and supports_thinking(engine)
    return GenerationRequest(tokens, sampling, max_tokens, _stops(req.stop), req.stream, grammar=grammar,
                             logprobs=logprobs,
                             tools=chatprep.tool_spec(fmt, names, choice, req.parallel_tool_calls) if names else None,
                             min_tokens=min_tokens(engine, req.min_tokens, max_tokens,
                                                   "max_completion_tokens" if req.max_completion_tokens else
                                                   "max_tokens") if req.min_tokens else 0,
                             ignore_eos=ignore_eos(engine, req.ignore_eos) if req.ignore_eos else False,
                             reasoning=reasons,
                             reasoning_opened=reasons and prompt_opens_thinking(prompt), media=chunks)


def usage(results: list[Result]) -> dict[str, Any]:
    prompt = results[0].prompt_tokens if results else 0
    completion = cached = 0
    for r in results:  # (a loop, not two generators: this runs for every response)
        completion += r.completion_tokens
        cached = max(cached, r.cached_tokens)
    details = {"cached_tokens": cached}
    if results and results[0].image_tokens:  # (a request with images: how many of its prompt tokens they are)
        details["image_tokens"] = results[0].image_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}


def _token(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(entries: list | None) -> dict[str, Any] | None:
    """Chat Completions' ``logprobs`` object of (token bytes, logprob, [(bytes, logprob)]) entries."""
    if entries is None:
        return None
    return {"content": [{"token": _token(b), "logprob": lp, "bytes": list(b),
                         "top_logprobs": [{"token": _token(tb), "logprob": tlp, "bytes": list(tb)} for tb, tlp in top]}
                        for b, lp, top in entries], "refusal": None}


def chat_message(r: Result) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": r.text, "refusal": None}
    if r.reasoning is not None:
        msg["reasoning_content"] = r.reasoning
    if r.tool_calls:
        msg["content"] = r.text or None
        msg["tool_calls"] = r.tool_calls
    return msg


def chat_response(rid: str, model: str, fingerprint: str, results: list[Result]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": i, "message": chat_message(r),
                     "logprobs": chat_logprobs(r.logprobs) if r.logprobs is not None else None,
                     "finish_reason": r.finish_reason} for i, r in enumerate(results)],
        "usage": usage(results),
    }


def chat_chunk(rid: str, model: str, fingerprint: str, created: int, index: int, delta: dict,
               finish: str | None = None, logprobs: list | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish}]}


# -- completions ---------------------------------------------------------------------------------------
def completion_generations(handle: Any, req: CompletionRequest) -> list[GenerationRequest]:
    """One GenerationRequest per prompt (a list of prompts is a batch)."""
    require(handle, Task.COMPLETION)
    _check_stream_options(req)
    unsupported_if(req, ("suffix",))
    if req.best_of not in (None, req.n):
        raise UnsupportedParameter("best_of", "only best_of == n is supported")
    engine = handle.engine
    sampling = sampling_params(req, engine, handle.info.n_vocab)
    logprobs = chatprep.logprobs_count(engine, req.logprobs)
    prompt_logprobs = -1
    if req.echo and logprobs >= 0:
        if not getattr(engine, "supports_prompt_logprobs", False):
            raise UnsupportedParameter("echo", f"the {engine.name} engine does not report prompt-token logprobs "
                                       "(echo with logprobs)")
        prompt_logprobs = logprobs
    grammar = None
    if req.response_format is not None:
        rf = req.response_format.model_dump(by_alias=True, exclude_none=True)
        grammar = chatprep.compile_for(engine, chatprep.constraint_for(rf, None, None, None, None))
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
    least = min_tokens(engine, req.min_tokens, req.max_tokens)
    return [GenerationRequest(t, sampling, req.max_tokens, _stops(req.stop), req.stream, grammar=grammar,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, min_tokens=least,
                              ignore_eos=ignore_eos(engine, req.ignore_eos))
            for t in token_lists]


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
        return [detokenize_ids(handle, p, "prompt")]
    return [x if isinstance(x, str) else detokenize_ids(handle, x, "prompt") for x in p]


def detokenize_ids(handle: Any, tokens: list[int], param: str = "input") -> str:
    """The text of token ids (a prompt for ``echo``, an embeddings input): 400 naming ``param`` for an id outside
    the vocabulary."""
    check_token_ids(tokens, handle.info.n_vocab, param, handle.engine)
    return b"".join(handle.engine.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def completion_response(rid: str, model: str, fingerprint: str, results: list[Result],
                        prefixes: list[str], n: int) -> dict[str, Any]:
    """``results`` are prompt-major (prompt i, choice j at i*n + j); ``prefixes`` one per result (echo)."""
    choices = [{"index": i, "text": prefixes[i] + r.text,
                "logprobs": completion_logprobs((r.prompt_logprobs or []) + r.logprobs)
                if r.logprobs is not None else None, "finish_reason": r.finish_reason}
               for i, r in enumerate(results)]
    total_prompt = sum(r.prompt_tokens for r in results[::n])
    u = usage(results)
    u["prompt_tokens"] = total_prompt
    u["total_tokens"] = total_prompt + u["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": u}


def completion_logprobs(entries: list, offset: int = 0) -> dict[str, Any]:
    """Completions' legacy ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset); ``offset``: the
    text position of the first token."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for b, lp, top in entries:
        tok = _token(b)
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token(tb): tlp for tb, tlp in top} if lp is not None else None)
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def completion_chunk(rid: str, model: str, fingerprint: str, created: int, index: int, text: str,
                     finish: str | None = None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


# -- any generation kind ---------------------------------------------------------------------------------
def prepare(handle: Any, kind: str, req: Any) -> tuple[list[GenerationRequest], int]:
    """The generation requests of an API request of ``kind`` ("chat", "completion", "messages") and the
    number of sequences (choices) per prompt."""
    if kind == "chat":
        gens, n = [chat_generation(handle, req)], req.n
    elif kind == "completion":
        gens, n = completion_generations(handle, req), req.n
    elif kind == "messages":
        from octo.serving import anthropic  # it builds on this module

        gens, n = [anthropic.generation(handle, req)], 1
    elif kind == "ollama":
        from octo.serving import ollama  # Ollama's /api/chat and /api/generate

        gens, n = [ollama.generation(handle, req)], 1
    else:
        raise ValueError(f"unknown generation kind {kind!r}")
    model = getattr(req, "model", None)
    adapter = lora_adapter(handle, model) if model and ":" in model else None
    if adapter is not None:
        for g in gens:
            g.sampling.adapter = adapter
    return gens, n


def lora_adapter(handle: Any, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` picks (``base:adapter``, one the engine loaded), else None."""
    if not model or ":" not in model:
        return None
    adapters = getattr(handle.engine, "adapters", None)  # the engine's loaded adapters (a container of names)
    name = model.rpartition(":")[2]
    return name if adapters and name in adapters else None


def count_tokens(handle: Any, kind: str, req: Any) -> int:
    """The prompt tokens of an API request of ``kind`` (rendered as a real request would be): "messages"."""
    if kind == "messages":
        from octo.serving import anthropic

        return anthropic.count_tokens(handle, req)
    raise ValueError(f"unknown kind {kind!r} to count tokens of")


def sequence_count(kind: str, req: Any) -> int:
    """How many sequences ``prepare`` makes for ``req`` (at least 1, so an error always has a receiver)."""
    if kind != "completion":
        return req.n if kind == "chat" else 1
    p = req.prompt
    prompts = len(p) if isinstance(p, list) and p and not all(isinstance(x, int) for x in p) else 1
    return max(1, prompts) * req.n
