"""Request models of the Responses API (``POST /v1/responses``), strict like every octo request model
(``octo.protocol.openai``): a wrong JSON type or an unknown key at any depth is a 400 naming it. Fields of the API that
octo does not implement are declared so that a request setting them gets a 400 naming the field
(``octo.serving.responses.check_unsupported``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from octo.protocol import openai as protocol
from octo.protocol.openai import MAX_TOKENS_LIMIT, Model, Other, check_metadata, default_if_null

protocol.UNION_TAGS.add("image-content")  # (a union member's tag is not part of a field's path in a 400)


class InputText(Model):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(Model):
    """An image: ``image_url`` a data URL (or an http(s) URL the server may fetch: ``--allow-image-urls``);
    ``file_id`` names a file of OpenAI's Files API, which octo has not (a 400 naming it)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None  # accepted: the projector decides the resolution


class OtherContent(Other):
    pass


def _content_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text-content" if kind in ("input_text", "output_text") else "image-content" if kind == "input_image" \
        else "other-content"


Content = Annotated[Annotated[InputText, Tag("text-content")] | Annotated[InputImage, Tag("image-content")]
                    | Annotated[OtherContent, Tag("other-content")], Discriminator(_content_kind)]


class MessageItem(Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a function of a namespace tool (octo.serving.responses.ToolNames)
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Content]
    id: str | None = None
    status: str | None = None


class OtherItem(Other):
    pass


def _item_kind(value: Any) -> str:
    if not isinstance(value, dict):
        return "message-item"
    kind = value.get("type", "message")
    if not isinstance(kind, str):  # a wrong type of `type`: the message model names it
        return "message-item"
    return {"message": "message-item", "function_call": "call-item",
            "function_call_output": "output-item"}.get(kind, "other-item")


InputItem = Annotated[Annotated[MessageItem, Tag("message-item")] | Annotated[FunctionCallItem, Tag("call-item")]
                      | Annotated[FunctionCallOutputItem, Tag("output-item")] | Annotated[OtherItem, Tag("other-item")],
                      Discriminator(_item_kind)]


class FunctionTool(Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(Model):
    """A group of function tools (Codex's ``multi_agent_v1``, MCP servers): the model calls its functions, and the
    call names the namespace."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class OtherTool(Other):
    pass


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"function": "function-tool", "namespace": "namespace-tool"}.get(kind, "other-tool")


Tool = Annotated[Annotated[FunctionTool, Tag("function-tool")] | Annotated[NamespaceTool, Tag("namespace-tool")]
                 | Annotated[OtherTool, Tag("other-tool")], Discriminator(_tool_kind)]


class FunctionChoice(Model):
    type: Literal["function"]
    name: str


class TextFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Model):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(Model):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Model):
    include_obfuscation: bool | None = None


class ResponsesRequest(Model):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, str] | None = None  # what Codex sends: identifiers for the log (octo.serving.responses)
    seed: int | None = None  # an extension, as for chat (OpenAI's Responses API has none)
    # declared to be refused by name (not implemented): 400 naming them
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Reasoning | None = None
    max_tool_calls: int | None = None
    keep_alive: float | str | None = None

    _null_is_default = field_validator("store", "stream", mode="before")(default_if_null)
    _metadata_limits = field_validator("metadata")(check_metadata)
