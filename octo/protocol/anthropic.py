"""Request models of the Anthropic Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``), strict
like every octo request model (``octo.protocol.openai``): a wrong JSON type or an unknown key at any depth is a 400
naming it. Content blocks and tools of a type octo does not serve (documents, server tools such as ``web_search_*``)
are kept whole and refused by the serving layer (``octo.serving.anthropic``) with a 400 naming them.
``cache_control`` is accepted wherever Anthropic's API takes it: octo's prefix cache is automatic. What octo does with
each field of the official SDK's ``MessageCreateParams`` (honoured, accepted and ignored, or refused) is in
docs/api.md; tests/test_anthropic_sweep.py holds the SDK's types to that list."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from octo.protocol import openai as protocol
from octo.protocol.openai import INT32, MAX_TOKENS_LIMIT, Model, Other, check_stops

# the union members' tags are not part of a field's path in a 400 (octo.protocol.openai._path)
protocol.UNION_TAGS.update({"text-block", "other-block", "tool-use-block", "tool-result-block", "thinking-block",
                             "redacted-thinking-block", "custom-tool", "server-tool", "tool-search-tool",
                             "tool-reference-block", "server-tool-use-block", "tool-search-result-block",
                             "search-hits", "search-error", "tool-change-block", "image-block", "base64-source",
                             "url-source", "file-source"})


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


class Base64Source(Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(Model):
    type: Literal["url"]
    url: str


class FileSource(Model):
    type: Literal["file"]
    file_id: str


def _source_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"url": "url-source", "file": "file-source"}.get(kind, "base64-source") if isinstance(kind, str) \
        else "base64-source"


class ImageTransformations(Model):
    oversized_image: Literal["downsize", "error"] | None = None


class ImageBlock(Model):
    """An image: ``source`` base64 (with its media type), a URL (fetched where the server allows its host:
    ``--allow-image-urls``) or a file of Anthropic's Files API (which octo has not: a 400 naming it)."""

    type: Literal["image"]
    source: Annotated[Annotated[Base64Source, Tag("base64-source")] | Annotated[UrlSource, Tag("url-source")]
                      | Annotated[FileSource, Tag("file-source")], Discriminator(_source_kind)]
    cache_control: CacheControl | None = None  # prompt caching is automatic here (the prefix cache, images too)
    transformations: ImageTransformations | None = None


class ToolReferenceBlock(Model):
    """A deferred tool loaded by a tool search (``defer_loading``): in a ``tool_result`` (a client-side search, as
    Claude Code's ToolSearch) or in a ``tool_search_tool_result`` (octo's server-side search)."""

    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


def _result_part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "text-block", "tool_reference": "tool-reference-block", "image": "image-block"}.get(
        kind, "other-block") if isinstance(kind, str) else "other-block"


# what a tool result holds: text, images (Claude Code's screenshots), tool references (other types: a 400 naming them)
ResultPart = Annotated[Annotated[TextBlock, Tag("text-block")] | Annotated[ImageBlock, Tag("image-block")]
                       | Annotated[ToolReferenceBlock, Tag("tool-reference-block")]
                       | Annotated[OtherBlock, Tag("other-block")], Discriminator(_result_part_kind)]


class ToolUseBlock(Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who made the call: "direct" here (programmatic callers need code execution)
    toolset_name: str | None = None  # the toolset family of a toolset member (the SDK's model_dump() sends null)


class ToolResultBlock(Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ServerToolUseBlock(Model):
    """A call of a server tool, sent back from an earlier answer: octo runs only the tool search tools."""

    type: Literal["server_tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None


class SearchHits(Model):
    type: Literal["tool_search_tool_search_result"]
    tool_references: list[ToolReferenceBlock]


class SearchError(Model):
    type: Literal["tool_search_tool_result_error"]
    error_code: str
    error_message: str | None = None


def _search_content_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "search-error" if kind == "tool_search_tool_result_error" else "search-hits"


class ToolSearchResultBlock(Model):
    type: Literal["tool_search_tool_result"]
    tool_use_id: str
    content: Annotated[Annotated[SearchHits, Tag("search-hits")] | Annotated[SearchError, Tag("search-error")],
                       Discriminator(_search_content_kind)]
    cache_control: CacheControl | None = None


class ThinkingBlock(Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Model):
    type: Literal["redacted_thinking"]
    data: str


class ToolChange(Model):
    """What a ``tool_addition`` or ``tool_removal`` names: octo takes ``tool_reference`` (a tool in ``tools``)."""

    type: str
    name: str | None = None
    server_name: str | None = None
    definition: dict[str, Any] | None = None


class ToolChangeBlock(Model):
    """A system turn's ``tool_addition`` / ``tool_removal`` (beta mid-conversation-tool-changes): the tool is offered,
    or no longer, from that point of the conversation on."""

    type: Literal["tool_addition", "tool_removal"]
    tool: ToolChange
    cache_control: CacheControl | None = None


_BLOCK_TAGS = {"text": "text-block", "image": "image-block", "tool_use": "tool-use-block",
               "tool_result": "tool-result-block", "thinking": "thinking-block",
               "redacted_thinking": "redacted-thinking-block",
               "server_tool_use": "server-tool-use-block", "tool_search_tool_result": "tool-search-result-block",
               "tool_addition": "tool-change-block", "tool_removal": "tool-change-block"}


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _BLOCK_TAGS.get(kind, "other-block") if isinstance(kind, str) else "other-block"


ContentBlock = Annotated[Annotated[TextBlock, Tag("text-block")] | Annotated[ImageBlock, Tag("image-block")]
                         | Annotated[ToolUseBlock, Tag("tool-use-block")]
                         | Annotated[ToolResultBlock, Tag("tool-result-block")]
                         | Annotated[ThinkingBlock, Tag("thinking-block")]
                         | Annotated[RedactedThinkingBlock, Tag("redacted-thinking-block")]
                         | Annotated[ServerToolUseBlock, Tag("server-tool-use-block")]
                         | Annotated[ToolSearchResultBlock, Tag("tool-search-result-block")]
                         | Annotated[ToolChangeBlock, Tag("tool-change-block")]
                         | Annotated[OtherBlock, Tag("other-block")], Discriminator(_block_kind)]


class TurnOutputConfig(Model):
    """A system turn's ``output_config`` (beta per-turn-control): the effort from that turn on."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class AnthropicMessage(Model):
    # "system": a mid-conversation system turn (Claude Code sends them, beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    # system turns only (octo.serving.anthropic checks the role)
    clear_at: Literal["next_user_message", "never"] | None = None
    output_config: TurnOutputConfig | None = None


class CustomTool(Model):
    """A client tool (``type`` absent or "custom"): the model answers with ``tool_use`` blocks for it."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None  # not in the prompt until a tool search loads it (a tool_reference block)
    input_examples: list[dict[str, Any]] | None = None  # shown to the model with the tool's description
    allowed_callers: list[str] | None = None


SEARCH_TOOL_TYPES = {"tool_search_tool_regex_20251119": "regex", "tool_search_tool_regex": "regex",
                     "tool_search_tool_bm25_20251119": "bm25", "tool_search_tool_bm25": "bm25"}


class ToolSearchTool(Model):
    """Anthropic's server-side tool search (regex or BM25 variant): octo runs it over the deferred tools."""

    type: Literal["tool_search_tool_regex_20251119", "tool_search_tool_regex", "tool_search_tool_bm25_20251119",
                  "tool_search_tool_bm25"]
    name: str
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None
    strict: bool | None = None
    allowed_callers: list[str] | None = None

    @property
    def variant(self) -> str:
        return SEARCH_TOOL_TYPES[self.type]


class ServerTool(Other):
    """A versioned Anthropic tool (``bash_20250124``, ``web_search_20250305``, ...): refused with a 400."""


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in (None, "custom"):
        return "custom-tool"
    return "tool-search-tool" if kind in SEARCH_TOOL_TYPES else "server-tool"


Tool = Annotated[Annotated[CustomTool, Tag("custom-tool")] | Annotated[ToolSearchTool, Tag("tool-search-tool")]
                 | Annotated[ServerTool, Tag("server-tool")], Discriminator(_tool_kind)]


class ToolChoice(Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    display: Literal["summarized", "omitted"] | None = None
    block_binding: dict[str, Any] | None = None  # checks of earlier thinking blocks: octo never shows them again


class OutputFormat(Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Model):
    """Structured output (``format``, a JSON schema the answer follows) and ``effort`` (Claude Code sends "high")."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None
    task_budget: dict[str, Any] | None = None  # refused: the model would be told a budget it is not told here


class ContextEdit(Other):
    """One ``context_management`` edit (``clear_thinking_20251015``, ``clear_tool_uses_20250919``, ...): its keys
    depend on its type; the serving layer accepts the ones it honours and refuses the others naming them."""


class ContextManagement(Model):
    edits: list[ContextEdit] | None = None


class Metadata(Model):
    user_id: str | None = None  # Claude Code sends a JSON string of its ids; logged nowhere, used for nothing


class Compaction(Model):
    """Server-side summarising of a conversation that outgrows the context (beta): not done here, a prompt that does
    not fit stays a 400."""

    type: Literal["summarize"]
    instructions: str | None = None


class Diagnostics(Model):
    previous_message_id: str | None = None  # the answer carries no cache-miss diagnostics


class Thread(Model):
    """Server-side conversation threads (beta): octo stores none, so ``continue`` is refused."""

    type: Literal["create", "continue"]
    previous_message_id: str | None = None


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
    # accepted and ignored (docs/api.md says why): they change nothing in the prompt or the answer
    speed: Literal["standard", "fast"] | None = None
    compaction: Compaction | None = None
    billing_policy: dict[str, Any] | None = None


class AnthropicRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    container: Any = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    diagnostics: Diagnostics | None = None
    inference_geo: str | None = None
    fallbacks: list[dict[str, Any]] | None = None  # other models to try when this one fails: octo serves the one named
    fallback_credit_token: str | dict[str, Any] | None = None  # billing of a retry after a refusal
    thread: Thread | None = None
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
