"""OpenAI Responses API wire structs (``/v1/responses``).

``input`` is a string or a list of items; an item without ``type`` but with a
``role`` is a message (the API's "easy input message"). Items and content
parts are tagged unions on ``type``: an unknown type is a 400 naming its path.
``tools`` stay raw objects here (hosted tools carry fields of their own); the
handler reads each one as a ``FunctionTool``, ``NamespaceTool`` or ``CustomTool``
by its ``type``. The answer is a ``Response`` whose ``output`` is a list of
output items; it echoes the request's own settings.
"""

from __future__ import annotations

from typing import Any

import msgspec


class InputText(msgspec.Struct, tag="input_text", tag_field="type", kw_only=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []  # filled only with include "message.output_text.logprobs"


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True):
    image_url: str | None = None
    file_id: str | None = None  # refused: mlxd has no Files API
    detail: str | None = None


Part = InputText | OutputText | InputImage


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    role: str
    content: str | list[Part]
    id: str | None = None


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    arguments: str = "{}"
    namespace: str | None = None  # a call to a tool of a ``namespace`` tool
    id: str | None = None


class FunctionCallOutputItem(
    msgspec.Struct, tag="function_call_output", tag_field="type", kw_only=True
):
    call_id: str
    output: str | list[Part]


class CustomToolCallItem(msgspec.Struct, tag="custom_tool_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    input: str
    id: str | None = None


class CustomToolCallOutputItem(
    msgspec.Struct, tag="custom_tool_call_output", tag_field="type", kw_only=True
):
    call_id: str
    output: str | list[Part]


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    """An earlier reasoning item sent back; ``encrypted_content`` must be mlxd's own."""

    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None


InputItem = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
)


# ---- tools --------------------------------------------------------------------------------


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, kw_only=True):
    """A named group of function tools; a call to one names it and its ``namespace``."""

    type: str = "namespace"
    name: str
    description: str | None = None
    tools: list[FunctionTool] = []


class CustomFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # text | grammar
    syntax: str | None = None  # lark | regex
    definition: str | None = None


class CustomTool(msgspec.Struct, kw_only=True):
    """A free-form tool: its call carries one string, ``input``."""

    type: str = "custom"
    name: str
    description: str | None = None
    format: CustomFormat | None = None


class NamedTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``tool_choice`` naming one tool: ``function`` (optionally in a namespace) or ``custom``."""

    type: str
    name: str | None = None
    namespace: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)
    verbosity: str | None = None  # echoed; a hint mlxd has no way to follow


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    # No summarizer: any value puts the whole reasoning text in the item's ``summary``.
    summary: str | None = None
    generate_summary: str | None = None  # the older name of ``summary``


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | NamedTool | None = None
    parallel_tool_calls: bool = True
    # mlxd's extension: false leaves a call opened in tool_choice auto free of the schema
    constrain_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    store: bool = True  # kept in the daemon's bounded store ([responses] settings)
    prompt_cache_key: str | None = None
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    # Refused with a 400: mlxd answers synchronously, has no Conversations API, no
    # stored prompt templates, and the chat template is the server's.
    background: bool | None = None
    conversation: Any | None = None
    prompt: Any | None = None
    chat_template: Any | None = None


# ---- the answer ----------------------------------------------------------------------


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type", kw_only=True):
    text: str


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type", kw_only=True):
    text: str


class OutReasoning(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    """The whole reasoning text: in ``content``, or in ``summary`` when one was asked for
    (there is no summarizer); ``encrypted_content`` only when included."""

    id: str
    status: str = "completed"
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class OutMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputText] = []


class OutFunctionCall(
    msgspec.Struct, tag="function_call", tag_field="type", kw_only=True, omit_defaults=True
):
    id: str
    call_id: str
    name: str  # the tool's own name; a namespace's tool also names its ``namespace``
    arguments: str
    status: str
    namespace: str | None = None


class OutCustomToolCall(msgspec.Struct, tag="custom_tool_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    input: str
    status: str = "completed"


OutputItem = OutReasoning | OutMessage | OutFunctionCall | OutCustomToolCall


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens served from the prefix cache


class OutputTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class ErrorInfo(msgspec.Struct, kw_only=True):
    """A failed response's ``error``: ``code`` the failure's reason (as chat's error
    ``code``), ``type`` OpenAI's error type for it."""

    code: str
    message: str
    type: str | None = None
    param: str | None = None


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class Response(msgspec.Struct, kw_only=True):
    """The response object; the request's own settings are echoed back."""

    id: str
    created_at: int
    status: str
    model: str
    output: list[OutputItem]
    usage: Usage | None = None
    error: ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int = 0
    parallel_tool_calls: bool = True
    tool_choice: str | NamedTool = "auto"
    tools: list[dict[str, Any]] = []
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    metadata: dict[str, Any] = {}
    client_metadata: dict[str, Any] | None = None
    object: str = "response"


class Deleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


encoder = msgspec.json.Encoder()
decoder = msgspec.json.Decoder(ResponsesRequest)
