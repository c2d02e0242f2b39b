"""Request models of Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``, ...), pydantic, fields
as Ollama's ``api/types.go`` names them. No aiohttp here: the generation requests are pickled into model workers.

Validation follows Ollama's: a value of the wrong JSON type is a 400 naming the field; a key Ollama's API does not
have, at any depth, is ignored as Ollama's Go decoder ignores it, with one warning line naming it. ``options`` is
free-form here and read by :mod:`octo.serving.ollama` as Ollama's ``Options.FromMap`` reads it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from octo.errors import InvalidRequest
from octo.logsafe import quoted

THINK_LEVELS = ("high", "medium", "low", "max")
log = logging.getLogger("octo.protocol.ollama")


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class ToolCallFunction(OllamaModel):
    index: int | None = None
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(OllamaModel):
    id: str | None = None
    type: str | None = None  # some clients echo OpenAI's "function"
    function: ToolCallFunction


class Message(OllamaModel):
    role: str
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        v = v.lower()  # as Ollama's Message.UnmarshalJSON
        if v not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"role must be one of system, user, assistant, tool; got {v!r}")
        return v


class ToolFunction(OllamaModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OllamaModel):
    type: str = "function"
    items: Any = None
    function: ToolFunction


class _Request(OllamaModel):
    model: str = ""
    stream: bool | None = None  # Ollama's default: true
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None

    @property
    def streaming(self) -> bool:
        return self.stream is not False


class _Generating(_Request):
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("think")
    @classmethod
    def _think(cls, v):
        if isinstance(v, str) and v not in THINK_LEVELS:
            raise ValueError(f"invalid think value {v!r} (must be \"high\", \"medium\", \"low\", \"max\", true, or "
                             "false)")
        return v


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Generating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None
    width: int | None = None  # image generation (Ollama's experimental image models)
    height: int | None = None
    steps: int | None = None


class EmbedRequest(_Request):
    input: str | list[str] = ""
    truncate: bool | None = None
    dimensions: int | None = Field(None, ge=0)


class EmbeddingsRequest(_Request):
    """The older ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    prompt: str = ""


class ModelRequest(OllamaModel):
    """``/api/show``, ``/api/delete``, ``/api/pull``, ``/api/push``: ``model`` (or the older ``name``)."""

    model: str = ""
    name: str = ""
    verbose: bool | None = None  # show
    system: str | None = None  # show (deprecated in Ollama)
    template: str | None = None  # show (deprecated in Ollama)
    options: dict[str, Any] | None = None  # show
    stream: bool | None = None  # pull, push
    insecure: bool | None = None  # pull, push (Ollama ignores it)
    username: str | None = None  # pull, push (deprecated, ignored by Ollama)
    password: str | None = None

    @property
    def target(self) -> str:
        return self.model or self.name


# -- parsing ----------------------------------------------------------------------------------------
def parse(model: type[OllamaModel], body: bytes, route: str = "") -> Any:
    """Validate a JSON body: a 400 naming the field for a bad value; keys Ollama's API does not have are dropped,
    named in one warning line (``route`` says where)."""
    if not body or not body.strip():
        raise InvalidRequest("missing request body")
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    unknown: list[str] = []
    _unknown(req, "", unknown)
    if unknown:
        log.warning("%s: ignoring fields Ollama's API does not have: %s", quoted(route or model.__name__, bare=True),
                    ", ".join(quoted(u, 80) for u in unknown[:20]))
    return req


def _invalid(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequest(f"invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    where = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p in _UNION_TAGS))
    if not where:
        return InvalidRequest("the request body must be a JSON object", code="invalid_type")
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return InvalidRequest(f"{where} is required", param=where, code="missing_required_parameter")
    return InvalidRequest(f"invalid value for {where}: {msg}", param=where, code="invalid_value")


_UNION_TAGS = {"str", "list[str]", "dict[str,any]", "bool", "int", "float", "list[int]", "none"}


def _unknown(value: Any, path: str, found: list[str]) -> None:
    """Drop (and list in ``found``) the keys no model declares, at any depth; a 400 for a NaN/Infinity inside
    free-form JSON."""
    if isinstance(value, OllamaModel):
        extra = value.model_extra
        if extra:
            found.extend(f"{path}.{key}" if path else key for key in extra)
            value.model_fields_set.difference_update(extra)
            extra.clear()
        for name in value.model_fields_set:
            _unknown(getattr(value, name), f"{path}.{name}" if path else name, found)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _unknown(item, f"{path}[{i}]", found)
    elif isinstance(value, dict):
        for key, item in value.items():
            _unknown(item, f"{path}.{key}", found)
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"invalid value for {path}: NaN and Infinity are not JSON numbers", param=path)
