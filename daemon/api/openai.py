"""OpenAI API: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Chat answers carry ``reasoning_content`` (a leading ``<think>`` block),
``tool_calls`` (parsed from the model's markup; streamed as one delta per
complete call) and ``logprobs``; ``n`` choices run as ``n`` sequences of the
batch and are merged here, in the order their output arrives. Legacy function
calling (``functions`` / ``function_call``) runs as tools with one call at most,
answered as ``function_call``; fields mlxd cannot honour (audio, web search) are a 400.
A completion's ``suffix`` (insertion) is filled in the middle in the model's own FIM
tokens (``actors/families/fim.py``).
"""

from __future__ import annotations

import time
import uuid

import msgspec
from mlxd.actors.models import ModelRegistry
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    SEED_MAX,
    Choice,
    Select,
    Usage,
    Validator,
    both_constraints,
    check,
    check_role,
    collect,
    json_constraint,
    json_response,
    no_chat_template,
    reasoning_kwargs,
    start,
    strict_flag,
    template_kwargs,
    tool_choice,
    usage_of,
)
from mlxd.daemon.api.errors import ApiError, ErrorFormat, ErrorReason, OnError, install_errors
from mlxd.daemon.api.supersede import Superseder, file_key, start_newest
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import openai as wire
from mlxd.protocol.messages import (
    ChatRequest,
    CompletionRequest,
    Constraint,
    ContentPart,
    FimInput,
    Finished,
    ImagePart,
    LogprobPiece,
    Message,
    SamplingParams,
    Started,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from quart import Blueprint, Response, request
from quart_trio import QuartTrio

# OpenAI's error ``type`` per reason; the rest are ``server_error``.
_TYPES: dict[ErrorReason, str] = {
    **dict.fromkeys(
        (
            "invalid_request",
            "too_deeply_nested",
            "request_too_large",
            "bad_host",
            "invalid_api_key",
            "method_not_allowed",
            "body_too_large",
            "unsupported_media_type",
        ),
        "invalid_request_error",
    ),
    "host_not_allowed": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "queue_full": "rate_limit_exceeded",
    **dict.fromkeys(("client_not_reading", "request_timeout", "body_timeout"), "timeout_error"),
    **dict.fromkeys(
        ("not_ready", "queue_timeout", "out_of_memory", "shutting_down", "model_loading"),
        "service_unavailable",
    ),
}


class OpenAIErrors(ErrorFormat):
    """``{"error": {"message", "type", "param", "code"}}``."""

    def error(self, error: ApiError) -> wire.ErrorResponse:
        body = wire.ErrorBody(
            message=str(error), type=self.type_of(error), param=error.param, code=error.code
        )
        return wire.ErrorResponse(error=body)

    def body(self, error: ApiError) -> bytes:
        return wire.encoder.encode(self.error(error))


ERRORS = OpenAIErrors(_TYPES, "server_error")


def sampling_from(
    w: wire._SamplingFields,
    max_tokens: int | None,
    v: Validator,
    top_logprobs_param: str,
    max_tokens_param: str = "max_tokens",
    **extra,
):
    """The OpenAI sampling fields as internal params (range-checked)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=w.temperature,
        top_p=w.top_p,
        top_k=w.top_k,
        min_p=w.min_p,
        presence_penalty=w.presence_penalty,
        frequency_penalty=w.frequency_penalty,
        repetition_penalty=w.repetition_penalty,
        logit_bias=v.logit_bias(w.logit_bias),
        seed=w.seed,
        stop=v.stops(w.stop),
        speculative=w.speculative is not False,
        spec_prefill=w.spec_prefill,
        **extra,
    )
    return v.sampling(
        params, max_tokens_param=max_tokens_param, top_logprobs_param=top_logprobs_param
    )


def choice_ids(rid: str, n: int) -> list[str]:
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of a seeded request draws with ``seed + i`` (wrapping within the seed
    range): distinct, reproducible."""
    if sampling.seed is None or i == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + i) % (SEED_MAX + 1))


def response_constraint(fmt: wire.ResponseFormat | None) -> Constraint | None:
    if fmt is None:
        return None
    schema = fmt.json_schema.schema if fmt.json_schema else None
    return json_constraint(fmt.type, schema, "response_format")


def _part(p: wire.WirePart) -> ContentPart:
    if isinstance(p, wire.WireText | wire.WireInputText | wire.WireOutputText):
        return TextPart(text=p.text)
    url = p.image_url
    return ImagePart(url=url) if isinstance(url, str) else ImagePart(url=url.url, detail=url.detail)


def _messages(wire_messages: list[wire.WireMessage]) -> tuple[Message, ...]:
    """The conversation; a legacy ``function_call`` is a tool call (with an id made up for
    it) and a ``function`` turn the result of the latest one."""
    out, legacy_id = [], None
    for i, m in enumerate(wire_messages):
        check_role(m.role, wire.ROLES, f"messages[{i}].role")
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in m.tool_calls or ()
        ]
        if m.function_call is not None:
            legacy_id = f"call_{i}"
            f = m.function_call
            calls.append(ToolCall(id=legacy_id, name=f.name, arguments=f.arguments))
        content = m.content
        out.append(
            Message(
                role="tool" if m.role == "function" else m.role,
                content=tuple(_part(p) for p in content) if isinstance(content, list) else content,
                name=m.name,
                tool_calls=tuple(calls),
                tool_call_id=legacy_id if m.role == "function" else m.tool_call_id,
                reasoning=(m.reasoning_content or m.reasoning) if m.role == "assistant" else None,
            )
        )
    return tuple(out)


def is_legacy(w: wire.ChatCompletionRequest) -> bool:
    """Legacy function calling: answered with ``function_call``, not ``tool_calls``."""
    return w.functions is not None or w.function_call is not None


def _tools(w: wire.ChatCompletionRequest, v: Validator):
    """(tools, choice for the template, forcing constraint or None), from ``tools`` and
    ``tool_choice`` or their legacy names ``functions`` and ``function_call``."""
    legacy = is_legacy(w)
    check(
        not legacy or (w.tools is None and w.tool_choice is None),
        "functions",
        "functions / function_call (legacy) cannot be combined with tools / tool_choice",
    )
    defs = list(w.functions or ()) if legacy else [t.function for t in w.tools or ()]
    param = "functions" if legacy else "tools"
    where = "{}[{}].parameters" if legacy else "{}[{}].function.parameters"
    tools = v.tools(
        tuple(
            Tool(
                name=f.name,
                description=f.description,
                parameters=f.parameters or {},
                strict=strict_flag(f.name, f.parameters, f.strict, where.format(param, i)),
            )
            for i, f in enumerate(defs)
        ),
        param,
    )
    asked = w.function_call if legacy else w.tool_choice
    if isinstance(asked, wire.NamedToolChoice):
        asked = asked.function
    named = asked.name if isinstance(asked, wire.NamedFunction) else None
    plain = asked if isinstance(asked, str) else None
    return tools, *tool_choice(plain, tools, named, "function_call" if legacy else "tool_choice")


def _unsupported(w: wire.ChatCompletionRequest) -> None:
    """Fields that would change the answer in ways mlxd cannot: a 400 unless they ask for
    what it does anyway."""
    no_chat_template(w.chat_template)
    check(
        all(m == "text" for m in w.modalities or ()),
        "modalities",
        'only text output is available (modalities: ["text"])',
    )
    check(w.audio is None, "audio", "audio output is not available; mlxd answers in text")
    check(
        w.web_search_options is None,
        "web_search_options",
        "web search is not available; mlxd answers from the model alone",
    )
    check(
        w.verbosity in (None, "medium"),
        "verbosity",
        "verbosity other than 'medium' is not available; ask for brevity in the prompt",
    )


def chat_requests(w: wire.ChatCompletionRequest, rid: str, v: Validator) -> list[ChatRequest]:
    n = v.n(w.n)
    _unsupported(w)
    tools, choice, forced = _tools(w, v)
    constraint = both_constraints(response_constraint(w.response_format), forced)
    check(not w.top_logprobs or bool(w.logprobs), "top_logprobs", "needs logprobs: true")
    v.in_range(w.max_tokens, "max_tokens")  # checked even where max_completion_tokens wins
    sampling = sampling_from(
        w,
        w.max_tokens if w.max_completion_tokens is None else w.max_completion_tokens,
        v,
        "top_logprobs",
        "max_tokens" if w.max_completion_tokens is None else "max_completion_tokens",
        logprobs=bool(w.logprobs),
        top_logprobs=w.top_logprobs or 0,
    )
    v.messages(len(w.messages))
    messages = _messages(w.messages)
    v.history(messages, "messages", exact=True)
    kwargs = template_kwargs(w.chat_template_kwargs)
    kwargs = reasoning_kwargs(w.reasoning_effort, kwargs, "reasoning_effort")
    # legacy function calling has one call per answer
    parallel = not is_legacy(w) and w.parallel_tool_calls is not False
    return [
        ChatRequest(
            request_id=cid,
            messages=messages,
            sampling=choice_sampling(sampling, i),
            arrival=time.time(),
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            constrain_calls=w.constrain_tool_calls,
            template_kwargs=kwargs,
            reasoning_effort=w.reasoning_effort,
            constraint=constraint,
            priority=v.priority(w.priority),
            cache_key=w.prompt_cache_key or "",
        )
        for i, cid in enumerate(choice_ids(rid, n))
    ]


# ---- chat shaping -------------------------------------------------------------------------


def usage(u: Usage) -> wire.Usage:
    return wire.Usage(
        prompt_tokens=u.prompt,
        completion_tokens=u.completion,
        total_tokens=u.total,
        prompt_tokens_details=wire.PromptTokensDetails(
            cached_tokens=u.cached, prefilled_tokens=u.prefilled
        ),
    )


def chat_logprobs(pieces: list[LogprobPiece] | tuple[LogprobPiece, ...]):
    if not pieces:
        return None
    return wire.ChoiceLogprobs(
        content=[
            wire.ContentLogprob(
                token=p.token,
                logprob=p.logprob,
                bytes=list(p.bytes),
                top_logprobs=[
                    wire.TopLogprob(token=t, bytes=list(b), logprob=lp) for t, b, lp in p.top
                ],
            )
            for p in pieces
        ]
    )


def _out_call(call: ToolCall) -> wire.OutToolCall:
    return wire.OutToolCall(
        id=call.id, function=wire.WireFunctionCall(name=call.name, arguments=call.arguments)
    )


def _delta_calls(calls: tuple[ToolCallDelta, ...]) -> list[wire.DeltaToolCall] | None:
    if not calls:
        return None
    return [
        wire.DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id is not None else None,
            function=wire.DeltaFunction(name=c.name, arguments=c.arguments),
        )
        for c in calls
    ]


def finish_reason(reason: str, legacy: bool) -> str:
    return "function_call" if legacy and reason == "tool_calls" else reason


def chat_choice(i: int, c: Choice, logprobs: bool, legacy: bool = False) -> wire.ChatChoice:
    """One choice's message; ``legacy``: its call as ``function_call`` (there is one at most)."""
    assert c.finished is not None
    calls = [_out_call(call) for call in c.calls]
    message = wire.AssistantMessage(
        role="assistant",
        content=c.text if c.text or not c.calls else None,
        refusal=None,
        annotations=[],
        reasoning_content=c.reasoning or None,
        tool_calls=None if legacy else calls or None,
        function_call=calls[0].function if legacy and calls else None,
    )
    return wire.ChatChoice(
        index=i,
        message=message,
        finish_reason=finish_reason(c.finished.finish_reason, legacy),
        logprobs=chat_logprobs(c.logprobs) if logprobs else None,
    )


def _delta_function(calls: tuple[ToolCallDelta, ...]) -> wire.DeltaFunction | None:
    """Legacy streaming: the one call's name first, then its arguments."""
    mine = [c for c in calls if c.index == 0]  # one call: parallel calls are off
    if not mine:
        return None
    name = next((c.name for c in mine if c.id is not None), None)
    return wire.DeltaFunction(name=name, arguments="".join(c.arguments for c in mine))


_DONE = b"data: [DONE]\n\n"


class _Stream:
    """What chat and text completion streams share: the chunk envelope, the error
    frame, the usage chunk when asked for, and ``data: [DONE]``."""

    terminator = _DONE
    chunk_type: type = wire.ChatCompletionChunk

    def __init__(self, rid: str, model: str, n: int, include_usage: bool):
        self.rid, self.model, self.n, self.include_usage = rid, model, n, include_usage
        self.created = int(time.time())

    def chunk(self, choices: list, usage: wire.Usage | None = None) -> bytes:
        obj = self.chunk_type(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return sse.frame(wire.encoder.encode(obj))

    def started(self, i: int, event: Started) -> list[bytes]:
        return []

    def closing(self, u: Usage) -> list[bytes]:
        return [self.chunk([], usage=usage(u))] if self.include_usage else []

    def failed(self, error: ApiError) -> list[bytes]:
        return [sse.frame(ERRORS.body(error))]

    def keepalive(self) -> list[bytes]:
        return [sse.KEEPALIVE_COMMENT]


class ChatStream(_Stream):
    """Chat completion chunks for one request's merged choice events; ``legacy``: calls as
    ``function_call`` deltas."""

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, legacy: bool = False):
        super().__init__(rid, model, n, include_usage)
        self.legacy = legacy

    def opening(self) -> list[bytes]:
        delta = wire.Delta(role="assistant", content="", refusal=None)
        return [self.chunk([wire.ChunkChoice(index=i, delta=delta)]) for i in range(self.n)]

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        calls = event.tool_calls
        delta = wire.Delta(
            content=event.text or None,
            reasoning_content=event.reasoning or None,
            tool_calls=None if self.legacy else _delta_calls(calls),
            function_call=_delta_function(calls) if self.legacy else None,
        )
        lp = chat_logprobs(event.logprobs)
        return [self.chunk([wire.ChunkChoice(index=i, delta=delta, logprobs=lp)])]

    def finished(self, i: int, event: Finished) -> list[bytes]:
        reason = finish_reason(event.finish_reason, self.legacy)
        end = wire.ChunkChoice(index=i, delta=wire.Delta(), finish_reason=reason)
        return [self.chunk([end])]


# ---- completions shaping ------------------------------------------------------------------


def text_logprobs(pieces: list[LogprobPiece] | tuple[LogprobPiece, ...], offset: int = 0):
    if not pieces:
        return None
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p.token)
    return wire.TextLogprobs(
        tokens=[p.token for p in pieces],
        token_logprobs=[p.logprob for p in pieces],
        top_logprobs=[{t: lp for t, _, lp in p.top} for p in pieces],
        text_offset=offsets,
    )


class TextStream(_Stream):
    """Text completion chunks; ``echo`` puts the prompt text first."""

    chunk_type = wire.TextCompletion

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, echo: str):
        super().__init__(rid, model, n, include_usage)
        self.echo = echo

    def opening(self) -> list[bytes]:
        if not self.echo:
            return []
        return [self.chunk([wire.TextChoice(index=i, text=self.echo)]) for i in range(self.n)]

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        lp = text_logprobs(event.logprobs)
        return [self.chunk([wire.TextChoice(index=i, text=event.text, logprobs=lp)])]

    def finished(self, i: int, event: Finished) -> list[bytes]:
        end = wire.TextChoice(index=i, text="", finish_reason=event.finish_reason)
        return [self.chunk([end])]


def _one_prompt(prompt: str | list[str | int]) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return tuple(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise ApiError(
        "invalid_request",
        "prompt must be a string, a list of token ids or a list of one string",
        param="prompt",
    )


# ---- routes -------------------------------------------------------------------------------


def _insertion(w: wire.CompletionRequest) -> FimInput | None:
    """``suffix``: OpenAI's insertion, served as fill-in-the-middle in the model's own FIM
    tokens (``actors/families/fim.py``; a model without them answers a 400)."""
    if w.suffix is None:
        return None
    check(not w.echo, "echo", "echo cannot be combined with suffix (insertion)")
    prompt = _one_prompt(w.prompt)
    check(isinstance(prompt, str), "prompt", "with suffix (insertion) the prompt must be text")
    return FimInput(prefix=prompt, suffix=w.suffix, param="suffix")  # type: ignore[arg-type]


def completion_requests(w: wire.CompletionRequest, rid: str, v: Validator):
    fim = _insertion(w)
    sampling = sampling_from(
        w,
        w.max_tokens,
        v,
        "logprobs",
        logprobs=w.logprobs is not None,
        top_logprobs=w.logprobs or 0,
    )
    prompt = "" if fim else _one_prompt(w.prompt)
    constraint = response_constraint(w.response_format)
    if isinstance(prompt, tuple):
        v.token_ids(prompt, "prompt")
    return [
        CompletionRequest(
            request_id=cid,
            prompt=prompt,
            sampling=choice_sampling(sampling, i),
            arrival=time.time(),
            constraint=constraint,
            priority=v.priority(w.priority),
            fim=fim,
        )
        for i, cid in enumerate(choice_ids(rid, v.n(w.n)))
    ]


def text_choice(i: int, c: Choice, echo: str, logprobs: bool) -> wire.TextChoice:
    return wire.TextChoice(
        index=i,
        text=echo + c.text,
        finish_reason=c.finished.finish_reason if c.finished else None,
        logprobs=text_logprobs(c.logprobs, len(echo)) if logprobs else None,
    )


async def chat(pipeline: Pipeline, v: Validator, model: str, w: wire.ChatCompletionRequest):
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    requests = chat_requests(w, rid, v)
    first, rest = await start(pipeline, requests, model)  # type: ignore[arg-type]
    if w.stream:
        include = bool(w.stream_options and w.stream_options.include_usage)
        stream = ChatStream(rid, model, len(requests), include, is_legacy(w))
        return sse.stream(stream, first, rest)
    choices = await collect(len(requests), first, rest)
    legacy = is_legacy(w)
    body = wire.ChatCompletion(
        id=rid,
        created=int(time.time()),
        model=model,
        choices=[chat_choice(i, c, bool(w.logprobs), legacy) for i, c in enumerate(choices)],
        usage=usage(usage_of(choices)),
    )
    return json_response(body)


async def complete(
    pipeline: Pipeline,
    v: Validator,
    model: str,
    w: wire.CompletionRequest,
    superseder: Superseder | None = None,
):
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests = completion_requests(w, rid, v)
    fim, key = requests[0].fim, None
    if fim is not None:  # an editor's insertion: a newer one on the file supersedes it
        key = (request.remote_addr, model, "/v1/completions", file_key(fim.prefix, fim.suffix))
    newest = superseder if key is not None else None
    first, rest = await start_newest(newest, key, pipeline, requests, model)  # type: ignore[arg-type]
    # After start: token-id prompts have been checked against the vocabulary.
    echo = _echo(requests[0].prompt, pipeline, model) if w.echo else ""
    if w.stream:
        include = bool(w.stream_options and w.stream_options.include_usage)
        return sse.stream(TextStream(rid, model, len(requests), include, echo), first, rest)
    choices = await collect(len(requests), first, rest)
    body = wire.TextCompletion(
        id=rid,
        created=int(time.time()),
        model=model,
        choices=[text_choice(i, c, echo, w.logprobs is not None) for i, c in enumerate(choices)],
        usage=usage(usage_of(choices)),
    )
    return json_response(body)


def install(
    app: QuartTrio,
    pipeline: Pipeline,
    v: Validator,
    select: Select,
    on_error: OnError,
    superseder: Superseder | None = None,
) -> None:
    """Register the OpenAI routes on the app, their errors in OpenAI's format;
    ``superseder``: the editors' FIM requests (``suffix``), None when ``fim.supersede``
    is off."""
    api = Blueprint("openai", __name__)
    _routes(api, pipeline, v, select, superseder)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)


def _routes(
    app: Blueprint, pipeline: Pipeline, v: Validator, select: Select, superseder: Superseder | None
) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        w = v.decode(wire.chat_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        return await chat(pipeline, mv, model, w)

    @app.post("/v1/completions")
    async def completions() -> Response:
        w = v.decode(wire.completion_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        return await complete(pipeline, mv, model, w, superseder)

    @app.get("/v1/models")
    async def models() -> Response:
        select(None)
        registry = pipeline.models
        assert registry is not None
        cards: list[wire.ModelCard | wire.AdapterCard] = [
            wire.ModelCard(id=e.id, created=0, status=e.state) for e in registry.entries.values()
        ]
        cards += [model_card(registry, a) for a in registry.adapters]
        return json_response(wire.ModelList(data=cards))

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        served, _ = select(model_id)  # another id (model.accept_other_ids): the served card
        assert pipeline.models is not None
        return json_response(model_card(pipeline.models, served))


def model_card(models: ModelRegistry, served: str) -> wire.ModelCard | wire.AdapterCard:
    """A served model's card; a LoRA adapter's names its base (``parent``) and directory."""
    adapter = models.adapters.get(served)
    if adapter is None:
        return wire.ModelCard(id=served, created=0, status=models.entries[served].state)
    state = models.adapter_state(adapter)
    return wire.AdapterCard(
        id=served,
        created=0,
        status=state,
        parent=adapter.base,
        root=adapter.path,
        error=adapter.error if state == "failed" else None,
    )


def _echo(prompt: str | tuple[int, ...], pipeline: Pipeline, model: str) -> str:
    if isinstance(prompt, str):
        return prompt
    info = pipeline.model_info(model)
    assert info is not None  # after start: the model has loaded
    return info.tokenizer.decode(list(prompt))
