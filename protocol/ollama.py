"""Ollama wire structs: what Ollama's clients send to ``/api/*`` and what mlxd answers.

Unknown request fields (and unknown ``options``) are ignored, as Ollama ignores them; a
wrong type is a 400 naming the field. Answers leave out the fields that do not apply
(``omit_defaults``), as Ollama does; the fields a client reads to tell a stream's last
object (``done``) are always there.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The version of Ollama's API these routes follow (``/api/version``); clients compare it
# against the version that introduced a feature (tools, structured outputs, thinking).
API_VERSION = "0.12.6"

# ---- requests -----------------------------------------------------------------------------


class Options(msgspec.Struct, kw_only=True):
    """Ollama's model options. The sampling ones map onto mlxd's; the runtime ones
    (threads, GPU layers, batch size, memory mapping) do not change an answer."""

    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    num_ctx: int | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(msgspec.Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ToolFunction(msgspec.Struct, kw_only=True):
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: ToolFunction


Format = str | dict[str, Any] | None  # "" / "json", or a JSON schema
KeepAliveValue = float | str | None  # seconds, or a duration ("5m", "1h30m", "-1")
Think = bool | str | None  # true / false, or an effort ("low", "medium", "high")


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    messages: list[Message] = []
    tools: list[Tool] | None = None
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAliveValue = None
    think: Think = None
    logprobs: bool = False
    top_logprobs: int = 0
    template: str | None = None
    # mlxd's extension: false leaves a call opened in tool_choice auto free of the schema
    constrain_tool_calls: bool | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAliveValue = None
    think: Think = None
    logprobs: bool = False
    top_logprobs: int = 0


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the field's older name
    verbose: bool = False


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[str] = []
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: KeepAliveValue = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """The legacy ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    model: str = ""
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAliveValue = None


# ---- answers ------------------------------------------------------------------------------


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class Logprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class OutFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: Any
    index: int = 0


class OutToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: OutFunctionCall


class OutMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[OutToolCall] | None = None


class Timings(msgspec.Struct, kw_only=True):
    """A finished request's counts and durations (nanoseconds), as Ollama reports them."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class ChatChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    message: OutMessage
    done: bool
    done_reason: str | None = None
    logprobs: list[Logprob] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class GenerateChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    response: str
    done: bool
    thinking: str | None = None
    done_reason: str | None = None
    logprobs: list[Logprob] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class Details(msgspec.Struct, kw_only=True):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ListedModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class Tags(msgspec.Struct, kw_only=True):
    models: list[ListedModel]


class RunningModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: Details
    expires_at: str
    size_vram: int
    context_length: int


class Running(msgspec.Struct, kw_only=True):
    models: list[RunningModel]


class Show(msgspec.Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(msgspec.Struct, kw_only=True):
    version: str


class Embed(msgspec.Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class Embedding(msgspec.Struct, kw_only=True):
    embedding: list[float]


class Error(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Ollama's ``{"error": "..."}``; mlxd adds ``code``, the reason, where it has one
    (as OpenAI's ``error.code``: ``shutting_down``, ``queue_full``, ...)."""

    error: str
    code: str | None = None


encoder = msgspec.json.Encoder()
chat_decoder = msgspec.json.Decoder(ChatRequest)
generate_decoder = msgspec.json.Decoder(GenerateRequest)
show_decoder = msgspec.json.Decoder(ShowRequest)
embed_decoder = msgspec.json.Decoder(EmbedRequest)
embeddings_decoder = msgspec.json.Decoder(EmbeddingsRequest)
