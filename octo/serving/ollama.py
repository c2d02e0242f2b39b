"""Ollama's native API (``/api/chat``, ``/api/generate``) on top of the chat machinery: no aiohttp here.

A request becomes one :class:`octo.scheduler.jobs.GenerationRequest` in the model's worker (:func:`generation`,
through the
``"ollama"`` kind of ``serving.prepare``): messages become chat-template messages (an assistant message's
``tool_calls``, whose ``arguments`` are objects, become OpenAI calls; a ``tool`` message answers the call its
``tool_call_id`` or ``tool_name`` names), ``tools`` OpenAI function tools, ``format`` (``"json"`` or a JSON schema) the
same constraint as ``response_format``, ``think`` the template's ``enable_thinking`` (and ``reasoning_effort`` for a
level, where the template takes one), ``options`` octo's sampling settings (:class:`Options`). A final assistant
message is a prefill, continued as Ollama does. ``/api/generate`` renders ``system`` + ``prompt`` as a chat turn, or
with ``raw`` tokenizes the prompt as given.

The answer is shaped here too (:func:`chat_message`, :func:`tool_calls`, :func:`metrics`, :func:`done_reason`):
Ollama's tool calls carry their arguments as an object, durations are nanoseconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from octo.engine import SamplingParams, Task
from octo.errors import ContextLengthExceeded, InvalidRequest, UnsupportedParameter
from octo.protocol.ollama import ChatRequest, GenerateRequest
from octo.scheduler.jobs import GenerationRequest, Result
from octo.serving import chatprep
from octo.text.reasoning import prompt_opens_thinking, supports_thinking, template_source

# options octo honours -> the SamplingParams field they set (None: not a sampling field)
_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
             "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty"}
_INTS = frozenset({"num_predict", "top_k", "seed", "num_ctx"})
# options whose value turns a feature off: accepted with exactly that value (octo never runs the feature)
_OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


@dataclass
class Options:
    """What a request's ``options`` sets: sampling, the token limit, stop strings, the context window."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int | None = None
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None

    @classmethod
    def parse(cls, options: dict[str, Any] | None, engine: Any = None) -> Options:
        """``options`` checked; a null value is unset (as Ollama reads it); an option octo cannot honour is a 400
        naming it. ``engine``: refuse sampling settings it cannot apply (None: do not check)."""
        out = cls()
        for key, value in (options or {}).items():
            if value is None:
                continue
            where = f"options.{key}"
            if key in _OFF:
                if _number(value, where) != _OFF[key]:
                    raise UnsupportedParameter(where, f"octo does not implement {key}; leave it out or set it to "
                                               f"{_OFF[key]:g} (off)")
            elif key == "stop":
                if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                    raise InvalidRequest("option \"stop\" must be an array of strings", param=where)
                out.stop = list(value)
            elif key in _SAMPLING or key in ("num_predict", "num_ctx"):
                out._set(key, _number(value, where, key in _INTS))
            else:
                raise UnsupportedParameter(where, "octo cannot honour this option")
        if engine is not None:
            for name in sorted(out.sampling.changed()):
                if name not in engine.sampling_params:
                    key = next(k for k, v in _SAMPLING.items() if v == name)
                    raise UnsupportedParameter(f"options.{key}", f"the {engine.name} engine cannot honour it")
        return out

    def _set(self, key: str, value: float) -> None:
        sp = self.sampling
        if key == "num_predict":
            self.num_predict = int(value) if value > 0 else None  # -1: no limit, -2: fill the context
        elif key == "num_ctx":
            if value < 1:
                raise InvalidRequest("option \"num_ctx\" must be at least 1", param="options.num_ctx")
            self.num_ctx = int(value)
        elif key == "seed":
            sp.seed = int(value) & (2**63 - 1) if value >= 0 else None  # -1: a random seed, as Ollama's default
        elif key == "top_k":
            sp.top_k = max(0, int(value))
        else:
            setattr(sp, _SAMPLING[key], float(value))
        if not (0 <= sp.top_p <= 1 and 0 <= sp.min_p <= 1 and sp.temperature >= 0 and sp.repetition_penalty > 0):
            raise InvalidRequest(f"option \"{key}\" is out of range", param=f"options.{key}")


def _number(value: Any, where: str, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"option \"{where[8:]}\" must be of type {'integer' if integer else 'number'}",
                             param=where)
    return int(value) if integer else float(value)


# -- request -> generation ------------------------------------------------------------------------------------------
def model_name(model: str) -> str:
    """The octo name of an Ollama model name: ``name:latest`` is the catalog's default variant (the name alone);
    any other tag is a catalog variant (or a LoRA adapter), resolved as every other route does."""
    if not model:
        raise InvalidRequest("model is required", param="model", code="missing_required_parameter")
    return model[:-7] if model.endswith(":latest") and len(model) > 7 else model


def check_images(req: ChatRequest | GenerateRequest) -> None:
    """octo serves no vision model: images anywhere are a 400 naming where."""
    if isinstance(req, GenerateRequest):
        if req.images:
            raise UnsupportedParameter("images", "octo serves no vision models")
        return
    for i, m in enumerate(req.messages):
        if m.images:
            raise UnsupportedParameter(f"messages[{i}].images", "octo serves no vision models")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Ollama messages as chat-template messages (OpenAI-style tool calls, with ids)."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # function name -> id of the latest unanswered call
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest(f"messages[{i}]: only assistant messages can have tool_calls",
                                     param=f"messages[{i}].tool_calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{i}_{j}"
                calls.append({"id": cid, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}})
                open_calls[c.function.name] = cid
            msg["tool_calls"] = calls
        if m.role == "tool":
            cid = m.tool_call_id or open_calls.get(m.tool_name or "") or ""
            if cid:
                msg["tool_call_id"] = cid
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def _think(handle: Any, req: ChatRequest | GenerateRequest) -> tuple[dict[str, Any] | None, bool]:
    """(template arguments, whether <think> text goes apart) of ``think``: a model whose template reasons thinks
    unless told ``false``, as Ollama's do; ``think`` on any other model is a 400 (``false`` is accepted)."""
    engine, think = handle.engine, req.think
    if not supports_thinking(engine):
        if think not in (None, False):
            raise InvalidRequest(f"\"{req.model}\" does not support thinking", param="think")
        return None, False
    if think is False:
        return {"enable_thinking": False}, False
    kwargs: dict[str, Any] = {"enable_thinking": True}
    if isinstance(think, str) and "reasoning_effort" in template_source(engine):
        kwargs["reasoning_effort"] = "high" if think == "max" else think
    return kwargs, getattr(handle, "reasoning_format", "parsed") != "none"


def check_generate(req: GenerateRequest) -> None:
    """The /api/generate fields octo refuses (before any model loads for them)."""
    if req.template:
        raise UnsupportedParameter("template", "octo renders prompts with the model's own chat template; send "
                                   "\"raw\": true with a prompt you formatted yourself")
    if req.context is not None:
        raise UnsupportedParameter("context", "the deprecated context field is not supported (octo returns none); "
                                   "keep the conversation in /api/chat messages")
    if req.suffix:
        raise InvalidRequest(f"\"{req.model}\" does not support insert", param="suffix")
    if req.width or req.height or req.steps:
        raise UnsupportedParameter("width" if req.width else "height" if req.height else "steps",
                                   "octo serves no image generation models")
    if req.raw and req.system:
        raise InvalidRequest("raw mode does not support template, system, or context", param="raw")


def generation(handle: Any, req: ChatRequest | GenerateRequest) -> GenerationRequest:
    """The generation request of an Ollama chat or generate request (in the model's worker)."""
    engine = handle.engine
    opts = Options.parse(req.options, engine)
    # truncate and shift are accepted: octo never cuts a prompt (one too long is a 400) nor shifts the context (the
    # answer ends at its end, done_reason "length"): both as with false
    names: list[str] = []
    tools, fmt, reasons, prompt = None, None, False, None
    if isinstance(req, GenerateRequest) and req.raw:
        if req.think:
            raise InvalidRequest("raw mode does not support think", param="think")
        _require(handle, Task.COMPLETION)
        tokens = engine.tokenize(req.prompt or "", special=True)
    else:
        _require(handle, Task.CHAT)
        if isinstance(req, GenerateRequest):
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                [{"role": "user", "content": req.prompt or ""}]
        else:
            messages = chat_messages(req)
            if req.tools:
                for i, t in enumerate(req.tools):
                    if t.type != "function":
                        raise UnsupportedParameter(f"tools[{i}].type", "only function tools are supported")
                tools = [t.model_dump(exclude_none=True, exclude={"items"}) for t in req.tools]
                names = chatprep.check_tools(tools)
        kwargs, reasons = _think(handle, req)
        fmt = chatprep.tool_format(engine, getattr(handle, "tool_format", None))
        prompt = chatprep.render_continue(engine, messages, tools, fmt, None, kwargs)
        tokens = engine.tokenize(prompt, special=True)
    rf = None
    if req.format == "json":
        rf = {"type": "json_object"}
    elif isinstance(req.format, dict):
        rf = {"type": "json_schema", "schema": req.format}
    elif req.format not in (None, ""):
        raise InvalidRequest(f"invalid format {req.format!r}: \"json\" or a JSON schema", param="format")
    grammar = chatprep.compile_for(engine, chatprep.constraint_for(rf, tools, None, None, fmt, rf_param="format"))
    logprobs = chatprep.logprobs_count(engine, (req.top_logprobs or 0) if req.logprobs else None)
    return GenerationRequest(tokens, opts.sampling, _max_tokens(handle, opts, len(tokens)), opts.stop, req.streaming,
                             grammar=grammar, logprobs=logprobs,
                             tools=chatprep.tool_spec(fmt, names, None) if fmt is not None else None,
                             reasoning=reasons, reasoning_opened=reasons and prompt_opens_thinking(prompt or ""))


def _require(handle: Any, task: Task) -> None:
    if task not in handle.tasks:
        what = "chat" if task == Task.CHAT else "generate"
        raise InvalidRequest(f"\"{handle.name}\" does not support {what}", param="model", code="unsupported_task")


def _max_tokens(handle: Any, opts: Options, n_prompt: int) -> int | None:
    """``num_predict`` within ``num_ctx``: a window up to the loaded context (a larger one is the loaded context, as
    Ollama caps num_ctx at what the model can hold); a prompt that does not fit the window is a 400."""
    n_ctx = getattr(getattr(handle, "info", None), "n_ctx", 0) or 0
    window = min(opts.num_ctx, n_ctx) if opts.num_ctx and n_ctx else opts.num_ctx or n_ctx
    if opts.num_ctx and window and n_prompt >= window:
        raise ContextLengthExceeded(f"the prompt has {n_prompt} tokens, more than the context window num_ctx "
                                    f"{window} holds", param="options.num_ctx")
    if opts.num_ctx and window:
        room = window - n_prompt
        return min(opts.num_predict, room) if opts.num_predict else room
    return opts.num_predict


# -- results -> Ollama ----------------------------------------------------------------------------------------------
# the last whole second, formatted: strftime costs ~10 us, and a stream calls now() for every piece
_SECOND: tuple[int, str] = (0, "")


def now() -> str:
    """``created_at``: RFC 3339 in UTC with microseconds, as Ollama writes it."""
    global _SECOND
    t = time.time()
    sec = int(t)
    if _SECOND[0] != sec:
        _SECOND = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{_SECOND[1]}.{int((t - sec) * 1_000_000):06d}Z"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls in Ollama's shape: ``arguments`` an object."""
    out = []
    for i, c in enumerate(calls):
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        out.append({"id": c["id"], "function": {"index": i, "name": c["function"]["name"],
                                                "arguments": args if isinstance(args, dict) else {}}})
    return out


def done_reason(result: Result) -> str:
    """Ollama's ``done_reason``: "length" at num_predict or the context's end, else "stop" (tool calls too)."""
    return "length" if result.finish_reason == "length" else "stop"


def logprobs(entries: list | None) -> list[dict[str, Any]] | None:
    if not entries:
        return None
    return [{"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b),
             **({"top_logprobs": [{"token": tb.decode("utf-8", "replace"), "logprob": tlp, "bytes": list(tb)}
                                  for tb, tlp in top]} if top else {})} for b, lp, top in entries]


@dataclass
class Clock:
    """Where a request's time went at the gateway (perf_counter seconds); the prompt's evaluation and the generation
    are timed on the engine thread (``Result.prompt_eval_s``, ``Result.eval_s``)."""

    start: float
    loaded: float = 0.0  # the model is ready (loaded on demand, or already there)
    done: float = 0.0

    def metrics(self, result: Result) -> dict[str, int]:
        ns = 1_000_000_000
        return {"total_duration": max(1, int((self.done - self.start) * ns)),
                "load_duration": max(1, int((self.loaded - self.start) * ns)),
                "prompt_eval_count": result.prompt_tokens,
                "prompt_eval_duration": max(1, int(result.prompt_eval_s * ns)),
                "eval_count": result.completion_tokens,
                "eval_duration": max(1, int(result.eval_s * ns))}
