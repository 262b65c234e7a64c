"""OpenAI wire structs: what clients send and what mlxd answers, as JSON.

Unknown request fields are ignored (msgspec's default); a wrong type is a 400
naming the field. Encoders and decoders are built once per type.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


class WireMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None  # lower runs first; honoured when admission.priority is on
    # mlxd extensions (README "Speculative decoding"): false opts this request out of
    # drafting; spec_prefill true/false overrides the server's SpecPrefill default.
    speculative: bool | None = None
    spec_prefill: bool | None = None
    # Accepted so that they can be refused by name instead of silently ignored.
    logprobs: bool | int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[WireMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int]
    echo: bool = False
    suffix: str | None = None


# ---- responses ----------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``prefilled_tokens`` (an mlxd extension) appears only when SpecPrefill skipped
    part of the prompt: the prompt tokens the model actually processed."""

    cached_tokens: int  # no default: always written
    prefilled_tokens: int | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str = ""


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "mlxd"
    object: str = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


encoder = msgspec.json.Encoder()
chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)

_PATH = re.compile(r"at `\$\.?([^`]*)`")


def error_param(exc: msgspec.DecodeError) -> str | None:
    """The field path from a msgspec error (``$.messages[0].role`` → ``messages[0].role``)."""
    match = _PATH.search(str(exc))
    return match.group(1) or None if match else None
