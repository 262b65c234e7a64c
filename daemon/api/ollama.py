"""Ollama's API: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, ``/api/embed`` and the legacy ``/api/embeddings`` (the model listings are
in ``ollama_models.py``, the options in ``ollama_options.py``, the wire structs in
``protocol/ollama.py``).

Chat and generate run through the same pipeline as the OpenAI routes; they stream
NDJSON (one JSON object a line) unless ``stream`` is false, and their last object has
``done: true`` with Ollama's counts and durations (nanoseconds). ``options`` map onto
mlxd's sampling (``ollama_options.py`` says which are honoured, which refused);
``format`` is the grammar path (``json`` or a JSON schema); tool calls carry their
arguments as objects; ``think`` sets the template's ``enable_thinking`` and reasoning
comes back as ``thinking``. ``keep_alive`` sets how long the model stays loaded once
idle (a ``KeepAlive`` to the model pool); an empty prompt just loads the model, or with
``keep_alive: 0`` unloads it, as Ollama's clients expect. Errors are
``{"error": "..."}`` with Ollama's status codes, and ``code`` (the reason, as the other
APIs name it) where the reason has one; a failure mid-stream is such a line.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec
from mlxd.actors.families.cut import complete_fields
from mlxd.actors.tokenizer import ModelUnavailable, PromptError
from mlxd.daemon.api import ollama_models as listings
from mlxd.daemon.api.common import (
    Choice,
    ChoiceEvent,
    Select,
    Validator,
    check,
    check_role,
    collect,
    json_constraint,
    json_response,
    merge_tool_calls,
    reasoning_kwargs,
)
from mlxd.daemon.api.embeddings import EmbeddingLimits, EmbeddingResult, embed
from mlxd.daemon.api.errors import ApiError, ErrorFormat, OnError, install_errors
from mlxd.daemon.api.ollama_models import load, unavailable
from mlxd.daemon.api.ollama_options import keep_alive_seconds, sampling_from, within_context
from mlxd.daemon.api.supersede import Superseder, file_key, start_newest
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import ollama as wire
from mlxd.protocol.messages import (
    ChatRequest,
    CompletionRequest,
    Constraint,
    ContentPart,
    Failed,
    FimInput,
    Finished,
    ImagePart,
    KeepAlive,
    LogprobPiece,
    Message,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
)
from quart import Blueprint, Response, request
from quart_trio import QuartTrio


class OllamaErrors(ErrorFormat):
    """``{"error": "..."}``: Ollama's error body, whatever the reason (the status says it),
    and ``code``, the reason's, where it has one (the same ``code`` as the other APIs')."""

    def error(self, error: ApiError) -> wire.Error:
        message = str(error)
        if error.param and error.param not in message:
            message = f"{error.param}: {message}"
        return wire.Error(error=message, code=error.code)

    def body(self, error: ApiError) -> bytes:
        return wire.encoder.encode(self.error(error))


ERRORS = OllamaErrors({}, "error")
ROLES = ("system", "user", "assistant", "tool")
NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# ---- requests ---------------------------------------------------------------------------


def _constraint(fmt: wire.Format) -> Constraint | None:
    """``format``: "" (none), "json" or a JSON schema, through the grammar path."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_constraint("json_object", None, "format")
    check(isinstance(fmt, dict), "format", 'format must be "json" or a JSON schema object')
    return json_constraint("json_schema", fmt, "format")  # type: ignore[arg-type]


def _think(think: wire.Think) -> dict:
    """``think``: true / false, or an effort ("low", "medium", "high"), as the template's
    ``enable_thinking``."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    return reasoning_kwargs(think, {}, "think")


def _think_effort(think: wire.Think) -> str | None:
    """``think`` as the effort the model's family maps (true: its default effort)."""
    if isinstance(think, bool):
        return "medium" if think else "none"
    return think


def _image(data: str, param: str) -> ImagePart:
    """A base64 image (Ollama sends no media type; the decoder reads the bytes' own)."""
    check(bool(data), param, "an image must be base64 data")
    if data.startswith("data:"):
        return ImagePart(url=data)
    return ImagePart(url=f"data:image/*;base64,{data}")


def _content(text: str | None, images: list[str] | None, param: str):
    if not images:
        return text or ""
    parts: list[ContentPart] = [_image(d, f"{param}.images[{i}]") for i, d in enumerate(images)]
    if text:
        parts.append(TextPart(text=text))
    return tuple(parts)


def _tools(tools: list[wire.Tool] | None, v: Validator) -> tuple[Tool, ...]:
    for i, t in enumerate(tools or ()):
        check(t.type == "function", f"tools[{i}].type", "only function tools are supported")
    defs = tuple(
        Tool(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in tools or ()
    )
    return v.tools(defs)


def _calls(m: wire.Message, i: int) -> tuple[ToolCall, ...]:
    return tuple(
        ToolCall(
            id=c.id or f"call_{i}_{j}",
            name=c.function.name,
            arguments=json.dumps(c.function.arguments, ensure_ascii=False),
        )
        for j, c in enumerate(m.tool_calls or ())
    )


def _answered(m: wire.Message, open_calls: list[ToolCall]) -> str | None:
    """The id of the call a ``tool`` turn answers: its ``tool_call_id``, else the first
    open call named ``tool_name``, else the first open call."""
    if m.tool_call_id:
        return m.tool_call_id
    named = [c for c in open_calls if m.tool_name and c.name == m.tool_name]
    call = (named or open_calls or [None])[0]
    if call is None:
        return None
    open_calls.remove(call)
    return call.id


def _messages(messages: list[wire.Message]) -> tuple[Message, ...]:
    out: list[Message] = []
    open_calls: list[ToolCall] = []
    for i, m in enumerate(messages):
        check_role(m.role, ROLES, f"messages[{i}].role")
        calls = _calls(m, i)
        if calls:
            open_calls = list(calls)
        out.append(
            Message(
                role=m.role,
                content=_content(m.content, m.images, f"messages[{i}]"),
                name=m.tool_name if m.role == "tool" else None,
                tool_calls=calls,
                tool_call_id=_answered(m, open_calls) if m.role == "tool" else None,
            )
        )
    return tuple(out)


def _no_template(template: str | None) -> None:
    check(
        not template,
        "template",
        "requests cannot set the template; the server's (model.chat_template) or the "
        "model's own is used",
    )


def chat_request(w: wire.ChatRequest, rid: str, v: Validator) -> ChatRequest:
    _no_template(w.template)
    v.messages(len(w.messages))
    messages = _messages(w.messages)
    v.history(messages, "messages", exact=True)
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=sampling_from(w.options, v, w.logprobs, w.top_logprobs),
        arrival=time.time(),
        tools=_tools(w.tools, v),
        constrain_calls=w.constrain_tool_calls,
        template_kwargs=_think(w.think),
        reasoning_effort=_think_effort(w.think),
        constraint=_constraint(w.format),
    )


def generate_request(w: wire.GenerateRequest, rid: str, v: Validator):
    """A chat turn (the prompt as the user's, ``system`` before it) or, ``raw``, the
    prompt as it is."""
    _no_template(w.template)
    check(
        not w.context,
        "context",
        "context (the token ids of an earlier answer) is not supported; send the "
        "conversation to /api/chat",
    )
    sampling = sampling_from(w.options, v, w.logprobs, w.top_logprobs)
    constraint = _constraint(w.format)
    if w.suffix:
        return _fill_in(w, rid, sampling, constraint)
    if w.raw:
        check(not w.images, "images", "raw prompts cannot carry images")
        check(not w.system, "system", "raw prompts have no system prompt; put it in the prompt")
        check(w.think is None, "think", "raw prompts are not rendered with a template")
        return CompletionRequest(
            request_id=rid,
            prompt=w.prompt,
            sampling=sampling,
            arrival=time.time(),
            constraint=constraint,
        )
    messages = [Message(role="system", content=w.system)] if w.system else []
    messages.append(Message(role="user", content=_content(w.prompt, w.images, "")))
    return ChatRequest(
        request_id=rid,
        messages=tuple(messages),
        sampling=sampling,
        arrival=time.time(),
        template_kwargs=_think(w.think),
        reasoning_effort=_think_effort(w.think),
        constraint=constraint,
    )


def _fill_in(w: wire.GenerateRequest, rid: str, sampling, constraint) -> CompletionRequest:
    """``suffix``: the prompt is the code before the cursor, laid out with the suffix in
    the model's own FIM tokens (``actors/families/fim.py``; none: a 400), raw or not."""
    check(not w.images, "images", "suffix (fill in the middle) cannot carry images")
    check(not w.system, "system", "suffix (fill in the middle) takes no system prompt")
    check(w.think is None, "think", "suffix (fill in the middle) is not rendered with a template")
    return CompletionRequest(
        request_id=rid,
        prompt="",
        sampling=sampling,
        arrival=time.time(),
        constraint=constraint,
        fim=FimInput(prefix=w.prompt, suffix=w.suffix or "", param="suffix"),
    )


# ---- output -----------------------------------------------------------------------------


def _arguments(arguments: str, cut: bool = False) -> object:
    """A call's arguments as an object (arguments that are no JSON object: under ``_raw``;
    a call the token limit cut: the fields written whole)."""
    if cut:
        return complete_fields(arguments)
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def _out_calls(
    calls: list[ToolCall], first_index: int = 0, cut: int | None = None
) -> list[wire.OutToolCall] | None:
    """``cut``: the index of the call the token limit cut, if one was."""
    if not calls:
        return None
    return [
        wire.OutToolCall(
            id=c.id,
            function=wire.OutFunctionCall(
                name=c.name,
                arguments=_arguments(c.arguments, first_index + k == cut),
                index=first_index + k,
            ),
        )
        for k, c in enumerate(calls)
    ]


def _logprobs(pieces: list[LogprobPiece] | tuple[LogprobPiece, ...]):
    if not pieces:
        return None
    return [
        wire.Logprob(
            token=p.token,
            logprob=p.logprob,
            bytes=list(p.bytes),
            top_logprobs=[
                wire.TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in p.top
            ],
        )
        for p in pieces
    ]


def done_reason(reason: str) -> str:
    """Ollama's ``done_reason``: ``stop`` (tool calls included) or ``length``."""
    return "length" if reason == "length" else "stop"


@dataclass
class Clock:
    """A request's times (ns), for the counts and durations of its last object.

    ``prompt_eval_duration`` runs from arrival to the first token, less the model's load;
    ``eval_duration`` from the first token to the end."""

    pipeline: Pipeline
    model: str
    arrival: int = field(default_factory=time.perf_counter_ns)
    first: int | None = None
    loads: int = 0

    def __post_init__(self) -> None:
        entry = self._entry()
        self.loads = entry.loads if entry else 0

    def _entry(self):
        models = self.pipeline.models
        return models.entries.get(models.base_of(self.model)) if models else None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def load_ns(self) -> int:
        """The model's load time when it loaded for this request, else 0."""
        entry = self._entry()
        if entry is None or entry.loads == self.loads:
            return 0
        return int(entry.last_load_s * 1e9)

    def timings(self, finished: Finished | None) -> wire.Timings:
        end = time.perf_counter_ns()
        first = self.first if self.first is not None else end
        load = self.load_ns()
        return wire.Timings(
            total_duration=end - self.arrival,
            load_duration=load,
            prompt_eval_count=finished.prompt_tokens if finished else 0,
            prompt_eval_duration=max(first - self.arrival - load, 0),
            eval_count=finished.completion_tokens if finished else 0,
            eval_duration=end - first,
        )


@dataclass
class Shape:
    """One request's objects: chat (``message``) or generate (``response``)."""

    chat: bool
    model: str
    logprobs: bool

    def piece(
        self,
        text: str = "",
        thinking: str = "",
        calls: list[wire.OutToolCall] | None = None,
        logprobs: list[wire.Logprob] | None = None,
    ):
        if self.chat:
            message = wire.OutMessage(
                role="assistant", content=text, thinking=thinking or None, tool_calls=calls
            )
            return wire.ChatChunk(
                model=self.model, created_at=_now(), message=message, done=False, logprobs=logprobs
            )
        return wire.GenerateChunk(
            model=self.model,
            created_at=_now(),
            response=text,
            thinking=thinking or None,
            done=False,
            logprobs=logprobs,
        )

    def last(self, reason: str, timings: wire.Timings | None = None, **fields):
        """The ``done`` object; ``fields`` as ``piece``'s (a whole answer's, unstreamed)."""
        chunk = self.piece(**fields)
        done = msgspec.structs.replace(chunk, done=True, done_reason=reason)
        if timings is None:
            return done
        return msgspec.structs.replace(done, **msgspec.structs.asdict(timings))

    def answer(self, c: Choice, clock: Clock) -> Response:
        assert c.finished is not None
        return json_response(
            self.last(
                done_reason(c.finished.finish_reason),
                clock.timings(c.finished),
                text=c.text,
                thinking=c.reasoning,
                calls=_out_calls(c.calls, cut=c.finished.cut_call),
                logprobs=_logprobs(c.logprobs) if self.logprobs else None,
            )
        )


def _line(obj: object) -> bytes:
    return wire.encoder.encode(obj) + b"\n"


class _Calls:
    """Tool calls streamed in pieces (a call's first delta names it): each whole call is
    sent once the next one begins or the answer ends."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.sent = 0

    def add(self, delta: TextDelta) -> list[ToolCall]:
        merge_tool_calls(self.calls, delta)
        return self.flush(len(self.calls) - 1)

    def flush(self, upto: int | None = None) -> list[ToolCall]:
        end = len(self.calls) if upto is None else upto
        out, self.sent = self.calls[self.sent : end], max(self.sent, end)
        return out


async def _ndjson(
    shape: Shape, clock: Clock, first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]
) -> AsyncIterator[bytes]:
    """The streamed answer: a line per delta, the ``done`` line with the timings, or an
    ``{"error"}`` line for a failure after the first byte. Quiet spells send nothing
    (Ollama's clients parse every line as JSON)."""
    calls = _Calls()
    batch: list[ChoiceEvent] | None = first
    try:
        while batch is not None:
            for _, event in batch:
                match event:
                    case TextDelta():
                        clock.token()
                        sent = calls.add(event)
                        lp = _logprobs(event.logprobs) if shape.logprobs else None
                        if event.text or event.reasoning or sent or lp:
                            out = _out_calls(sent, calls.sent - len(sent))
                            yield _line(shape.piece(event.text, event.reasoning, out, lp))
                    case Finished():
                        sent = calls.flush()
                        if sent:
                            index = calls.sent - len(sent)
                            out = _out_calls(sent, index, event.cut_call)
                            yield _line(shape.piece(calls=out))
                        timings = clock.timings(event)
                        yield _line(shape.last(done_reason(event.finish_reason), timings))
                    case Failed():
                        yield _line(ERRORS.error(ApiError.from_failed(event)))
                        return
            batch = await anext(rest, None)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def _ndjson_response(body: AsyncIterator[bytes]) -> Response:
    return Response(body, content_type=NDJSON, headers={"Cache-Control": "no-cache"})


# ---- keep_alive and loading -------------------------------------------------------------


async def _keep_alive(pipeline: Pipeline, model: str, value: wire.KeepAliveValue) -> None:
    """This request's ``keep_alive`` for its model (none: the pool's ``idle_unload_s``)."""
    await pipeline.engine.send(KeepAlive(model=model, seconds=keep_alive_seconds(value)))


async def _load_only(pipeline: Pipeline, shape: Shape, model: str, keep: wire.KeepAliveValue):
    """An empty prompt: load the model (``done_reason: "load"``) or, with ``keep_alive``
    0, let it unload (``"unload"``), as ``ollama run`` / ``ollama stop`` ask."""
    clock = Clock(pipeline, model)
    if keep_alive_seconds(keep) != 0:
        await load(pipeline, model)
    await _keep_alive(pipeline, model, keep)
    if keep_alive_seconds(keep) == 0:
        return json_response(shape.last("unload"))
    return json_response(shape.last("load", clock.timings(None)))


async def _fit(pipeline: Pipeline, model: str, req, num_ctx: int | None):
    """``options.num_ctx`` below the model's context: the prompt is counted first (as
    ``/v1/messages/count_tokens`` counts it), to fit the answer in the window."""
    info = pipeline.model_info(model)
    if num_ctx is None or (info is not None and num_ctx >= info.context_length):
        return req
    counted = msgspec.structs.replace(req, request_id=f"{req.request_id}-count", model=model)
    try:
        prompt = await pipeline.count_tokens(counted)
    except PromptError as exc:
        raise ApiError(exc.reason, str(exc), param=exc.param) from exc
    except ModelUnavailable as exc:
        raise unavailable(exc) from exc
    return msgspec.structs.replace(req, sampling=within_context(req.sampling, num_ctx, prompt))


async def _run(
    pipeline: Pipeline, shape: Shape, model: str, req, w, superseder: Superseder | None = None
) -> Response:
    clock = Clock(pipeline, model)
    req = await _fit(pipeline, model, req, w.options.num_ctx if w.options else None)
    fim, key = req.fim if isinstance(req, CompletionRequest) else None, None
    if fim is not None:  # an editor's fill-in: a newer one on the file supersedes it
        key = (request.remote_addr, model, "/api/generate", file_key(fim.prefix, fim.suffix))
    newest = superseder if key is not None else None
    first, rest = await start_newest(newest, key, pipeline, [req], model)
    await _keep_alive(pipeline, model, w.keep_alive)  # after start: the model is busy now
    if w.stream:
        return _ndjson_response(_ndjson(shape, clock, first, rest))
    for _, event in first:
        if isinstance(event, TextDelta):
            clock.token()
    choice = (await collect(1, first, _timed(rest, clock)))[0]
    return shape.answer(choice, clock)


async def _timed(rest: AsyncIterator[list[ChoiceEvent]], clock: Clock):
    """``rest``, noting when the first token came."""
    try:
        async for batch in rest:
            if any(isinstance(e, TextDelta) for _, e in batch):
                clock.token()
            yield batch
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


# ---- embeddings -------------------------------------------------------------------------


def _no_num_ctx(options: wire.Options | None) -> None:
    check(
        options is None or options.num_ctx is None,
        "options.num_ctx",
        "num_ctx is not supported for embeddings: inputs are cut at the model's own limit "
        "(truncate) or refused",
    )


async def _embed(
    pipeline: Pipeline, model: str, texts: list[str], limits: EmbeddingLimits, **kw
) -> tuple[EmbeddingResult | None, Clock]:
    """The texts' vectors through the embeddings core (none: the model is only loaded,
    as Ollama answers an empty input)."""
    clock = Clock(pipeline, model)
    if not texts:
        await load(pipeline, model)
        return None, clock
    return await embed(pipeline, model, texts, limits=limits, **kw), clock


def _inputs(value: str | list[str]) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    return [t for t in texts if t] if isinstance(value, str) else texts


def _embed_routes(app: Blueprint, pipeline: Pipeline, v: Validator, select, limits) -> None:
    @app.post("/api/embed")
    async def embed_route() -> Response:
        w = v.decode(wire.embed_decoder, await request.get_data(cache=False))
        model, _ = select(w.model)
        _no_num_ctx(w.options)
        texts = _inputs(w.input)
        result, clock = await _embed(
            pipeline, model, texts, limits, dimensions=w.dimensions, truncate=w.truncate
        )
        await _keep_alive(pipeline, model, w.keep_alive)
        timings = clock.timings(None)
        body = wire.Embed(
            model=w.model,
            embeddings=result.vectors.tolist() if result else [],
            total_duration=timings.total_duration,
            load_duration=timings.load_duration,
            prompt_eval_count=result.prompt_tokens if result else 0,
        )
        return json_response(body)

    @app.post("/api/embeddings")
    async def embeddings_route() -> Response:
        w = v.decode(wire.embeddings_decoder, await request.get_data(cache=False))
        model, _ = select(w.model)
        _no_num_ctx(w.options)
        result, _ = await _embed(pipeline, model, _inputs(w.prompt), limits, truncate=True)
        await _keep_alive(pipeline, model, w.keep_alive)
        return json_response(wire.Embedding(embedding=result.vectors[0].tolist() if result else []))


# ---- routes -----------------------------------------------------------------------------


def install(
    app: QuartTrio,
    pipeline: Pipeline,
    v: Validator,
    select: Select,
    on_error: OnError,
    limits: EmbeddingLimits,
    superseder: Superseder | None = None,
) -> None:
    """Register the Ollama routes on the app, their errors in Ollama's format;
    ``superseder``: the editors' FIM requests (``suffix``), None when ``fim.supersede``
    is off."""
    api = Blueprint("ollama", __name__)
    _routes(api, pipeline, v, select, superseder)
    _embed_routes(api, pipeline, v, _named(select), limits)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)


def _named(select: Select) -> Select:
    """Ollama's requests must name their model (400 otherwise)."""

    def named(model: str | None) -> tuple[str, Validator]:
        check(bool(model), "model", "model is required")
        return select(model)

    return named


def _routes(
    app: Blueprint,
    pipeline: Pipeline,
    v: Validator,
    any_model: Select,
    superseder: Superseder | None = None,
) -> None:
    select = _named(any_model)

    def ready() -> None:
        any_model(None)  # 503 until the server is ready

    @app.post("/api/chat")
    async def chat() -> Response:
        w = v.decode(wire.chat_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        shape = Shape(True, w.model, w.logprobs)
        if not w.messages:
            return await _load_only(pipeline, shape, model, w.keep_alive)
        req = chat_request(w, f"ollama-{uuid.uuid4().hex}", mv)
        return await _run(pipeline, shape, model, req, w)

    @app.post("/api/generate")
    async def generate() -> Response:
        w = v.decode(wire.generate_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        shape = Shape(False, w.model, w.logprobs)
        if not w.prompt and not w.images and not w.suffix:
            return await _load_only(pipeline, shape, model, w.keep_alive)
        req = generate_request(w, f"ollama-{uuid.uuid4().hex}", mv)
        return await _run(pipeline, shape, model, req, w, superseder)

    @app.get("/api/tags")
    async def tags() -> Response:
        ready()
        return json_response(listings.tags(pipeline))

    @app.get("/api/ps")
    async def ps() -> Response:
        ready()
        return json_response(listings.running(pipeline))

    @app.post("/api/show")
    async def show() -> Response:
        w = v.decode(wire.show_decoder, await request.get_data(cache=False))
        model, _ = select(w.model or w.name)
        return json_response(await listings.show(pipeline, model))

    @app.get("/api/version")
    async def version() -> Response:
        return json_response(wire.Version(version=wire.API_VERSION))

    @app.route("/api/<path:rest>", methods=["GET", "POST", "PUT", "DELETE", "HEAD"])
    async def elsewhere(rest: str) -> Response:
        raise ApiError(
            "not_found",
            f"/api/{rest} is not served: mlxd serves the models of its configuration "
            "(pull, push, create, copy and delete are not available); it answers "
            + ", ".join(SERVED),
        )


SERVED = (
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
)


__all__ = ["ERRORS", "install"]
