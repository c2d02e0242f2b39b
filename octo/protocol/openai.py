"""Request models of the HTTP API (pydantic), fields in the order of the OpenAI/Anthropic documentation.

Validation is strict, as OpenAI's API is: a value of the wrong JSON type is a 400 ``invalid_type`` naming the
field with its path (``messages[0].content``), never coerced (``"8"`` is not an integer, ``1`` is not a boolean;
an integer is a number). Every request model allows extra keys only to name them in a 400 ("Unrecognized
request argument"), at any depth; fields that exist in the API but that octo does not implement are declared,
so a request that sets them gets a 400 naming the field instead of being silently ignored (see
``serving.check_unsupported``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from octo.errors import InvalidRequest

# -- limits (README "Limits"): generous, but finite, so that no request can hold the server hostage ----------
MAX_STOPS = 16  # stop strings per request (OpenAI allows 4), `stop` and Anthropic's `stop_sequences`
MAX_STOP_CHARS = 500  # characters per stop string
MAX_TOKENS_LIMIT = 2**24  # max_tokens and the like; beyond the model's context it is a 400 anyway
MAX_N = 128  # choices per request
MAX_EMBEDDING_INPUTS = 2048  # inputs per embeddings request (OpenAI's limit)
MAX_EMBEDDING_TOKENS = 300_000  # token ids per embeddings request (OpenAI's limit on tokens)
MAX_EMBEDDING_CHARS = 1_200_000  # characters of text per embeddings request (about 300,000 tokens of English)
INT32 = 2**31 - 1
_INT64 = 2**63


class Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True, allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return list(self.model_extra or ())


class Other(BaseModel):
    """A content part or block of a type octo does not serve: kept whole, refused in the serving layer with a 400
    naming it (an unsupported type, not an unknown argument)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text-part" if kind == "text" else "image-part" if kind == "image_url" else "other-part"


class TextPart(Model):
    type: Literal["text"]
    text: str


class ImageUrl(Model):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's projector decides the resolution


class ImageUrlPart(Model):
    type: Literal["image_url"]
    image_url: ImageUrl


class OtherPart(Other):
    pass


ContentPart = Annotated[Annotated[TextPart, Tag("text-part")] | Annotated[ImageUrlPart, Tag("image-part")]
                        | Annotated[OtherPart, Tag("other-part")], Discriminator(_part_kind)]


class CalledFunction(Model):
    name: str
    arguments: str


class MessageToolCall(Model):
    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDefinition(Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Model):
    name: str


class NamedToolChoice(Model):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class StreamOptions(Model):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class JsonSchemaFormat(Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # required, as OpenAI's API has it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def check_stops(stops: list[str], param: str) -> None:
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop sequence {i} has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")


def default_if_null(cls, v, info):
    """A ``mode="before"`` field validator: null, where OpenAI's API lets a field be null, means the field's default."""
    return cls.model_fields[info.field_name].default if v is None else v


class _Sampling(Model):
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # extensions common to local servers (llama.cpp, vLLM; keep_alive: Ollama's, seconds or a duration)
    top_k: int | None = Field(None, ge=0, le=INT32)
    keep_alive: float | str | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, alias="repeat_penalty")
    ignore_eos: bool | None = None  # vLLM's and llama-server's: never end at an end-of-sequence token (stops still do)

    _null_is_default = field_validator("n", "stream", mode="before")(default_if_null)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is not None:
            check_stops([v] if isinstance(v, str) else v, "stop")
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


METADATA_MAX_KEYS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512  # OpenAI's limits


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """``metadata`` within OpenAI's limits: 16 keys, keys of 64 characters, values of 512 (400 naming it)."""
    if value is None:
        return value
    if len(value) > METADATA_MAX_KEYS:
        raise ValueError(f"at most {METADATA_MAX_KEYS} keys, got {len(value)}")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY:
            raise ValueError(f"keys have at most {METADATA_MAX_KEY} characters, got one of {len(key)}")
        if len(item) > METADATA_MAX_VALUE:
            raise ValueError(f"values have at most {METADATA_MAX_VALUE} characters, got one of {len(item)} "
                             f"(key '{key}')")
    return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    audio: dict[str, Any] | None = None
    function_call: Any = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    metadata: dict[str, str] | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)  # vLLM's: no EOS or stop string before
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[FunctionTool] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    verbosity: str | None = None
    _metadata_limits = field_validator("metadata")(check_metadata)
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    response_format: ResponseFormat | None = None  # an extension (vLLM's): structured output on completions
    suffix: str | None = None

    # (max_tokens null: its default 16, not "no limit")
    _null_completion_default = field_validator("echo", "max_tokens", mode="before")(default_if_null)


class EmbeddingRequest(Model):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    dimensions: int | None = Field(None, ge=1, le=INT32)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    keep_alive: float | str | None = None


def parse(model: type[Model], body: bytes) -> Any:
    """Validate a JSON body; every failure is a 400 naming the field."""
    if not body or not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _check_unknown(req, "")
    return req


_LEAVES = frozenset({str, int, bool, type(None)})
_KEYS: dict[type, dict[str, str]] = {}  # per model class: field name -> the key a request spells it with


def _keys(cls: type[Model]) -> dict[str, str]:
    keys = _KEYS.get(cls)
    if keys is None:
        keys = _KEYS[cls] = {name: f.alias or name for name, f in cls.model_fields.items()}
    return keys


def _check_unknown(value: Any, path: str) -> None:
    """A 400 naming the first key no model declares, at any depth (``stream_options.foo``, ``messages[0].x``), or the
    first NaN or Infinity literal inside free-form JSON (typed number fields refuse them themselves). Runs on every
    request: it reads pydantic's own attributes (no property calls) and builds a path only where it descends."""
    if isinstance(value, Model):
        extra = value.__pydantic_extra__
        if extra:
            key = next(iter(extra))
            if not path:
                raise InvalidRequest(f"Unrecognized request argument supplied: {key}", param=key,
                                     code="unknown_parameter")
            raise InvalidRequest(f"Unrecognized argument in {path}: {key}", param=f"{path}.{key}",
                                 code="unknown_parameter")
        keys = None
        attrs = value.__dict__
        for name in value.__pydantic_fields_set__:
            item = attrs.get(name)
            if item.__class__ in _LEAVES:  # nothing inside (the common case: no path built, no call)
                continue
            keys = keys or _keys(type(value))
            key = keys.get(name)
            if key is not None:
                _check_unknown(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (Model, list, dict, float)):
                _check_unknown(item, f"{path}[{i}]")
    elif isinstance(value, dict):  # free-form JSON (a schema, metadata, a tool's input): NaN is not JSON there either
        for key, item in value.items():
            if isinstance(item, (list, dict, float)):
                _check_unknown(item, f"{path}.{key}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"Invalid value for '{path}': NaN and Infinity are not JSON numbers.", param=path,
                             code="invalid_value")


# -- errors -------------------------------------------------------------------------------------------
UNION_TAGS = {"str", "list", "int", "float", "bool", "dict", "none", "function-after", "function-before",
               "text-part", "image-part", "other-part", "text-block", "other-block", "NamedToolChoice", "text-content",
               "other-content", "message-item", "call-item", "output-item", "other-item", "function-tool",
               "other-tool", "FunctionChoice"}
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object", "literal_error": None}


def _path(loc: tuple) -> str:
    param = ""
    for part in loc:
        if isinstance(part, str) and ("[" in part or part in UNION_TAGS):
            continue  # the union member a nested error came from
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def validation_error(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(f"The body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}.",
                              code="invalid_json")
    if not first["loc"] and first["type"] in ("model_type", "model_attributes_type"):
        return InvalidRequest(f"The request body must be a JSON object, got {_json_kind(first['input'])}.",
                              code="invalid_type")
    # the deepest error explains best: for `content: [1]`, "messages[0].content[0] must be an object" rather than
    # "messages[0].content must be a string"; a union's type errors at that same place list every expected type
    err = max(errors, key=lambda e: len(_path(e["loc"]).replace("[", ".").split(".")))
    param = _path(err["loc"])
    if err["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if err["type"] in _EXPECTED and err["type"] != "literal_error":
        expected = []
        for e in errors:
            want = _EXPECTED.get(e["type"])
            if want and _path(e["loc"]) == param and want not in expected:
                expected.append(want)
        return InvalidRequest(f"Invalid type for '{param}': expected {' or '.join(expected)}, but got "
                              f"{_json_kind(err['input'])} instead.", param=param, code="invalid_type")
    msg = err["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")
