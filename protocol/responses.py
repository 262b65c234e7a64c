"""OpenAI Responses API wire structs (``POST /v1/responses``, stateless).

``input`` is a string or a list of items; an item without ``type`` but with a
``role`` is a message (the API's "easy input message"). Items and content
parts are tagged unions on ``type``: an unknown type is a 400 naming its path.
The answer is a ``Response`` whose ``output`` is a list of output items.
"""

from __future__ import annotations

from typing import Any

import msgspec


class InputText(msgspec.Struct, tag="input_text", tag_field="type", kw_only=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = []


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True):
    image_url: str | None = None
    file_id: str | None = None  # refused: mlxd has no Files API
    detail: str | None = None


Part = InputText | OutputText | InputImage


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    role: str
    content: str | list[Part]


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None


class FunctionCallOutputItem(
    msgspec.Struct, tag="function_call_output", tag_field="type", kw_only=True
):
    call_id: str
    output: str | list[Part]


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None  # the reasoning text is returned whole; there is no summarizer


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None  # refused: mlxd keeps no state
    store: bool | None = None  # accepted; nothing is ever stored
    include: list[str] | None = None  # accepted; nothing extra (e.g. encrypted reasoning) exists
    user: str | None = None
    metadata: dict[str, Any] | None = None


# ---- the answer ----------------------------------------------------------------------


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type", kw_only=True):
    text: str


class OutReasoning(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    """The whole reasoning text, in ``content`` (there is no summarizer)."""

    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []


class OutMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputText] = []


class OutFunctionCall(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = OutReasoning | OutMessage | OutFunctionCall


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
    code: str
    message: str


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
    temperature: float = 1.0
    top_p: float = 1.0
    parallel_tool_calls: bool = True
    tool_choice: str | NamedFunction = "auto"
    tools: list[FunctionTool] = []
    text: TextConfig | dict[str, Any] = {}
    object: str = "response"
    store: bool = False
    previous_response_id: str | None = None


encoder = msgspec.json.Encoder()
decoder = msgspec.json.Decoder(ResponsesRequest)
