"""Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Requests become the same ``ChatRequest`` as OpenAI chat (``tool_use`` blocks
→ assistant tool calls, ``tool_result`` blocks → ``tool`` turns, ``system`` →
a system turn), so the output is the same; it is shaped into content blocks
(``thinking``, ``text``, ``tool_use``) and, streaming, into Anthropic's exact
event sequence: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``,
``message_delta`` (stop reason, usage), ``message_stop``. ``x-api-key`` and
``anthropic-version`` headers are accepted (mlxd has no keys). Errors use
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import trio
from mlxd.actors.tokenizer import ModelUnavailable, PromptError
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    Choice,
    Select,
    Usage,
    Validator,
    check,
    collect,
    json_response,
    start,
    tool_choice,
    usage_of,
)
from mlxd.daemon.api.errors import ApiError, ErrorFormat, ErrorReason, OnError, install_errors
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import anthropic as wire
from mlxd.protocol.messages import (
    ChatRequest,
    ContentPart,
    Finished,
    ImagePart,
    Message,
    SamplingParams,
    Started,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
)
from quart import Blueprint, Response, request
from quart_trio import QuartTrio

# Anthropic's error ``type`` per reason; the rest (timeouts, bugs) are ``api_error``.
_TYPES: dict[ErrorReason, str] = {
    **dict.fromkeys(
        (
            "invalid_request",
            "too_deeply_nested",
            "request_too_large",
            "bad_host",
            "method_not_allowed",
            "unsupported_media_type",
        ),
        "invalid_request_error",
    ),
    "invalid_api_key": "authentication_error",
    "host_not_allowed": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "body_too_large": "request_too_large",
    "queue_full": "rate_limit_error",
    **dict.fromkeys(
        ("not_ready", "queue_timeout", "out_of_memory", "shutting_down", "model_loading"),
        "overloaded_error",
    ),
}


class AnthropicErrors(ErrorFormat):
    """``{"type": "error", "error": {"type", "message"}}``; the field at fault leads the
    message (Anthropic errors have no ``param``)."""

    def error(self, error: ApiError) -> dict:
        message = f"{error.param}: {error}" if error.param else str(error)
        return {"type": "error", "error": {"type": self.type_of(error), "message": message}}

    def body(self, error: ApiError) -> bytes:
        return wire.encoder.encode(self.error(error))


ERRORS = AnthropicErrors(_TYPES, "api_error")


def _result_part(x: wire.TextBlock | wire.ImageBlock) -> ContentPart:
    return TextPart(text=x.text) if isinstance(x, wire.TextBlock) else image_part(x)


def _tool_result(b: wire.ToolResultBlock) -> str | tuple[ContentPart, ...]:
    """The result's text; content parts when it holds images (a text model refuses those)."""
    prefix = "Error: " if b.is_error else ""
    if isinstance(b.content, str):
        return prefix + b.content
    parts = tuple(_result_part(x) for x in b.content)
    if all(isinstance(p, TextPart) for p in parts):
        return prefix + "\n".join(p.text for p in parts if isinstance(p, TextPart))
    return ((TextPart(text=prefix),) if prefix else ()) + parts


def image_part(block: wire.ImageBlock) -> ImagePart:
    """The image part the vision path reads (a text model refuses it)."""
    source = block.source
    if isinstance(source, wire.Base64Source):
        return ImagePart(url=f"data:{source.media_type};base64,{source.data}")
    return ImagePart(url=source.url)


def _user_turns(content: list[wire.Block]) -> list[Message]:
    """Tool results first (as ``tool`` turns), then the user's own text and images."""
    turns = [
        Message(
            role="tool",
            tool_call_id=b.tool_use_id,
            content=_tool_result(b),
        )
        for b in content
        if isinstance(b, wire.ToolResultBlock)
    ]
    parts: list[ContentPart] = []
    for b in content:
        if isinstance(b, wire.TextBlock):
            parts.append(TextPart(text=b.text))
        elif isinstance(b, wire.ImageBlock):
            parts.append(image_part(b))
        elif isinstance(b, wire.ToolUseBlock):
            raise ApiError(
                "invalid_request", "tool_use blocks belong in assistant turns", param="messages"
            )
    if parts or not turns:
        turns.append(Message(role="user", content=tuple(parts)))
    return turns


def _assistant_turn(content: list[wire.Block]) -> Message:
    """Text and tool calls; earlier thinking is not sent back to the template."""
    text = "".join(b.text for b in content if isinstance(b, wire.TextBlock))
    calls = tuple(
        ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
        for b in content
        if isinstance(b, wire.ToolUseBlock)
    )
    check(
        not any(isinstance(b, wire.ToolResultBlock | wire.ImageBlock) for b in content),
        "messages",
        "assistant turns hold text, thinking and tool_use blocks only",
    )
    return Message(role="assistant", content=text, tool_calls=calls)


def messages_of(w: wire.CountTokensRequest) -> tuple[Message, ...]:
    out: list[Message] = []
    if w.system:
        system = w.system if isinstance(w.system, str) else "\n".join(b.text for b in w.system)
        out.append(Message(role="system", content=system))
    for m in w.messages:
        if isinstance(m.content, str):
            out.append(Message(role=m.role, content=m.content))
        elif m.role == "user":
            out += _user_turns(m.content)
        else:
            out.append(_assistant_turn(m.content))
    return tuple(out)


def _tools(w: wire.CountTokensRequest, v: Validator):
    defs = w.tools or []
    check(
        all(t.type in (None, "custom") for t in defs),
        "tools",
        "only custom tools are supported (no Anthropic server tools)",
    )
    tools = v.tools(
        tuple(Tool(name=t.name, description=t.description, parameters=t.input_schema) for t in defs)
    )
    c = w.tool_choice
    plain = None if c is None or c.type == "tool" else {"any": "required"}.get(c.type, c.type)
    if c is not None and c.type == "tool":
        check(c.name is not None, "tool_choice", "tool_choice type 'tool' needs a name")
    named = c.name if c is not None and c.type == "tool" else None
    choice, forced = tool_choice(plain, tools, named, "tool_choice")
    parallel = not (c is not None and c.disable_parallel_tool_use)
    return tools, choice, forced, parallel


def _thinking(w: wire.CountTokensRequest, max_tokens: int | None) -> dict:
    """``thinking`` → the template's ``enable_thinking`` switch (Qwen-style templates)."""
    t = w.thinking
    if t is None:
        return {}
    if t.type == "enabled":
        budget = t.budget_tokens
        check(budget is not None and budget >= 1024, "thinking.budget_tokens", "must be >= 1024")
        check(
            max_tokens is None or budget < max_tokens,  # type: ignore[operator]
            "thinking.budget_tokens",
            "must be less than max_tokens",
        )
    return {"enable_thinking": t.type == "enabled"}


def chat_request(w: wire.CountTokensRequest, rid: str, v: Validator) -> ChatRequest:
    max_tokens = getattr(w, "max_tokens", None)
    tools, choice, forced, parallel = _tools(w, v)
    sampling = SamplingParams()
    if isinstance(w, wire.MessagesRequest):
        sampling = v.sampling(
            SamplingParams(
                max_tokens=w.max_tokens,
                temperature=w.temperature,
                top_p=w.top_p,
                top_k=w.top_k,
                stop=v.stops(w.stop_sequences, "stop_sequences"),
            )
        )
    messages = messages_of(w)
    v.messages(len(messages))
    v.history(messages, "messages")
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=sampling,
        arrival=time.time(),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        template_kwargs=_thinking(w, max_tokens),
        constraint=forced,
    )


def stop_reason(f: Finished) -> str:
    if f.finish_reason == "length":
        return "max_tokens"
    if f.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if f.stop_string is not None else "end_turn"


def _input(arguments: str) -> dict:
    """The call's arguments as an object (streamed arguments that went wrong: under ``_raw``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def usage(u: Usage) -> wire.Usage:
    return wire.Usage(input_tokens=u.prompt, output_tokens=u.completion)


def message_body(rid: str, model: str, c: Choice) -> wire.Message:
    assert c.finished is not None
    content: list = []
    if c.reasoning:
        content.append(wire.OutThinking(thinking=c.reasoning))
    if c.text:
        content.append(wire.OutText(text=c.text))
    content += [wire.OutToolUse(id=t.id, name=t.name, input=_input(t.arguments)) for t in c.calls]
    f = c.finished
    return wire.Message(
        id=rid,
        model=model,
        content=content,
        stop_reason=stop_reason(f),
        stop_sequence=f.stop_string,
        usage=usage(usage_of([c])),
    )


def sse_event(kind: str, data: dict) -> bytes:
    return sse.frame(wire.encoder.encode(data), kind)


class MessageStream:
    """Anthropic stream events from mailbox events; one content block open at a time."""

    terminator = b""

    def __init__(self, rid: str, model: str):
        self.rid, self.model = rid, model
        self.index = -1
        self.open: str | None = None  # kind of the open block
        self.end: Finished | None = None

    def opening(self) -> list[bytes]:
        return []

    def started(self, i: int, started: Started) -> list[bytes]:
        message = wire.Message(
            id=self.rid,
            model=self.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=wire.Usage(input_tokens=started.prompt_tokens, output_tokens=0),
        )
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("ping", {"type": "ping"}),
        ]

    def _block(self, kind: str, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [sse_event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        ]

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", body)

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        out: list[bytes] = []
        if event.reasoning:
            if self.open != "thinking":
                out += self._block(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            out.append(self._delta({"type": "thinking_delta", "thinking": event.reasoning}))
        if event.text:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        for c in event.tool_calls:
            if c.id is not None:
                out += self._block(
                    "tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}
                )
            if c.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def finished(self, i: int, f: Finished) -> list[bytes]:
        self.end = f
        return self._close()

    def closing(self, u: Usage) -> list[bytes]:
        assert self.end is not None
        delta = {"stop_reason": stop_reason(self.end), "stop_sequence": self.end.stop_string}
        return [
            sse_event(
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": u.completion}},
            ),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def failed(self, error: ApiError) -> list[bytes]:
        return [sse_event("error", ERRORS.error(error))]


class CountGate:
    """Bounds ``count_tokens``, which skips admission: ``tokenizer.workers`` requests read,
    decode and count at once, ``count_tokens_max_waiting`` more wait (their bodies unread),
    the rest get a 429."""

    def __init__(self, v: Validator):
        t = v.tokenizer
        self.slots = t.workers + t.count_tokens_max_waiting
        self.running = trio.CapacityLimiter(t.workers)
        self.retry_after_s = v.retry_after_s
        self.inside = 0

    @contextlib.asynccontextmanager
    async def enter(self) -> AsyncIterator[None]:
        if self.inside >= self.slots:
            raise ApiError(
                "queue_full",
                f"{self.inside} count_tokens requests are in progress or waiting "
                "(tokenizer.workers + tokenizer.count_tokens_max_waiting)",
                retry_after=self.retry_after_s,
            )
        self.inside += 1
        try:
            async with self.running:
                yield
        finally:
            self.inside -= 1


def install(
    app: QuartTrio, pipeline: Pipeline, v: Validator, select: Select, on_error: OnError
) -> None:
    """Register the Anthropic routes on the app, their errors in Anthropic's format."""
    api = Blueprint("anthropic", __name__)
    _routes(api, pipeline, v, select)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)


def _routes(app: Blueprint, pipeline: Pipeline, v: Validator, select: Select) -> None:
    gate = CountGate(v)

    @app.post("/v1/messages")
    async def messages() -> Response:
        w = v.decode(wire.messages_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        rid = f"msg_{uuid.uuid4().hex}"
        first, rest = await start(pipeline, [chat_request(w, rid, mv)], model)
        if w.stream:
            return sse.stream(MessageStream(rid, model), first, rest)
        (choice,) = await collect(1, first, rest)
        return json_response(message_body(rid, model, choice))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        async with gate.enter():
            w = v.decode(wire.count_decoder, await request.get_data(cache=False))
            model, mv = select(w.model)
            req = chat_request(w, f"count_{uuid.uuid4().hex}", mv)
            try:
                n = await pipeline.count_tokens(msgspec.structs.replace(req, model=model))
            except PromptError as exc:
                raise ApiError(exc.reason, str(exc), param=exc.param) from exc
            except ModelUnavailable as exc:
                f = exc.failed
                raise ApiError(f.reason, f.message, retry_after=f.retry_after) from exc
        return json_response({"input_tokens": n})
