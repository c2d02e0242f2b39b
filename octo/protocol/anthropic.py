"""Request models of the Anthropic Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``), strict
like every octo request model (``octo.protocol.openai``): a wrong JSON type or an unknown key at any depth is a 400
naming
it. Content blocks and tools of a type octo does not serve (images, documents, server tools such as
``web_search_*``) are kept whole and refused by the serving layer (``octo.serving.anthropic``) with a 400 naming them.
``cache_control`` is accepted wherever Anthropic's API takes it: octo's prefix cache is automatic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from octo.protocol import openai as protocol
from octo.protocol.openai import INT32, MAX_TOKENS_LIMIT, Model, Other, check_stops

# the union members' tags are not part of a field's path in a 400 (octo.protocol.openai._path)
protocol.UNION_TAGS.update({"text-block", "other-block", "tool-use-block", "tool-result-block", "thinking-block",
                             "redacted-thinking-block", "custom-tool", "server-tool"})


class CacheControl(Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # prompt caching is automatic here (the prefix cache)
    citations: list[Any] | None = None


class OtherBlock(Other):
    pass


def _text_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text-block" if kind == "text" else "other-block"


# system prompts and tool results hold text blocks (other types: a 400 naming them)
TextOrOther = Annotated[Annotated[TextBlock, Tag("text-block")] | Annotated[OtherBlock, Tag("other-block")],
                        Discriminator(_text_kind)]


class ToolUseBlock(Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None


class ToolResultBlock(Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextOrOther] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Model):
    type: Literal["redacted_thinking"]
    data: str


_BLOCK_TAGS = {"text": "text-block", "tool_use": "tool-use-block", "tool_result": "tool-result-block",
               "thinking": "thinking-block", "redacted_thinking": "redacted-thinking-block"}


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _BLOCK_TAGS.get(kind, "other-block") if isinstance(kind, str) else "other-block"


ContentBlock = Annotated[Annotated[TextBlock, Tag("text-block")] | Annotated[ToolUseBlock, Tag("tool-use-block")]
                         | Annotated[ToolResultBlock, Tag("tool-result-block")]
                         | Annotated[ThinkingBlock, Tag("thinking-block")]
                         | Annotated[RedactedThinkingBlock, Tag("redacted-thinking-block")]
                         | Annotated[OtherBlock, Tag("other-block")], Discriminator(_block_kind)]


class AnthropicMessage(Model):
    # "system": a mid-conversation system turn (Claude Code sends them, beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class CustomTool(Model):
    """A client tool (``type`` absent or "custom"): the model answers with ``tool_use`` blocks for it."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class ServerTool(Other):
    """A versioned Anthropic tool (``bash_20250124``, ``web_search_20250305``, ...): refused with a 400."""


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom-tool" if kind in (None, "custom") else "server-tool"


Tool = Annotated[Annotated[CustomTool, Tag("custom-tool")] | Annotated[ServerTool, Tag("server-tool")],
                 Discriminator(_tool_kind)]


class ToolChoice(Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Model):
    """Structured output (``format``, a JSON schema the answer follows) and ``effort`` (Claude Code sends "high")."""

    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None


class ContextEdit(Other):
    """One ``context_management`` edit (``clear_thinking_20251015``, ``clear_tool_uses_20250919``, ...): its keys
    depend on its type; the serving layer accepts the ones it honours and refuses the others naming them."""


class ContextManagement(Model):
    edits: list[ContextEdit] | None = None


class Metadata(Model):
    user_id: str | None = None  # Claude Code sends a JSON string of its ids; logged nowhere, used for nothing


class AnthropicCountTokensRequest(Model):
    """``/v1/messages/count_tokens``: what makes the prompt of a request."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextOrOther] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # top-level automatic caching: accepted, the prefix cache is automatic
    mcp_servers: list[Any] | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    keep_alive: float | str | None = None


class AnthropicRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    container: Any = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32)
    top_p: float | None = Field(None, gt=0.0, le=1.0)

    @field_validator("stop_sequences")
    @classmethod
    def _stop(cls, v):
        if v is not None:
            check_stops(v, "stop_sequences")
        return v
