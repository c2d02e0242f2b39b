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
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from octo.engine import SamplingParams, Task
from octo.errors import ContextLengthExceeded, InvalidRequest, UnsupportedParameter
from octo.logsafe import quoted
from octo.protocol.ollama import ChatRequest, GenerateRequest
from octo.scheduler.jobs import GenerationRequest, Result
from octo.serving import chatprep, media, ollama_images
from octo.serving.media import ImageRef
from octo.text.reasoning import prompt_opens_thinking, supports_thinking, template_source

# the Ollama release whose API octo implements (its docs/api.md, api/types.go, server/routes.go and prompt.go):
# what /api/version reports, so that clients gating features on Ollama's version see the API they get
API_VERSION = "0.32.15"
# Ollama's Options struct (api/types.go of API_VERSION) and the JSON type of each key, as its
# Options.FromMap reads them: an integer option takes any JSON number (truncated), a float one any number
_INT = frozenset({"num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch", "num_gpu",
                  "main_gpu", "num_thread", "draft_num_predict"})
_FLOAT = frozenset({"top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                    "frequency_penalty"})
KNOWN_OPTIONS = _INT | _FLOAT | {"stop", "use_mmap"}
# options octo honours -> the SamplingParams field they set
_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
             "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty"}
# how a model runs, set in Ollama when it loads (its Runner struct, the draft): octo sets them at load (-o ...)
_LOAD = frozenset({"num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread", "draft_num_predict"})
NUM_KEEP = 4  # Ollama's default num_keep: the prompt's first tokens a cut keeps
log = logging.getLogger("octo.serving.ollama")


@dataclass
class Options:
    """What a request's ``options`` sets: sampling, the token limit, stop strings, the context window, the tokens a
    cut keeps (``num_keep``), and the options octo ignores (``ignored``, named in one warning line)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int | None = None
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None
    num_keep: int = NUM_KEEP
    repeat_last_n: int | None = None
    typical_p: float = 1.0
    ignored: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, options: dict[str, Any] | None, engine: Any = None) -> Options:
        """``options`` as Ollama reads them: a null value is unset; a value of the wrong JSON type is an error with
        Ollama's message; an unknown key, or an option octo cannot honour, is ignored and listed in ``ignored``.
        ``engine``: the sampling settings it cannot apply are ignored too (None: not checked)."""
        out = cls()
        for key, value in (options or {}).items():
            if value is None:
                continue
            if key not in KNOWN_OPTIONS or key in _LOAD:
                if key in _LOAD:
                    _typed(key, value)
                out.ignored.append(key)
                continue
            value = _typed(key, value)
            if key == "stop":
                out.stop = value
            elif key in _SAMPLING:
                out._sample(key, value)
            else:
                out._set(key, value)
        if engine is not None:
            out._fit(engine)
        return out

    def _set(self, key: str, value: Any) -> None:
        if key == "num_predict":
            self.num_predict = value if value > 0 else None  # -1: no limit, -2: fill the context
        elif key == "num_ctx":
            self.num_ctx = value if value > 0 else None  # 0: the model's (Ollama's default)
        elif key == "num_keep":
            self.num_keep = value
        elif key == "repeat_last_n":
            self.repeat_last_n = value
        elif key == "typical_p":
            self.typical_p = value

    def _sample(self, key: str, value: Any) -> None:
        """A sampling option; a value past its range means what the samplers make of it (top_p, min_p above 1: off
        and all; a temperature below 0: greedy); a repeat_penalty of 0 or less has no meaning: ignored."""
        sp = self.sampling
        if key == "seed":
            sp.seed = value & (2**63 - 1) if value >= 0 else None  # -1: a random seed, as Ollama's default
        elif key == "top_k":
            sp.top_k = max(0, value)
        elif key in ("top_p", "min_p"):
            setattr(sp, key, min(1.0, max(0.0, value)))
        elif key == "temperature":
            sp.temperature = max(0.0, value)
        elif key == "repeat_penalty" and value <= 0:
            self.ignored.append(key)
        else:
            setattr(sp, _SAMPLING[key], value)

    def _fit(self, engine: Any) -> None:
        """Ignore what ``engine`` cannot apply: sampling settings it lacks, a penalty window other than the one the
        model loaded with (``penalty_last_n``), typical sampling (no engine has it)."""
        defaults = SamplingParams()
        for name in sorted(self.sampling.changed()):
            if name not in engine.sampling_params:
                setattr(self.sampling, name, getattr(defaults, name))
                self.ignored.append(next(k for k, v in _SAMPLING.items() if v == name))
        if self.repeat_last_n is not None:  # -1: the whole context
            want = engine.info.n_ctx if self.repeat_last_n < 0 else self.repeat_last_n
            if want != getattr(engine, "penalty_last_n", None):
                self.ignored.append("repeat_last_n")
        if self.typical_p < 1.0:
            self.ignored.append("typical_p")


def _typed(key: str, value: Any) -> Any:
    """``value`` as the type Ollama's Options.FromMap reads ``key`` with; its error message otherwise."""
    if key in _INT:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"option \"{key}\" must be of type integer", param=f"options.{key}")
        return int(value)
    if key in _FLOAT:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"option \"{key}\" must be of type float32", param=f"options.{key}")
        return float(value)
    if key == "stop":
        if not isinstance(value, list):
            raise InvalidRequest(f"option \"{key}\" must be of type array", param=f"options.{key}")
        if not all(isinstance(s, str) for s in value):
            raise InvalidRequest(f"option \"{key}\" must be of an array of strings", param=f"options.{key}")
        return list(value)
    if not isinstance(value, bool):  # use_mmap
        raise InvalidRequest(f"option \"{key}\" must be of type boolean", param=f"options.{key}")
    return value


def warn_ignored(route: str, names: list[str]) -> None:
    """One warning line per request naming the options octo ignored (Ollama logs "invalid option provided")."""
    if names:
        log.warning("%s: ignoring options octo cannot use: %s", route,
                    ", ".join(quoted(n, 64) for n in dict.fromkeys(names)))


# -- request -> generation ------------------------------------------------------------------------------------------
def model_name(model: str) -> str:
    """The octo name of an Ollama model name: ``name:latest`` is the catalog's default variant (the name alone);
    any other tag is a catalog variant (or a LoRA adapter), resolved as every other route does."""
    if not model:
        raise InvalidRequest("model is required", param="model", code="missing_required_parameter")
    return model[:-7] if model.endswith(":latest") and len(model) > 7 else model


def chat_messages(req: ChatRequest, images: list[ImageRef] | None = None) -> list[dict[str, Any]]:
    """Ollama messages as chat-template messages (OpenAI-style tool calls, with ids); a message's ``images`` become
    markers in its text (octo.serving.ollama_images), collected in ``images``."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # function name -> id of the latest unanswered call
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images and images is not None:
            msg["content"] = ollama_images.content(msg["content"], m.images, f"messages[{i}].images", images)
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
    warn_ignored("/api/chat" if isinstance(req, ChatRequest) else "/api/generate", opts.ignored)
    window = context_window(handle, opts)
    names: list[str] = []
    tools, fmt, reasons, prompt = None, None, False, None
    refs: list[ImageRef] = []
    text = ollama_images.content(req.prompt or "", req.images, "images", refs) \
        if isinstance(req, GenerateRequest) and req.images else getattr(req, "prompt", None) or ""
    if isinstance(req, GenerateRequest) and req.raw:
        if req.think:
            raise InvalidRequest("raw mode does not support think", param="think")
        _require(handle, Task.COMPLETION)
        images = ollama_images.load(handle, refs) if refs else None
        tokens, chunks = media.tokenize(engine, text, images) if images else (engine.tokenize(text, special=True), ())
    else:
        _require(handle, Task.CHAT)
        if isinstance(req, GenerateRequest):
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                [{"role": "user", "content": text}]
        else:
            messages = chat_messages(req, refs)
            if req.tools:
                for i, t in enumerate(req.tools):
                    if t.type != "function":
                        raise UnsupportedParameter(f"tools[{i}].type", "only function tools are supported")
                tools = [t.model_dump(exclude_none=True, exclude={"items"}) for t in req.tools]
                names = chatprep.check_tools(tools)
        kwargs, reasons = _think(handle, req)
        fmt = chatprep.tool_format(engine, getattr(handle, "tool_format", None))
        tokenize = ollama_images.Tokenizer(engine, ollama_images.load(handle, refs)) if refs else None
        prompt, tokens = chat_prompt(engine, messages, lambda msgs: chatprep.render_continue(
            engine, msgs, tools, fmt, None, kwargs), window, req.truncate is not False, tokenize)
        chunks = tokenize.chunks(prompt) if tokenize is not None else ()
    fitted = fit_window(tokens, window, opts.num_keep, req.truncate is not False, req.shift is not False)
    ollama_images.check_fits(tokens, fitted, chunks)
    tokens = fitted
    rf = None
    if req.format == "json":
        rf = {"type": "json_object"}
    elif isinstance(req.format, dict):
        rf = {"type": "json_schema", "schema": req.format}
    elif req.format not in (None, ""):
        raise InvalidRequest(f"invalid format {req.format!r}: \"json\" or a JSON schema", param="format")
    grammar = chatprep.compile_for(engine, chatprep.constraint_for(rf, tools, None, None, fmt, rf_param="format"))
    logprobs = chatprep.logprobs_count(engine, (req.top_logprobs or 0) if req.logprobs else None)
    return GenerationRequest(tokens, opts.sampling, _max_tokens(opts, window, len(tokens)), opts.stop, req.streaming,
                             grammar=grammar, logprobs=logprobs,
                             tools=chatprep.tool_spec(fmt, names, None) if fmt is not None else None,
                             reasoning=reasons, reasoning_opened=reasons and prompt_opens_thinking(prompt or ""),
                             media=chunks)


def _require(handle: Any, task: Task) -> None:
    if task not in handle.tasks:
        what = "chat" if task == Task.CHAT else "generate"
        raise InvalidRequest(f"\"{handle.name}\" does not support {what}", param="model", code="unsupported_task")


def context_window(handle: Any, opts: Options) -> int:
    """The tokens a request may use: ``num_ctx`` within the loaded context (a larger one is the loaded context, as
    Ollama caps num_ctx at what the runner holds); 0 when unknown."""
    n_ctx = getattr(getattr(handle, "info", None), "n_ctx", 0) or 0
    return min(opts.num_ctx, n_ctx) if opts.num_ctx and n_ctx else opts.num_ctx or n_ctx


# -- truncation, as Ollama's chatPrompt (server/prompt.go) and its runner do it ------------------------------------
def chat_prompt(engine: Any, messages: list[dict[str, Any]], render: Any, window: int,
                truncate: bool, tokenize: Any = None) -> tuple[str, list[int]]:
    """(prompt text, its tokens) of a conversation as Ollama's chatPrompt makes it: when the whole conversation is
    longer than ``window`` tokens (``render``ed by the chat template, then tokenized) and ``truncate``, the oldest
    messages are left out until it fits, keeping every system message and the last message (and never a tool result
    without the assistant turn that called it). Ollama tries the starts one by one; the length only shrinks as the
    start moves on, so halving the range finds the same start. ``tokenize(text)``: a prompt with images (their
    positions counted, octo.serving.ollama_images)."""
    seen: dict[int, tuple[str, list[int]]] = {}

    def prompt_from(start: int) -> tuple[str, list[int]]:
        if start not in seen:
            kept = [m for m in messages[:start] if m["role"] == "system"] + messages[start:]
            text = render(kept)
            seen[start] = (text, tokenize(text) if tokenize is not None else engine.tokenize(text, special=True))
        return seen[start]

    whole = prompt_from(0)
    last = len(messages) - 1
    if not truncate or not window or len(whole[1]) <= window or last < 1:
        return whole
    lo, hi = 1, last  # the first i whose start fits; the last message is kept even when it alone does not fit
    while lo < hi:
        mid = (lo + hi) // 2
        if len(prompt_from(block_start(messages, mid))[1]) <= window:
            hi = mid
        else:
            lo = mid + 1
    start = block_start(messages, lo)
    log.debug("truncating input messages which exceed the context: %d of %d kept", len(messages) - start,
              len(messages))
    return prompt_from(start)


def block_start(messages: list[dict[str, Any]], i: int) -> int:
    """Where a conversation may start at message ``i``: a tool result starts at the assistant turn whose calls it
    answers (Ollama's toolBlockStartIndex)."""
    if i <= 0 or i >= len(messages) or messages[i]["role"] != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1]["role"] == "tool":
        start -= 1
    if start > 0 and messages[start - 1]["role"] == "assistant" and messages[start - 1].get("tool_calls"):
        return start - 1
    return i


def fit_window(tokens: list[int], window: int, num_keep: int, truncate: bool, shift: bool) -> list[int]:
    """A prompt that still leaves no room in ``window`` (a single message longer than the context, a raw prompt), as
    Ollama's runner treats it: ``truncate: false`` refuses it; ``shift: false`` refuses it with the runner's message;
    otherwise the first ``num_keep`` tokens are kept (-1: all) and the oldest after them dropped, to half the room
    that is left, so that generation has room too."""
    if not window or len(tokens) <= window - 1:
        return tokens
    if not truncate:
        raise ContextLengthExceeded(f"the input length exceeds the context length ({len(tokens)} tokens, the "
                                    f"context holds {window})", param="messages")
    if not shift:
        raise ContextLengthExceeded("the prompt is longer than the context length currently available to the model; "
                                    "shorten the prompt, adjust the context length in settings, or use a model with "
                                    "a longer context length", param="shift")
    keep = min(len(tokens) if num_keep < 0 else max(0, num_keep), window - 1)
    limit = window - max((window - keep) // 2, 1)
    cut = tokens[:keep] + tokens[len(tokens) - (limit - keep):]
    log.warning("truncating input prompt: limit %d, prompt %d, keep %d, new %d", window, len(tokens), keep, len(cut))
    return cut


def _max_tokens(opts: Options, window: int, n_prompt: int) -> int | None:
    """``num_predict`` within the room the window leaves (a larger one ends at the window's end, as Ollama's does);
    with a ``num_ctx`` window and no ``num_predict``, that room."""
    room = window - n_prompt if window else None
    if opts.num_predict:
        return min(opts.num_predict, room) if room is not None else opts.num_predict
    return room if opts.num_ctx else None


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
