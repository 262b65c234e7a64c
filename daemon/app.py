"""The HTTP surface (quart-trio): OpenAI chat/completions, models, health, metrics, status.

Handlers decode and validate the wire request, hand it to the pipeline and turn
mailbox events into JSON or Server-Sent Events. Errors before the first token
get a real status code; errors after it end the stream with an error event.
Every route but ``/health`` needs an API key when keys are configured; CORS
headers are added only for configured origins.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from daemon.pipeline import Pipeline, ServerState, Session
from daemon.security import ApiKeys, Cors
from daemon.settings import Settings
from daemon.telemetry import request_log, status_snapshot
from protocol import openai as wire
from protocol.messages import (
    ChatRequest,
    ClearCache,
    CompletionRequest,
    Failed,
    Finished,
    MailboxEvent,
    Message,
    SamplingParams,
    TextDelta,
)

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
}


class ApiError(Exception):
    """An error answered in the OpenAI error format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after
        self.kind = kind or _OPENAI_TYPES.get(status, "server_error")
        self.headers = headers or {}
        self.in_session = False  # counted and logged by its session, not the error handler

    @classmethod
    def from_failed(cls, failed: Failed) -> ApiError:
        error = cls(
            failed.status,
            failed.message,
            param=failed.param,
            kind=failed.kind,
            code=failed.code,
            retry_after=failed.retry_after,
        )
        error.in_session = True
        return error

    def body(self) -> bytes:
        err = wire.ErrorBody(message=str(self), type=self.kind, param=self.param, code=self.code)
        return wire.encoder.encode(wire.ErrorResponse(error=err))

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after:
            headers["Retry-After"] = str(int(self.retry_after))
        return Response(
            self.body(), status=self.status, headers=headers, content_type="application/json"
        )


def _json(obj: msgspec.Struct, status: int = 200) -> Response:
    return Response(wire.encoder.encode(obj), status=status, content_type="application/json")


def _decode(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", param=wire.error_param(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc}") from exc


class Validator:
    """Wire request → internal SamplingParams, enforcing every limit in the settings."""

    def __init__(self, settings: Settings):
        self.engine = settings.engine
        self.model = settings.model
        self.max_messages = settings.tokenizer.max_messages
        self.priority_enabled = settings.admission.priority

    def messages(self, messages: list[wire.WireMessage]) -> tuple[Message, ...]:
        _check(
            len(messages) <= self.max_messages,
            "messages",
            f"at most {self.max_messages} messages per request (tokenizer.max_messages); "
            f"got {len(messages)}",
        )
        return tuple(Message(role=m.role, content=m.content, name=m.name) for m in messages)

    def priority(self, w: wire._SamplingFields) -> int:
        """The request's priority when ``admission.priority`` is on; otherwise all are equal."""
        return (w.priority or 0) if self.priority_enabled else 0

    def check_model(self, requested: str | None, served: str) -> None:
        if requested and requested != served and not self.model.accept_other_ids:
            raise ApiError(
                404,
                f"model '{requested}' not found; this server serves '{served}'",
                param="model",
                code="model_not_found",
            )

    def sampling(self, w: wire._SamplingFields, max_tokens: int | None) -> SamplingParams:
        self._refuse_unsupported(w)
        e = self.engine
        _check(
            max_tokens is None or 1 <= max_tokens <= e.max_tokens_cap,
            "max_tokens",
            f"max_tokens must be between 1 and {e.max_tokens_cap} (engine.max_tokens_cap)",
        )
        _check(0.0 <= w.temperature <= 2.0, "temperature", "temperature must be in [0, 2]")
        _check(0.0 < w.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _check(w.top_k >= 0, "top_k", "top_k must be >= 0")
        _check(0.0 <= w.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        _check(-2.0 <= w.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= w.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(w.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=w.temperature,
            top_p=w.top_p,
            top_k=w.top_k,
            min_p=w.min_p,
            presence_penalty=w.presence_penalty,
            frequency_penalty=w.frequency_penalty,
            repetition_penalty=w.repetition_penalty,
            logit_bias=self._logit_bias(w.logit_bias),
            seed=w.seed,
            stop=self._stops(w.stop),
            speculative=w.speculative is not False,
            spec_prefill=w.spec_prefill,
        )

    def _refuse_unsupported(self, w: wire._SamplingFields) -> None:
        _check(w.n == 1, "n", "only n=1 is supported")
        _check(not w.logprobs, "logprobs", "logprobs are not supported yet")
        _check(not w.tools, "tools", "tool calling is not supported yet")
        fmt = (w.response_format or {}).get("type", "text")
        _check(
            fmt == "text", "response_format", "only response_format type 'text' is supported yet"
        )

    def _stops(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        e = self.engine
        _check(
            len(stops) <= e.max_stop_strings,
            "stop",
            f"at most {e.max_stop_strings} stop strings (engine.max_stop_strings)",
        )
        _check(
            all(len(s) <= e.max_stop_length for s in stops),
            "stop",
            f"stop strings must be at most {e.max_stop_length} characters (engine.max_stop_length)",
        )
        return tuple(s for s in stops if s)

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
        try:
            return {int(k): max(-100.0, min(100.0, v)) for k, v in (bias or {}).items()}
        except ValueError as exc:
            raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from exc


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param=param)


# ---- response shaping -----------------------------------------------------------------


class _Shape:
    """How one endpoint turns text into chunks and a final body."""

    def __init__(self, chat: bool, rid: str, model: str):
        self.chat, self.rid, self.model, self.created = chat, rid, model, int(time.time())

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        usage: wire.Usage | None = None,
        empty: bool = False,
    ) -> bytes:
        if self.chat:
            choices = (
                []
                if empty
                else [
                    wire.ChunkChoice(
                        index=0,
                        delta=wire.Delta(role="assistant" if role else None, content=text),
                        finish_reason=finish,
                    )
                ]
            )
            obj = wire.ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        else:
            choices = (
                [] if empty else [wire.TextChoice(index=0, text=text or "", finish_reason=finish)]
            )
            obj = wire.TextCompletion(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        return b"data: " + wire.encoder.encode(obj) + b"\n\n"

    def full(self, text: str, finished: Finished) -> msgspec.Struct:
        usage = _usage(finished)
        if self.chat:
            choice = wire.ChatChoice(
                index=0,
                message=wire.AssistantMessage(content=text),
                finish_reason=finished.finish_reason,
            )
            return wire.ChatCompletion(
                id=self.rid, created=self.created, model=self.model, choices=[choice], usage=usage
            )
        choice = wire.TextChoice(index=0, text=text, finish_reason=finished.finish_reason)
        return wire.TextCompletion(
            id=self.rid, created=self.created, model=self.model, choices=[choice], usage=usage
        )


def _prefilled(f: Finished) -> int | None:
    """Reported only when SpecPrefill skipped prompt tokens."""
    full = f.prompt_tokens - f.cached_tokens
    return f.prefilled_tokens if 0 <= f.prefilled_tokens < full else None


def _usage(f: Finished) -> wire.Usage:
    return wire.Usage(
        prompt_tokens=f.prompt_tokens,
        completion_tokens=f.completion_tokens,
        total_tokens=f.prompt_tokens + f.completion_tokens,
        prompt_tokens_details=wire.PromptTokensDetails(
            cached_tokens=f.cached_tokens, prefilled_tokens=_prefilled(f)
        ),
    )


async def _sse(
    shape: _Shape,
    first: list[MailboxEvent],
    rest: AsyncIterator[list[MailboxEvent]],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    if shape.chat:
        yield shape.chunk("", role=True)
    batch: list[MailboxEvent] | None = first
    while batch is not None:
        for event in batch:
            match event:
                case TextDelta(text=text):
                    yield shape.chunk(text)
                case Finished():
                    yield shape.chunk(None if shape.chat else "", event.finish_reason)
                    if include_usage:
                        yield shape.chunk(None, usage=_usage(event), empty=True)
                case Failed():
                    yield b"data: " + ApiError.from_failed(event).body() + b"\n\n"
        batch = await anext(rest, None)
    yield b"data: [DONE]\n\n"


async def _collect(first: list[MailboxEvent], rest: AsyncIterator[list[MailboxEvent]]):
    texts: list[str] = []
    batch: list[MailboxEvent] | None = first
    while batch is not None:
        for event in batch:
            match event:
                case TextDelta(text=text):
                    texts.append(text)
                case Finished():
                    return "".join(texts), event
                case Failed():
                    raise ApiError.from_failed(event)
        batch = await anext(rest, None)
    raise ApiError(500, "the request ended without a result")


async def _respond(
    pipeline: Pipeline, req, stream: bool, include_usage: bool, shape: _Shape
) -> Response:
    session: Session = await pipeline.submit(req)
    events = session.events()
    try:
        first = await anext(events)  # waits through queueing and tokenization
    except BaseException:
        await events.aclose()
        raise
    if isinstance(first[0], Failed):
        await events.aclose()
        raise ApiError.from_failed(first[0])
    if stream:
        # ``events`` is started, so even if the body is never iterated its cleanup runs.
        body = _sse(shape, first, events, include_usage)
        return Response(
            body,
            content_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        text, finished = await _collect(first, events)
    finally:
        await events.aclose()
    return _json(shape.full(text, finished))


def create_app(pipeline: Pipeline, settings: Settings) -> QuartTrio:
    """Build the app; the pipeline supplies the actor graph, settings the limits."""
    app = QuartTrio("mlxd")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.server.max_body_bytes, RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60
    )
    validator = Validator(settings)

    def ready() -> str:
        if pipeline.state is not ServerState.READY or pipeline.info is None:
            raise ApiError(
                503, f"server is {pipeline.state.value}", kind="service_unavailable", retry_after=1
            )
        return pipeline.info.model_id

    async def body() -> bytes:
        return await request.get_data(cache=False)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        w = _decode(wire.chat_decoder, await body())
        model = ready()
        validator.check_model(w.model, model)
        messages = validator.messages(w.messages)
        sampling = validator.sampling(w, w.max_completion_tokens or w.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = ChatRequest(
            request_id=rid,
            messages=messages,
            sampling=sampling,
            arrival=time.time(),
            priority=validator.priority(w),
        )
        usage = bool(w.stream_options and w.stream_options.include_usage)
        return await _respond(pipeline, req, w.stream, usage, _Shape(True, rid, model))

    @app.post("/v1/completions")
    async def completions() -> Response:
        w = _decode(wire.completion_decoder, await body())
        model = ready()
        validator.check_model(w.model, model)
        sampling = validator.sampling(w, w.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        req = CompletionRequest(
            request_id=rid,
            prompt=_one_prompt(w.prompt),
            sampling=sampling,
            arrival=time.time(),
            priority=validator.priority(w),
        )
        usage = bool(w.stream_options and w.stream_options.include_usage)
        return await _respond(pipeline, req, w.stream, usage, _Shape(False, rid, model))

    @app.get("/v1/models")
    async def models() -> Response:
        model = ready()
        return _json(wire.ModelList(data=[wire.ModelCard(id=model, created=0)]))

    @app.get("/v1/cache")
    async def cache_stats() -> Response:
        ready()
        stats = pipeline.info.cache_stats
        body = {"enabled": stats is not None, **(dataclasses.asdict(stats) if stats else {})}
        return Response(msgspec.json.encode(body), content_type="application/json")

    @app.get("/v1/speculative")
    async def speculative_stats() -> Response:
        ready()
        stats = pipeline.info.spec_stats
        body: dict = {"enabled": False}
        if stats is not None:
            body = dataclasses.asdict(stats)
            body["enabled"] = stats.enabled
            body["acceptance_rate"] = stats.acceptance_rate
        return Response(msgspec.json.encode(body), content_type="application/json")

    @app.delete("/v1/cache")
    async def cache_clear() -> Response:
        ready()
        await pipeline.engine.send(ClearCache())
        return Response(msgspec.json.encode({"cleared": True}), content_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        status = 200 if pipeline.state is ServerState.READY else 503
        return Response(
            msgspec.json.encode({"status": pipeline.state.value}),
            status=status,
            content_type="application/json",
        )

    _install_observability(app, pipeline, settings)
    _install_guards(app, settings)
    _install_error_handlers(app, settings, pipeline)
    return app


def _one_prompt(prompt: str | list[str | int]) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return tuple(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise ApiError(
        400, "prompt must be a string, a list of token ids or a list of one string", param="prompt"
    )


def _install_observability(app: QuartTrio, pipeline: Pipeline, settings: Settings) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(pipeline.telemetry.exposition(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def server_status() -> Response:
        return _json(status_snapshot(pipeline, settings, trio.current_time()))


_OPEN_PATHS = frozenset({"/health"})


def _install_guards(app: QuartTrio, settings: Settings) -> None:
    """API keys on every route but /health; CORS preflight and headers for allowed origins."""
    keys = ApiKeys.from_settings(settings.auth)
    cors = Cors(settings.server.cors_origins)

    @app.before_request
    async def guard() -> Response | None:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and cors.allows(origin):
            return Response(b"", status=204, headers=cors.preflight_headers(origin or ""))
        if keys.enabled and request.path not in _OPEN_PATHS and not keys.allows(request.headers):
            raise ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if cors.allows(origin):
            response.headers.update(cors.headers(origin or ""))
        return response


def _install_error_handlers(app: QuartTrio, settings: Settings, pipeline: Pipeline) -> None:
    telemetry = pipeline.telemetry

    def early(error: ApiError) -> Response:
        """An error before the request reached the pipeline: counted and logged here."""
        if not error.in_session:
            telemetry.http_error(error.status)
            request_log.info(
                "request id=- status=%d path=%s error=%r", error.status, request.path, str(error)
            )
        return error.response()

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return early(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        too_large = (
            f"request body is larger than {settings.server.max_body_bytes} bytes "
            "(server.max_body_bytes)"
        )
        message = {413: too_large}.get(status, exc.description or exc.name)
        return early(ApiError(status, message))
