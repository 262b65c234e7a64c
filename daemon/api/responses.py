"""OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

``input`` items become the same ``ChatRequest`` as OpenAI chat: ``instructions``
and ``developer`` turns → the system turn, ``function_call`` /
``custom_tool_call`` items → assistant tool calls, their outputs → ``tool``
turns (earlier ``reasoning`` items are checked, not sent back to the template).
Tools: ``function`` tools as they are, a ``namespace``'s tools flattened into
function tools (a call names the tool and its ``namespace``), ``custom`` tools as
a function with one string argument whose call comes back as a
``custom_tool_call``; hosted tools mlxd cannot run are left out (or refused, with
``responses.strict_hosted_tools``). The output items and stream events come from
``responses_output.OutputBuilder``. ``store: true`` responses go to a bounded
in-memory store (``response_store.py``), which ``previous_response_id`` and the
``/v1/responses/{id}`` routes read.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    ChoiceEvent,
    Select,
    Usage,
    Validator,
    check,
    check_role,
    json_constraint,
    json_response,
    no_chat_template,
    reasoning_kwargs,
    start,
    strict_flag,
    tool_choice,
)
from mlxd.daemon.api.errors import ApiError, OnError, install_errors
from mlxd.daemon.api.openai import ERRORS as OPENAI_ERRORS
from mlxd.daemon.api.reasoning_seal import ReasoningSeal
from mlxd.daemon.api.response_store import ResponseStore
from mlxd.daemon.api.responses_output import (
    Event,
    OutputBuilder,
    OutputOptions,
    Target,
    history_of,
    new_id,
)
from mlxd.daemon.pipeline import Pipeline
from mlxd.daemon.settings import ResponsesSettings
from mlxd.protocol import responses as wire
from mlxd.protocol.messages import (
    ChatRequest,
    ContentPart,
    Failed,
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

# HTTP errors are OpenAI's error object, with OpenAI's types; in a stream the reason's
# ``code`` (``shutting_down``, ``request_timeout``, ...: chat's ``error.code``) is the
# ``code`` of the ``error`` event and of the failed response (a reason without one: its type).
ERRORS = OPENAI_ERRORS
log = logging.getLogger("mlxd.responses")

# Tools OpenAI runs on its side; mlxd has none of them.
HOSTED_TOOLS = frozenset(
    (
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    )
)
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
_INCLUDE_REASONING = "reasoning.encrypted_content"
# Includes about hosted tools' calls and input images, which an answer of mlxd never has.
_INCLUDE_NO_OPS = frozenset(
    (
        "web_search_call.results",
        "web_search_call.action.sources",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    )
)
_SUMMARIES = ("auto", "concise", "detailed")
_ROLES = ("user", "assistant", "system", "developer")
# A custom (free-form) tool as the model sees it: a function of one string.
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's whole input."}},
    "required": ["input"],
    "additionalProperties": False,
}


class CodedError(ApiError):
    """An invalid request with OpenAI's own ``code`` for it (e.g. previous_response_not_found)."""

    def __init__(self, code: str, message: str, param: str | None):
        super().__init__("invalid_request", message, param=param)
        self._code = code

    @property
    def code(self) -> str | None:
        return self._code


# ---- tools ----------------------------------------------------------------------------


def qualified(namespace: str, name: str) -> str:
    """A namespace's tool under a name no other tool has (``mcp__srv__`` + ``x`` →
    ``mcp__srv__x``, ``agents`` + ``x`` → ``agents__x``)."""
    return f"{namespace.rstrip('_')}__{name}"


def _convert(raw: dict, kind: type, param: str) -> Any:
    try:
        return msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError("invalid_request", f"invalid tool: {exc}", param=param) from exc


def _custom_description(t: wire.CustomTool, param: str) -> str:
    """The description, and the grammar its input follows (told, not enforced)."""
    text = t.description or ""
    fmt = t.format
    if fmt is None or fmt.type == "text":
        return text
    check(
        fmt.type == "grammar" and bool(fmt.definition),
        f"{param}.format",
        "a custom tool's format is {type: text} or {type: grammar, syntax, definition}",
    )
    return f"{text}\n\nThe input follows this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"


class ToolSet:
    """The request's tools as the model sees them, and what each offered name stands for.

    A namespace's tool is offered under its own name unless another tool has that
    name too; then under ``qualified(namespace, name)``.
    """

    def __init__(self, raw: list[dict[str, Any]], strict_hosted: bool):
        # (target, description, parameters, strict)
        declared: list[tuple[Target, str, dict, bool | None]] = []
        self.hosted: list[str] = []
        for i, t in enumerate(raw):
            declared += self._read(t, f"tools[{i}]", strict_hosted)
        counts = Counter(target.name for target, *_ in declared)
        self.targets: dict[str, Target] = {}
        self.names: dict[tuple[str | None, str], str] = {}  # (namespace, name) → offered
        tools = []
        for target, description, parameters, strict in declared:
            offered = target.name
            if target.namespace is not None and counts[target.name] > 1:
                offered = qualified(target.namespace, target.name)
            self.targets[offered] = target
            self.names[(target.namespace, target.name)] = offered
            tools.append(
                Tool(name=offered, description=description, parameters=parameters, strict=strict)
            )
        self.tools = tuple(tools)

    def _read(
        self, t: dict, param: str, strict_hosted: bool
    ) -> list[tuple[Target, str, dict, bool | None]]:
        kind = t.get("type")
        if kind == "function":
            f = _convert(t, wire.FunctionTool, param)
            strict = strict_flag(f.name, f.parameters, f.strict, f"{param}.parameters")
            return [(Target(f.name), f.description or "", f.parameters or {}, strict)]
        if kind == "namespace":
            ns = _convert(t, wire.NamespaceTool, param)
            for j, f in enumerate(ns.tools):
                check(f.type == "function", f"{param}.tools[{j}]", "a namespace holds functions")
            where = f"{param}.tools[{{}}].parameters"
            return [
                (
                    Target(f.name, ns.name),
                    f.description or "",
                    f.parameters or {},
                    strict_flag(f.name, f.parameters, f.strict, where.format(j)),
                )
                for j, f in enumerate(ns.tools)
            ]
        if kind == "custom":
            c = _convert(t, wire.CustomTool, param)
            return [
                (
                    Target(c.name, custom=True),
                    _custom_description(c, param),
                    CUSTOM_PARAMETERS,
                    None,
                )
            ]
        check(isinstance(kind, str) and kind in HOSTED_TOOLS, param, f"unknown tool type {kind!r}")
        check(
            not strict_hosted,
            param,
            f"{kind} is a hosted tool, which mlxd cannot run (responses.strict_hosted_tools)",
        )
        self.hosted.append(str(kind))
        return []

    def offered(self, name: str, namespace: str | None = None) -> str:
        """The name an earlier call to ``name`` (of ``namespace``) has in this prompt."""
        found = self.names.get((namespace, name))
        if found is not None:
            return found
        return name if namespace is None else qualified(namespace, name)

    def choice(self, w: wire.ResponsesRequest, tools: tuple[Tool, ...]):
        """(tool choice for the template, forcing constraint or None)."""
        c = w.tool_choice
        if not isinstance(c, wire.NamedTool):
            return tool_choice(c, tools, None, "tool_choice")
        check(
            c.type in ("function", "custom") and bool(c.name),
            "tool_choice",
            "a named tool_choice is {type: function | custom, name}",
        )
        return tool_choice(None, tools, self.offered(c.name or "", c.namespace), "tool_choice")


# ---- input items ------------------------------------------------------------------------


def raw_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as item objects (a string is one user message; a ``role`` without a
    ``type`` is a message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    return [item if "type" in item else {**item, "type": "message"} for item in raw]


def decode_items(raw: list[dict[str, Any]], offset: int) -> list[wire.InputItem]:
    """Typed items; ``raw[offset:]`` is the request's own input (before it: stored history)."""
    items = []
    for i, item in enumerate(raw):
        try:
            items.append(msgspec.convert(item, type=wire.InputItem))
        except msgspec.ValidationError as exc:
            raise ApiError(
                "invalid_request", f"invalid input item: {exc}", param=f"input[{i - offset}]"
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


@dataclass(frozen=True)
class Conversation:
    """What turns items into messages: the request's tools and the reasoning seal."""

    tools: ToolSet
    seal: ReasoningSeal

    def message(self, item: wire.InputItem, param: str) -> Message | None:
        match item:
            case wire.MessageItem():
                check_role(item.role, _ROLES, f"{param}.role")
                return Message(role=item.role, content=_content(item.content, f"{param}.content"))
            case wire.FunctionCallItem():
                name = self.tools.offered(item.name, item.namespace)
                return _call(ToolCall(id=item.call_id, name=name, arguments=item.arguments))
            case wire.CustomToolCallItem():
                arguments = json.dumps({"input": item.input}, ensure_ascii=False)
                name = self.tools.offered(item.name)
                return _call(ToolCall(id=item.call_id, name=name, arguments=arguments))
            case wire.FunctionCallOutputItem() | wire.CustomToolCallOutputItem():
                output = _content(item.output, f"{param}.output")
                return Message(role="tool", tool_call_id=item.call_id, content=output)
            case wire.ReasoningItem():
                self.check_reasoning(item, param)
                return None

    def check_reasoning(self, item: wire.ReasoningItem, param: str) -> None:
        """An ``encrypted_content`` must be one this daemon made (its text is not used)."""
        if item.encrypted_content is not None and self.seal.open(item.encrypted_content) is None:
            raise CodedError(
                "invalid_encrypted_content",
                "the reasoning item's encrypted_content was not made by this mlxd "
                "(or was changed); with responses.reasoning_key_file unset the key is new "
                "at every start",
                param=f"{param}.encrypted_content",
            )


def _call(call: ToolCall) -> Message:
    return Message(role="assistant", content="", tool_calls=(call,))


def messages_of(
    instructions: str | None, items: list[wire.InputItem], offset: int, conv: Conversation
) -> tuple[Message, ...]:
    out = [Message(role="system", content=instructions)] if instructions else []
    for i, item in enumerate(items):
        message = conv.message(item, f"input[{i - offset}]")
        if message is not None:
            out.append(message)
    return tuple(out)


# ---- the request ------------------------------------------------------------------------


def refuse_unsupported(w: wire.ResponsesRequest) -> None:
    """Fields mlxd cannot honour: a 400 naming each."""
    check(not w.background, "background", "mlxd answers synchronously; background is not supported")
    check(w.conversation is None, "conversation", "mlxd has no Conversations API")
    check(w.prompt is None, "prompt", "mlxd has no stored prompt templates")
    no_chat_template(w.chat_template)
    check(
        w.truncation in (None, "disabled", "auto"),
        "truncation",
        "truncation must be disabled or auto",
    )
    check(
        w.max_tool_calls is None or w.max_tool_calls >= 1,
        "max_tool_calls",
        "max_tool_calls must be at least 1",
    )
    for i, name in enumerate(w.include or ()):
        known = name in (_INCLUDE_LOGPROBS, _INCLUDE_REASONING) or name in _INCLUDE_NO_OPS
        check(known, f"include[{i}]", f"unknown include value {name[:80]!r}")
    summary = _summary(w)
    check(summary in (None, *_SUMMARIES), "reasoning.summary", "must be auto, concise or detailed")


def _summary(w: wire.ResponsesRequest) -> str | None:
    r = w.reasoning
    return None if r is None else r.summary or r.generate_summary


def _logprobs(w: wire.ResponsesRequest) -> bool:
    return _INCLUDE_LOGPROBS in (w.include or ()) or bool(w.top_logprobs)


# cap 0 (the model's context): more than any context, which the tokenizer clamps it to
_UP_TO_CONTEXT = 1 << 30


def _max_output_tokens(w: wire.ResponsesRequest, v: Validator) -> int | None:
    """None in OpenAI's API means up to the context: here ``engine.max_tokens_cap``, which
    the tokenizer shrinks to the context and memory left (``engine.default_max_tokens``,
    meant for chat clients, would cut agents' long turns short)."""
    if w.max_output_tokens is None and v.engine.max_tokens_overflow == "clamp":
        return v.engine.max_tokens_cap or _UP_TO_CONTEXT
    return w.max_output_tokens


def chat_request(
    w: wire.ResponsesRequest,
    rid: str,
    v: Validator,
    tools: ToolSet,
    messages: tuple[Message, ...],
) -> ChatRequest:
    offered = v.tools(tools.tools)
    choice, forced = tools.choice(w, offered)
    fmt = w.text.format if w.text else None
    constraint = json_constraint(fmt.type, fmt.schema, "text.format") if fmt else None
    check(constraint is None or forced is None, "text.format", "cannot combine with a forced call")
    effort = w.reasoning.effort if w.reasoning else None
    sampling = SamplingParams(
        max_tokens=_max_output_tokens(w, v),
        temperature=w.temperature,
        top_p=w.top_p,
        logprobs=_logprobs(w),
        top_logprobs=w.top_logprobs or 0,
    )
    v.messages(len(messages), "input")
    v.history(messages, "input")
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=v.sampling(sampling, max_tokens_param="max_output_tokens"),
        arrival=time.time(),
        tools=offered,
        tool_choice=choice,
        parallel_tool_calls=w.parallel_tool_calls and w.max_tool_calls != 1,
        constrain_calls=w.constrain_tool_calls,
        template_kwargs=reasoning_kwargs(effort, {}, "reasoning.effort"),
        reasoning_effort=effort,
        constraint=constraint or forced,
        cache_key=w.prompt_cache_key or "",
    )


# ---- the response object ------------------------------------------------------------------


def usage(u: Usage, reasoning_tokens: int) -> wire.Usage:
    return wire.Usage(
        input_tokens=u.prompt,
        output_tokens=u.completion,
        total_tokens=u.total,
        input_tokens_details=wire.InputTokensDetails(cached_tokens=u.cached),
        output_tokens_details=wire.OutputTokensDetails(reasoning_tokens=reasoning_tokens),
    )


class Envelope:
    """The response object around the output items; the request's settings echoed."""

    def __init__(self, rid: str, model: str, w: wire.ResponsesRequest):
        self.rid, self.model, self.w = rid, model, w
        self.created = int(time.time())

    def body(self, status: str, out: OutputBuilder, u: Usage | None = None) -> wire.Response:
        if out.end is not None and out.end.finish_reason == "length":
            status = "incomplete"
        w = self.w
        return wire.Response(
            id=self.rid,
            created_at=self.created,
            status=status,
            model=self.model,
            output=list(out.output),
            usage=usage(u, out.reasoning_tokens) if u is not None else None,
            incomplete_details=wire.IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=w.instructions,
            max_output_tokens=w.max_output_tokens,
            max_tool_calls=w.max_tool_calls,
            temperature=w.temperature,
            top_p=w.top_p,
            top_logprobs=w.top_logprobs or 0,
            parallel_tool_calls=w.parallel_tool_calls,
            tool_choice=w.tool_choice or "auto",
            tools=w.tools or [],
            text=w.text or wire.TextConfig(),
            reasoning=w.reasoning or wire.ReasoningConfig(),
            truncation=w.truncation or "disabled",
            store=w.store,
            previous_response_id=w.previous_response_id,
            prompt_cache_key=w.prompt_cache_key,
            user=w.user,
            safety_identifier=w.safety_identifier,
            metadata=w.metadata or {},
            client_metadata=w.client_metadata,
        )


OnDone = Callable[[wire.Response, OutputBuilder], None]


class ResponseStream:
    """The Responses event stream: the builder's events, each with a ``sequence_number``."""

    terminator = b""

    def __init__(self, env: Envelope, out: OutputBuilder, on_done: OnDone):
        self.env, self.out, self.on_done = env, out, on_done
        self.seq = 0

    def sse(self, kind: str, data: dict) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse.frame(wire.encoder.encode(body), kind)

    def frames(self, events: list[Event]) -> list[bytes]:
        return [self.sse(kind, data) for kind, data in events]

    def opening(self) -> list[bytes]:
        response = self.env.body("in_progress", self.out)
        return [
            self.sse("response.created", {"response": response}),
            self.sse("response.in_progress", {"response": response}),
        ]

    def started(self, i: int, event: Started) -> list[bytes]:
        return []

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        return self.frames(self.out.delta(event))

    def finished(self, i: int, event: Finished) -> list[bytes]:
        return self.frames(self.out.finish(event))

    def closing(self, u: Usage) -> list[bytes]:
        response = self.env.body("completed", self.out, u)
        self.on_done(response, self.out)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self.sse(kind, {"response": response})]

    def failed(self, error: ApiError) -> list[bytes]:
        kind, message = ERRORS.type_of(error), str(error)
        code = error.code or kind  # the reason, as every API names it; else the type
        response = self.env.body("failed", self.out)
        response.error = wire.ErrorInfo(code=code, message=message, type=kind, param=error.param)
        event = {"code": code, "message": message, "param": error.param}
        return [self.sse("error", event), self.sse("response.failed", {"response": response})]

    def keepalive(self) -> list[bytes]:
        return [sse.KEEPALIVE_COMMENT]  # the Responses API defines no keep-alive event


async def run_to_end(
    out: OutputBuilder, first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]
) -> None:
    """Feed the request's events to ``out`` until it finishes (a failure raises)."""
    batch: list[ChoiceEvent] | None = first
    try:
        while batch is not None:
            for _, event in batch:
                match event:
                    case TextDelta():
                        out.delta(event)
                    case Finished():
                        out.finish(event)
                    case Failed():
                        raise ApiError.from_failed(event)
            batch = await anext(rest, None)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    if out.end is None:
        raise ApiError("internal_error", "the request ended without a result")


# ---- routes -----------------------------------------------------------------------------


class Responses:
    """The routes' state: settings, the store and the reasoning seal."""

    def __init__(self, pipeline: Pipeline, select: Select, settings: ResponsesSettings):
        self.pipeline, self.select, self.settings = pipeline, select, settings
        self.store = ResponseStore(
            settings.store_max_entries, settings.store_max_bytes, settings.store_ttl_s
        )
        self.seal = ReasoningSeal.from_key_file(settings.reasoning_key_file)

    def history(self, w: wire.ResponsesRequest) -> list[dict[str, Any]]:
        """The stored history ``previous_response_id`` names ([] when none is named)."""
        if w.previous_response_id is None:
            return []
        stored = self.store.get(w.previous_response_id)
        if stored is None:
            raise CodedError(
                "previous_response_not_found",
                f"Previous response with id {w.previous_response_id[:100]!r} not found "
                "(never stored, expired, evicted or deleted; see [responses] store_*)",
                param="previous_response_id",
            )
        return stored.history

    def options(self, w: wire.ResponsesRequest, tools: ToolSet) -> OutputOptions:
        return OutputOptions(
            targets=tools.targets,
            summary=_summary(w) is not None,
            seal=self.seal if _INCLUDE_REASONING in (w.include or ()) else None,
            logprobs=_logprobs(w),
            max_tool_calls=w.max_tool_calls,
        )

    def keeper(self, w: wire.ResponsesRequest, inputs: list[dict[str, Any]]) -> OnDone:
        """What to do with the finished response: keep it when ``store`` is true."""

        def keep(response: wire.Response, out: OutputBuilder) -> None:
            if w.store and response.status in ("completed", "incomplete"):
                body = wire.encoder.encode(response)
                if not self.store.put(response.id, body, inputs + history_of(out.output)):
                    log.info("response %s is larger than responses.store_max_bytes", response.id)

        return keep

    async def create(self, w: wire.ResponsesRequest) -> Response:
        refuse_unsupported(w)
        model, mv = self.select(w.model)
        rid = new_id("resp")
        previous = self.history(w)
        inputs = previous + raw_items(w.input)
        tools = ToolSet(w.tools or [], self.settings.strict_hosted_tools)
        if tools.hosted:
            log.info("%s: hosted tools left out of the prompt: %s", rid, ", ".join(tools.hosted))
        conv = Conversation(tools, self.seal)
        items = decode_items(inputs, len(previous))
        messages = messages_of(w.instructions, items, len(previous), conv)
        first, rest = await start(self.pipeline, [chat_request(w, rid, mv, tools, messages)], model)
        env, out = Envelope(rid, model, w), OutputBuilder(self.options(w, tools))
        keep = self.keeper(w, inputs)
        if w.stream:
            return sse.stream(ResponseStream(env, out, keep), first, rest)
        await run_to_end(out, first, rest)
        body = env.body("completed", out, Usage.of([out.end]))
        keep(body, out)
        return json_response(body)

    def get(self, rid: str) -> Response:
        stored = self.store.get(rid)
        if stored is None:
            raise ApiError("not_found", f"No response with id {rid[:100]!r} is stored")
        return Response(stored.body, content_type="application/json")

    def delete(self, rid: str) -> Response:
        if not self.store.delete(rid):
            raise ApiError("not_found", f"No response with id {rid[:100]!r} is stored")
        return json_response(wire.Deleted(id=rid))


def install(
    app: QuartTrio,
    pipeline: Pipeline,
    v: Validator,
    select: Select,
    on_error: OnError,
    settings: ResponsesSettings,
) -> Responses:
    """Register the Responses routes on the app, their errors in OpenAI's format."""
    api = Blueprint("responses", __name__)
    state = Responses(pipeline, select, settings)
    _routes(api, state, v)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)
    return state


def _routes(app: Blueprint, state: Responses, v: Validator) -> None:
    @app.post("/v1/responses")
    async def create() -> Response:
        w = v.decode(wire.decoder, await request.get_data(cache=False))
        return await state.create(w)

    @app.get("/v1/responses/<rid>")
    async def get(rid: str) -> Response:
        return state.get(rid)

    @app.delete("/v1/responses/<rid>")
    async def delete(rid: str) -> Response:
        return state.delete(rid)
