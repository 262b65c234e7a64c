"""Internal messages passed between mlxd's actors.

Types are named by pipeline stage: an HTTP handler builds a ``ChatRequest``
(or ``CompletionRequest``), the tokenizer turns it into a ``TokenizedRequest``,
the generation actor emits one ``EngineStep`` per decode step, and the
detokenizer turns that into ``TextDelta`` / ``Finished`` / ``Failed`` events in
each request's mailbox. Nothing here imports trio or mlx.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "error", "abort", "tool_calls"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling and stopping options, already validated.

    ``max_tokens`` is None when the client named none; the tokenizer resolves it
    against the context window, so the engine always sees a number.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # return the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call the assistant made (in a request's history, or parsed from output)."""

    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message after wire decoding; ``content`` is text or a list of parts.

    Assistant turns may carry ``tool_calls``; ``tool`` turns answer the call
    named by ``tool_call_id``.
    """

    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict = {}


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """Token-level constraint on the output: ``json_schema`` / ``json_object`` or a tool call.

    ``tool_names`` set: the output must be one call (in the model's tool-call
    format) to one of these tools, with arguments matching its schema.
    """

    kind: Literal["json_schema", "json_object", "tool_call"]
    schema: dict | None = None
    tool_names: tuple[str, ...] = ()
    param: str = "response_format"  # the request field it came from, for a 400


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A chat conversation to render with the model's chat template.

    ``tools`` are offered to the model (through its template, or a system-prompt
    description when the template has no tool support); ``tool_choice`` is
    ``auto`` / ``none`` / ``required`` or a tool name. ``template_kwargs`` go to
    the chat template as extra variables (e.g. ``enable_thinking``).
    """

    request_id: str
    messages: tuple[Message, ...]
    sampling: SamplingParams
    arrival: float = 0.0
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict = {}
    constraint: Constraint | None = None
    parse_reasoning: bool = True


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A raw prompt (text, or token ids) for the completions endpoint."""

    request_id: str
    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    arrival: float = 0.0
    constraint: Constraint | None = None


AdmittedRequest = ChatRequest | CompletionRequest


class OutputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the streamer reads a request's output text.

    ``tool_format`` names the tool-call parser (None: no tool parsing);
    ``reasoning`` is the (open, close) tag pair of the reasoning block (None: no
    reasoning parsing); ``in_reasoning`` says the prompt already opened it.
    """

    tool_format: str | None = None
    reasoning: tuple[str, str] | None = None
    in_reasoning: bool = False
    single_tool_call: bool = False


class TokenizedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request ready for the generation actor.

    ``grammar`` is the compiled token-level constraint (an llguidance matcher,
    built off the engine thread), or None.
    """

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    output: OutputSpec = OutputSpec()
    grammar: object | None = None


# ---- admission inbox ----------------------------------------------------------------


class Admit(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the admission controller to run a request (or queue or reject it)."""

    request: AdmittedRequest


class Release(msgspec.Struct, frozen=True, kw_only=True):
    """The request's handler is done with it: free its slot (or its queue place)."""

    request_id: str


AdmissionInbox = Admit | Release


# ---- generation actor inbox ---------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, kw_only=True):
    """Start generating for a tokenized request."""

    request: TokenizedRequest


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Stop generating for a request (client gone, stop string matched, deadline)."""

    request_id: str


EngineInbox = Submit | Abort


# ---- generation actor outbox --------------------------------------------------------


class Started(msgspec.Struct, frozen=True, kw_only=True):
    """The engine accepted a request and is prefilling it; ``output`` tells the streamer how to read it."""

    request_id: str
    prompt_tokens: int
    output: OutputSpec = OutputSpec()


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A sampled token's log-probability and the ``top`` most likely (token, logprob) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenStep(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request in one step; ``finish_reason`` set on its last.

    ``logprobs`` (one per token) only for requests that asked for them.
    """

    request_id: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class Failed(msgspec.Struct, frozen=True, kw_only=True):
    """A per-request failure: reaches only that request's client."""

    request_id: str
    status: int
    message: str
    kind: str = "server_error"
    param: str | None = None
    retry_after: float | None = None


class EngineStep(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one engine step produced, for every running request."""

    started: tuple[Started, ...] = ()
    tokens: tuple[TokenStep, ...] = ()
    failed: tuple[Failed, ...] = ()


# ---- mailbox events (detokenizer → HTTP handler) ------------------------------------


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call parsed from the output, or more of its arguments.

    Calls are numbered from 0 within the request; a call's first delta carries
    its ``id`` and ``name``, later ones (same ``index``) continue ``arguments``.
    """

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class LogprobPiece(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token as text, with its log-probability and the top alternatives."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


class TextDelta(msgspec.Struct, frozen=True, kw_only=True):
    """Output since the last delta: content text (always whole UTF-8 characters),
    reasoning text, completed tool calls and per-token logprobs."""

    text: str
    tokens: int
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[LogprobPiece, ...] = ()


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """The request ended normally; ``stop_string`` names the stop string that ended it."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None


MailboxEvent = Started | TextDelta | Finished | Failed
