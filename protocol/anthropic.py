"""Anthropic Messages wire structs (``/v1/messages``, ``/v1/messages/count_tokens``).

Content blocks are a tagged union on ``type``: an unknown block type is a 400
naming its path. Unknown fields are ignored, as everywhere in mlxd; the fields
Claude Code and the SDKs send are declared, so each is either honoured or
refused by ``daemon/api/anthropic.py``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class CacheControl(msgspec.Struct, kw_only=True):
    """A prompt-caching breakpoint: the prompt up to here is worth a prefix-cache
    snapshot. ``ttl`` is accepted; snapshots live until the cache evicts them."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlock(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # earlier answers' citations; not rendered


class Base64Source(msgspec.Struct, tag="base64", tag_field="type", kw_only=True):
    media_type: str  # image/jpeg, image/png, ...; the decoder reads the bytes, not this
    data: str


class UrlSource(msgspec.Struct, tag="url", tag_field="type", kw_only=True):
    url: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", kw_only=True):
    """An image for a vision model; any other source type (``file``) is a 400."""

    source: Base64Source | UrlSource
    cache_control: CacheControl | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    """Earlier thinking; accepted (with any signature) and not sent back to the template."""

    thinking: str
    signature: str = ""
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(
    msgspec.Struct, tag="redacted_thinking", tag_field="type", kw_only=True
):
    data: str
    cache_control: CacheControl | None = None


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct, kw_only=True):
    """A turn; ``system`` turns (Claude Code sends them mid-conversation) hold text only."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(msgspec.Struct, kw_only=True):
    """A tool definition. ``type`` "custom" or absent; any other type is one of Anthropic's
    server tools (web search, code execution, tool search, MCP toolsets, ...): a 400."""

    name: str = ""
    input_schema: dict[str, Any] = {}
    description: str = ""
    type: str | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool = False  # true: left out of the prompt, as Anthropic does
    input_examples: list[dict[str, Any]] | None = None  # shown to the model with the description
    eager_input_streaming: bool | None = None  # tool input streams once the call is parsed
    strict: bool | None = None  # schemas are always enforced when a call is forced


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(msgspec.Struct, kw_only=True):
    """``enabled`` (with a budget), ``adaptive`` (the model decides; mlxd: on unless the
    effort is low) or ``disabled``; ``display`` "omitted" returns empty thinking blocks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class TokenCount(msgspec.Struct, kw_only=True):
    """``{"type": "input_tokens" | "tool_uses", "value": n}`` in a context edit."""

    type: Literal["input_tokens", "tool_uses"]
    value: int


class ClearToolUses(msgspec.Struct, tag="clear_tool_uses_20250919", tag_field="type", kw_only=True):
    """Replace old tool results with a placeholder once the prompt passes ``trigger``."""

    trigger: TokenCount | None = None  # default: 100,000 input tokens
    keep: TokenCount | None = None  # default: the 3 latest tool uses
    clear_at_least: TokenCount | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] = False


class ThinkingTurns(msgspec.Struct, kw_only=True):
    type: Literal["thinking_turns"]
    value: int


class ClearThinking(msgspec.Struct, tag="clear_thinking_20251015", tag_field="type", kw_only=True):
    """Drop earlier thinking from the template's history, but for the last ``keep`` turns."""

    keep: Literal["all"] | ThinkingTurns | None = None


ContextEdit = ClearToolUses | ClearThinking


class ContextManagement(msgspec.Struct, kw_only=True):
    edits: list[dict[str, Any]] = []  # each converted to a ContextEdit (unknown type: a 400)


class CountTokensRequest(msgspec.Struct, kw_only=True):
    messages: list[InputMessage]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    # mlxd's extension: false leaves a call opened in tool_choice auto free of the schema
    constrain_tool_calls: bool | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's older spelling
    context_management: ContextManagement | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # refused: mlxd reaches no MCP server
    container: Any = None  # refused: mlxd runs no code-execution container
    chat_template: Any = None  # refused: the template is the server's


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id for the operator's logs; no effect on output
    service_tier: str | None = None  # one tier here


# ---- responses ----------------------------------------------------------------------


# The answer's fields that the Messages schema lists as required but nullable, in the shapes
# the official SDK declares (``anthropic/types/``): null where mlxd has nothing to report.


class CacheCreation(msgspec.Struct, kw_only=True):
    """``usage.cache_creation``: the tokens written to Anthropic's 5-minute and 1-hour
    caches; 0 here (a prefix-cache snapshot costs nothing extra)."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """``input_tokens`` are the prompt tokens not read from the prefix cache. The rest
    as Anthropic writes them: one tier (``standard``), no server tools, no region, no
    breakdown of the output tokens."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = msgspec.field(default_factory=CacheCreation)
    server_tool_use: None = None
    service_tier: Literal["standard"] = "standard"
    inference_geo: None = None
    output_tokens_details: None = None


class DeltaUsage(msgspec.Struct, kw_only=True):
    """``message_delta``'s cumulative usage (the SDK's ``MessageDeltaUsage``: no cache
    breakdown, tier or region)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    server_tool_use: None = None
    output_tokens_details: None = None


class OutText(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    citations: None = None


class OutThinking(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str = ""


class DirectCaller(msgspec.Struct, tag="direct", tag_field="type"):
    """``{"type": "direct"}``: the model called the tool itself (not from server code)."""


class OutToolUse(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    caller: DirectCaller = msgspec.field(default_factory=DirectCaller)


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The answer; ``context_management`` only when the request asked for edits (the
    fields with no default are always written, null or not)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[OutText | OutThinking | OutToolUse]
    stop_reason: str | None
    stop_sequence: str | None
    stop_details: None  # a refusal's details: mlxd has no refusal classifier
    container: None  # mlxd runs no code-execution container
    usage: Usage
    context_management: dict[str, Any] | None = None


encoder = msgspec.json.Encoder()
messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_decoder = msgspec.json.Decoder(CountTokensRequest)
