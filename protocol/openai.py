"""OpenAI wire structs: what clients send and what mlxd answers, as JSON.

Unknown request fields are ignored (msgspec's default); a wrong type is a 400
naming the field. Encoders and decoders are built once per type.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


class WireFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class WireToolCall(msgspec.Struct, kw_only=True):
    function: WireFunctionCall
    id: str = ""
    type: str = "function"


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None


class _TextPart(msgspec.Struct, kw_only=True):
    text: str = ""


class _ImagePart(msgspec.Struct, kw_only=True):
    image_url: ImageUrl | str  # a bare URL string is accepted too


class WireText(_TextPart, tag="text", tag_field="type"):
    pass


class WireInputText(_TextPart, tag="input_text", tag_field="type"):
    pass


class WireOutputText(_TextPart, tag="output_text", tag_field="type"):
    pass


class WireImageUrl(_ImagePart, tag="image_url", tag_field="type"):
    pass


class WireInputImage(_ImagePart, tag="input_image", tag_field="type"):
    pass


# Content parts: a tagged union on ``type``, so an unknown part type is a 400 naming its path.
WirePart = WireText | WireInputText | WireOutputText | WireImageUrl | WireInputImage


class WireMessage(msgspec.Struct, kw_only=True):
    role: str  # one of ROLES, checked with the field's path
    content: str | list[WirePart] | None = None
    name: str | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None
    function_call: WireFunctionCall | None = None  # legacy function calling (an assistant turn)
    # an assistant turn's reasoning as mlxd (reasoning_content) and others (reasoning) send it
    reasoning_content: str | None = None
    reasoning: str | None = None


# Chat roles; ``function`` is legacy function calling's result turn (named by ``name``).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # schemas are always enforced when a call is forced


class WireTool(msgspec.Struct, kw_only=True):
    function: FunctionDef
    type: str = "function"


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: NamedFunction
    type: str = "function"


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    user: str | None = None  # an end-user id for the operator's logs; no effect on output
    priority: int | None = None  # lower runs first; honoured when admission.priority is on
    # mlxd extensions (README "Speculative decoding"): false opts this request out of
    # drafting; spec_prefill true/false overrides the server's SpecPrefill default.
    speculative: bool | None = None
    spec_prefill: bool | None = None
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[WireMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[WireTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # mlxd's extension: false leaves a call opened in tool_choice auto free of the schema
    constrain_tool_calls: bool | None = None
    # legacy function calling: tools and tool_choice under their old names, answered with
    # ``message.function_call`` and finish_reason ``function_call``
    functions: list[FunctionDef] | None = None
    function_call: str | NamedFunction | None = None
    reasoning_effort: str | None = None  # → the template's enable_thinking
    prompt_cache_key: str | None = None  # groups requests that share a prompt prefix
    # refused unless they ask for what mlxd does anyway (text, no search, default verbosity)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: the template is the model's own


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int]
    logprobs: int | None = None
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


class OutToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: WireFunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """As OpenAI writes it: ``refusal`` (always null: no refusal classifier) and
    ``annotations`` (always empty: no web search) are present, the rest only when set."""

    role: str  # no default, so omit_defaults keeps it
    content: str | None
    refusal: str | None
    annotations: list[Any]
    reasoning_content: str | None = None
    tool_calls: list[OutToolCall] | None = None
    function_call: WireFunctionCall | None = None  # legacy function calling


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ContentLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[ContentLogprob]


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    arguments: str
    name: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call's first delta has ``id``, ``type`` and ``function.name``; later ones only arguments."""

    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``refusal`` is written (null) only in the first delta, with the role, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    refusal: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None  # legacy function calling


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: TextLogprobs | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    """A served model; ``status`` (an mlxd extension): unloaded, loading, loaded or failed."""

    id: str
    created: int
    owned_by: str = "mlxd"
    object: str = "model"
    status: str | None = None


class AdapterCard(ModelCard, kw_only=True):
    """A served LoRA adapter, as vLLM lists its ``--lora-modules``: ``parent`` the served
    model it adapts, ``root`` its directory; ``error`` (mlxd's) why its ``status`` is
    ``failed`` (its files do not fit the base), else ``null``."""

    parent: str
    root: str
    error: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard | AdapterCard]
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
