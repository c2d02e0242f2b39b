"""Request models of the HTTP API (pydantic), fields in the order of the OpenAI/Anthropic documentation.

Every request model allows extra keys only to name them in a 400 ("Unrecognized request argument");
fields that exist in the API but that octo does not implement are declared, so a request that sets them
gets a 400 naming the field instead of being silently ignored (see ``serving.check_unsupported``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from octo.errors import InvalidRequest

Number = float


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return list(self.model_extra or ())


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class StreamOptions(_Model):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Model):
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # extensions common to local servers (llama.cpp, vLLM; keep_alive: Ollama's, seconds or a duration)
    top_k: int | None = Field(None, ge=0)
    keep_alive: float | str | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, alias="repeat_penalty")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²" is a Unicode digit that int() cannot read
                raise ValueError(f"keys must be token ids (ASCII decimal, >= 0), got '{key}'")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {key} must be in [-100, 100]")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    audio: dict[str, Any] | None = None
    function_call: Any = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_logprobs: int | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = Field(16, ge=1)
    suffix: str | None = None


class EmbeddingRequest(_Model):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    keep_alive: float | str | None = None


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicRequest(_Model):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    container: Any = None
    mcp_servers: list[Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    thinking: dict[str, Any] | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    keep_alive: float | str | None = None


def parse(model: type[_Model], body: bytes) -> Any:
    """Validate a JSON body; every failure is a 400 naming the field."""
    if not body or not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    extra = req.unknown_fields()
    if extra:
        raise InvalidRequest(f"Unrecognized request argument supplied: {extra[0]}", param=extra[0],
                             code="unknown_parameter")
    for name in ("messages",):
        for i, msg in enumerate(getattr(req, name, None) or ()):
            if msg.unknown_fields():
                key = msg.unknown_fields()[0]
                raise InvalidRequest(f"Unrecognized argument in {name}[{i}]: {key}", param=f"{name}[{i}].{key}",
                                     code="unknown_parameter")
    return req


def _validation_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequest(f"The body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}.")
    if err["type"] == "model_type":
        return InvalidRequest("The request body must be a JSON object.")
    loc = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    if err["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    return InvalidRequest(f"Invalid value for '{param}': {err['msg']}.", param=param, code="invalid_value")


_UNION_TAGS = {"str", "list", "int", "float", "bool", "dict", "none", "function-after", "function-before"}
