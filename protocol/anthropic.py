"""Anthropic Messages wire structs (``/v1/messages``, ``/v1/messages/count_tokens``).

Content blocks are a tagged union on ``type``: an unknown block type is a 400
naming its path. Unknown fields are ignored, as everywhere in mlxd.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class TextBlock(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching hint; mlxd has no cache to steer


class Base64Source(msgspec.Struct, tag="base64", tag_field="type", kw_only=True):
    media_type: str  # image/jpeg, image/png, ...; the decoder reads the bytes, not this
    data: str


class UrlSource(msgspec.Struct, tag="url", tag_field="type", kw_only=True):
    url: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", kw_only=True):
    """An image for a vision model; any other source type (``file``) is a 400."""

    source: Base64Source | UrlSource


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(
    msgspec.Struct, tag="redacted_thinking", tag_field="type", kw_only=True
):
    data: str


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] = {}
    description: str = ""
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    messages: list[InputMessage]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id for the operator's logs; no effect on output


# ---- responses ----------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class OutText(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class OutThinking(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str = ""


class OutToolUse(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class Message(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[OutText | OutThinking | OutToolUse]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


encoder = msgspec.json.Encoder()
messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_decoder = msgspec.json.Decoder(CountTokensRequest)
