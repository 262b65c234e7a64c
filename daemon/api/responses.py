"""OpenAI Responses API (stateless): ``POST /v1/responses``.

``input`` items become the same ``ChatRequest`` as OpenAI chat:
``instructions`` and ``developer`` turns → the system turn, ``function_call``
items → assistant tool calls, ``function_call_output`` → ``tool`` turns
(earlier ``reasoning`` items are not sent back to the template). The answer
is a list of output items (``reasoning``, ``message``, ``function_call``);
streaming sends the Responses event types (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, …,
``response.completed``), each with a ``sequence_number``.
``previous_response_id`` is a 400: nothing is stored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    Choice,
    Select,
    Usage,
    Validator,
    check,
    collect,
    json_constraint,
    json_response,
    start,
    tool_choice,
    usage_of,
)
from mlxd.daemon.api.errors import ApiError, OnError, install_errors
from mlxd.daemon.api.openai import ERRORS as OPENAI_ERRORS
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import responses as wire
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

# HTTP errors are OpenAI's error object, with OpenAI's types; in a stream the type is
# the ``code`` of the ``error`` event and of the failed response.
ERRORS = OPENAI_ERRORS

_THINKING_OFF = ("none", "minimal")


def _items(raw: str | list[dict[str, Any]]) -> list[wire.InputItem]:
    if isinstance(raw, str):
        return [wire.MessageItem(role="user", content=raw)]
    items = []
    for i, item in enumerate(raw):
        typed = item if "type" in item else {**item, "type": "message"}
        try:
            items.append(msgspec.convert(typed, type=wire.InputItem))
        except msgspec.ValidationError as exc:
            raise ApiError(
                "invalid_request", f"invalid input item: {exc}", param=f"input[{i}]"
            ) from exc
    return items


def _part(p: wire.Part, param: str) -> ContentPart:
    if not isinstance(p, wire.InputImage):
        return TextPart(text=p.text)
    check(p.image_url is not None, param, "input_image needs an image_url (mlxd has no Files API)")
    return ImagePart(url=p.image_url or "", detail=p.detail)


def _content(content: str | list[wire.Part], param: str) -> str | tuple[ContentPart, ...]:
    if isinstance(content, str):
        return content
    return tuple(_part(p, f"{param}[{i}]") for i, p in enumerate(content))


def messages_of(w: wire.ResponsesRequest) -> tuple[Message, ...]:
    out = [Message(role="system", content=w.instructions)] if w.instructions else []
    for i, item in enumerate(_items(w.input)):
        match item:
            case wire.MessageItem():
                content = _content(item.content, f"input[{i}].content")
                out.append(Message(role=item.role, content=content))
            case wire.FunctionCallItem():
                call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
                out.append(Message(role="assistant", content="", tool_calls=(call,)))
            case wire.FunctionCallOutputItem():
                out.append(
                    Message(
                        role="tool",
                        tool_call_id=item.call_id,
                        content=_content(item.output, f"input[{i}].output"),
                    )
                )
    return tuple(out)


def _tools(w: wire.ResponsesRequest, v: Validator):
    defs = w.tools or []
    check(all(t.type == "function" for t in defs), "tools", "only function tools are supported")
    tools = v.tools(
        tuple(
            Tool(name=t.name, description=t.description, parameters=t.parameters or {})
            for t in defs
        )
    )
    named = w.tool_choice.name if isinstance(w.tool_choice, wire.NamedFunction) else None
    plain = w.tool_choice if isinstance(w.tool_choice, str) else None
    return tools, *tool_choice(plain, tools, named, "tool_choice")


def chat_request(w: wire.ResponsesRequest, rid: str, v: Validator) -> ChatRequest:
    check(w.previous_response_id is None, "previous_response_id", "mlxd is stateless")
    tools, choice, forced = _tools(w, v)
    fmt = w.text.format if w.text and w.text.format else None
    constraint = json_constraint(fmt.type, fmt.schema, "text.format") if fmt else None
    check(constraint is None or forced is None, "text.format", "cannot combine with a forced call")
    effort = w.reasoning.effort if w.reasoning else None
    kwargs = {} if effort is None else {"enable_thinking": effort not in _THINKING_OFF}
    sampling = SamplingParams(
        max_tokens=w.max_output_tokens, temperature=w.temperature, top_p=w.top_p
    )
    messages = messages_of(w)
    v.messages(len(messages), "input")
    v.history(messages, "input")
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=v.sampling(sampling, max_tokens_param="max_output_tokens"),
        arrival=time.time(),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=w.parallel_tool_calls,
        template_kwargs=kwargs,
        constraint=constraint or forced,
    )


# ---- output items ------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> wire.OutReasoning:
    content = [wire.ReasoningText(text=text)] if text else []
    return wire.OutReasoning(id=item_id, content=content)


def message_item(item_id: str, text: str | None, status: str = "completed") -> wire.OutMessage:
    content = [] if text is None else [wire.OutputText(text=text)]
    return wire.OutMessage(id=item_id, status=status, content=content)


def call_item(
    item_id: str, call: ToolCall, arguments: str, status: str = "completed"
) -> wire.OutFunctionCall:
    return wire.OutFunctionCall(
        id=item_id, call_id=call.id, name=call.name, arguments=arguments, status=status
    )


def output_items(c: Choice) -> list[wire.OutputItem]:
    items: list[wire.OutputItem] = [reasoning_item(_id("rs"), c.reasoning)] if c.reasoning else []
    if c.text or not c.calls:
        items.append(message_item(_id("msg"), c.text))
    items += [call_item(_id("fc"), call, call.arguments) for call in c.calls]
    return items


def usage(u: Usage) -> wire.Usage:
    return wire.Usage(
        input_tokens=u.prompt,
        output_tokens=u.completion,
        total_tokens=u.total,
        input_tokens_details=wire.InputTokensDetails(cached_tokens=u.cached),
    )


class Envelope:
    """The response object around the output items."""

    def __init__(self, rid: str, model: str, w: wire.ResponsesRequest):
        self.rid, self.model, self.w = rid, model, w
        self.created = int(time.time())

    def body(
        self,
        status: str,
        output: list[wire.OutputItem],
        f: Finished | None = None,
        u: Usage | None = None,
    ) -> wire.Response:
        if f is not None and f.finish_reason == "length":
            status = "incomplete"
        w = self.w
        return wire.Response(
            id=self.rid,
            created_at=self.created,
            status=status,
            model=self.model,
            output=output,
            usage=usage(u) if u is not None else None,
            incomplete_details=wire.IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=w.instructions,
            max_output_tokens=w.max_output_tokens,
            temperature=w.temperature,
            top_p=w.top_p,
            parallel_tool_calls=w.parallel_tool_calls,
            tool_choice=w.tool_choice or "auto",
            tools=w.tools or [],
            text=w.text or {"format": {"type": "text"}},
        )


class ResponseStream:
    """Responses streaming events; one output item open at a time."""

    terminator = b""

    def __init__(self, env: Envelope):
        self.env = env
        self.seq = 0
        self.output: list[wire.OutputItem] = []
        self.open: wire.OutputItem | None = None  # the item being streamed
        self.text = ""
        self.end: Finished | None = None

    def sse(self, kind: str, data: dict) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse.frame(wire.encoder.encode(body), kind)

    def opening(self) -> list[bytes]:
        response = self.env.body("in_progress", [])
        return [
            self.sse("response.created", {"response": response}),
            self.sse("response.in_progress", {"response": response}),
        ]

    def started(self, i: int, event: Started) -> list[bytes]:
        return []

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": len(self.output)}

    def _open(self, item: wire.OutputItem) -> list[bytes]:
        out = self._close()
        self.open, self.text = item, ""
        added = self.sse(
            "response.output_item.added", {"output_index": len(self.output), "item": item}
        )
        if not isinstance(item, wire.OutMessage):
            return out + [added]
        part = {**self._where(), "content_index": 0, "part": wire.OutputText(text="")}
        return out + [added, self.sse("response.content_part.added", part)]

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        where, out = self._where(), []
        match item:
            case wire.OutFunctionCall():
                args = {**where, "arguments": self.text}
                out.append(self.sse("response.function_call_arguments.done", args))
                item = msgspec.structs.replace(item, arguments=self.text, status="completed")
            case wire.OutMessage():
                done = {**where, "content_index": 0}
                text = {**done, "text": self.text, "logprobs": []}
                out.append(self.sse("response.output_text.done", text))
                part = {**done, "part": wire.OutputText(text=self.text)}
                out.append(self.sse("response.content_part.done", part))
                item = message_item(item.id, self.text)
            case wire.OutReasoning():
                done = {**where, "content_index": 0, "text": self.text}
                out.append(self.sse("response.reasoning_text.done", done))
                item = reasoning_item(item.id, self.text)
        done_item = {"output_index": len(self.output), "item": item}
        out.append(self.sse("response.output_item.done", done_item))
        self.output.append(item)
        self.open = None
        return out

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        out: list[bytes] = []
        if event.reasoning:
            if not isinstance(self.open, wire.OutReasoning):
                out += self._open(reasoning_item(_id("rs"), ""))
            self.text += event.reasoning
            data = {**self._where(), "content_index": 0, "delta": event.reasoning}
            out.append(self.sse("response.reasoning_text.delta", data))
        if event.text:
            if not isinstance(self.open, wire.OutMessage):
                out += self._open(message_item(_id("msg"), None, "in_progress"))
            self.text += event.text
            data = {**self._where(), "content_index": 0, "delta": event.text, "logprobs": []}
            out.append(self.sse("response.output_text.delta", data))
        for c in event.tool_calls:
            if c.id is not None:
                call = ToolCall(id=c.id, name=c.name or "", arguments="")
                out += self._open(call_item(_id("fc"), call, "", "in_progress"))
            if c.arguments:
                self.text += c.arguments
                data = {**self._where(), "delta": c.arguments}
                out.append(self.sse("response.function_call_arguments.delta", data))
        return out

    def finished(self, i: int, event: Finished) -> list[bytes]:
        self.end = event
        return self._close()

    def closing(self, u: Usage) -> list[bytes]:
        response = self.env.body("completed", self.output, self.end, u)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self.sse(kind, {"response": response})]

    def failed(self, error: ApiError) -> list[bytes]:
        code, message = ERRORS.type_of(error), str(error)
        response = self.env.body("failed", self.output)
        response.error = wire.ErrorInfo(code=code, message=message)
        event = {"code": code, "message": message, "param": error.param}
        return [self.sse("error", event), self.sse("response.failed", {"response": response})]


def install(
    app: QuartTrio, pipeline: Pipeline, v: Validator, select: Select, on_error: OnError
) -> None:
    """Register the Responses route on the app, its errors in OpenAI's format."""
    api = Blueprint("responses", __name__)
    _routes(api, pipeline, v, select)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)


def _routes(app: Blueprint, pipeline: Pipeline, v: Validator, select: Select) -> None:
    @app.post("/v1/responses")
    async def responses() -> Response:
        w = v.decode(wire.decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        rid = _id("resp")
        env = Envelope(rid, model, w)
        first, rest = await start(pipeline, [chat_request(w, rid, mv)], model)
        if w.stream:
            return sse.stream(ResponseStream(env), first, rest)
        (choice,) = await collect(1, first, rest)
        body = env.body("completed", output_items(choice), choice.finished, usage_of([choice]))
        return json_response(body)
