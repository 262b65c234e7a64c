"""llama.cpp's code-completion routes: ``/infill``, ``/tokenize`` and ``/detokenize``.

``/infill`` lays ``input_prefix``, ``input_suffix``, ``input_extra`` (other files, as
the family's repository context) and ``prompt`` (text typed after the prefix) out in
the model family's FIM tokens (``actors/families/fim.py``) and answers in llama.cpp's
``/completion`` shape, whole or streamed. It keeps llama.cpp's two stops for completion
as one types (``TypingStop``): ``n_indent`` (a new line indented less than this ends the
middle) and ``t_max_predict_ms`` (once this long has passed since the first token, the
first new line ends it). Completion requests come a few characters apart: once a newer
one from the same client on the same file has started, the older ends at once
(``daemon/api/supersede.py``, ``fim.supersede``) rather than holding a batch row the
user no longer waits for. Successive requests share their prefix, so the prefix cache serves them;
``tokens_cached`` and ``timings.cache_n`` say how much. Errors use llama.cpp's format.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import trio
from mlxd.actors.detokenizer import TokenTexts
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    ChoiceEvent,
    Select,
    Usage,
    Validator,
    check,
    collect,
    json_response,
)
from mlxd.daemon.api.errors import ApiError, ErrorFormat, ErrorReason, OnError, install_errors
from mlxd.daemon.api.ollama_models import load
from mlxd.daemon.api.supersede import Superseder, file_key, start_newest
from mlxd.daemon.pipeline import Pipeline
from mlxd.daemon.settings import FimSettings
from mlxd.protocol import llamacpp as wire
from mlxd.protocol.messages import (
    CompletionRequest,
    FimFile,
    FimInput,
    Finished,
    SamplingParams,
    Started,
    TextDelta,
)
from quart import Blueprint, Response, request
from quart_trio import QuartTrio

_TYPES: dict[ErrorReason, str] = {
    **dict.fromkeys(
        ("invalid_request", "too_deeply_nested", "request_too_large", "bad_host"),
        "invalid_request_error",
    ),
    **dict.fromkeys(
        ("body_too_large", "unsupported_media_type", "method_not_allowed"), "invalid_request_error"
    ),
    "invalid_api_key": "authentication_error",
    "host_not_allowed": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    **dict.fromkeys(
        ("not_ready", "queue_full", "queue_timeout", "model_loading", "shutting_down"),
        "unavailable_error",
    ),
}


class LlamaCppErrors(ErrorFormat):
    """``{"error": {"code", "message", "type"}}``, as llama.cpp's server answers."""

    def body(self, error: ApiError) -> bytes:
        body = wire.ErrorBody(code=error.status, message=str(error), type=self.type_of(error))
        return wire.encoder.encode(wire.ErrorResponse(error=body))


ERRORS = LlamaCppErrors(_TYPES, "server_error")


# ---- stops while typing (sync core) ---------------------------------------------------------


class TypingStop:
    """llama.cpp's completion stops, over the middle's text as it streams.

    ``n_indent`` > 0: a new line indented by fewer whitespace characters ends the middle
    (the line is dropped; its newline stays). Its indentation is held back until a
    character that is not whitespace decides. ``t_max_s`` > 0: once this long has
    passed since the first text, a new line written so far ends it there.
    """

    def __init__(self, n_indent: int = 0, t_max_s: float = 0.0):
        self.n_indent, self.t_max_s = n_indent, t_max_s
        self.first_at: float | None = None
        self.held = ""  # the start of a line whose indentation is not known yet
        self.line_start = False  # after a new line (the first line is the cursor's own)
        self.new_line = False
        self.stopped = False

    def feed(self, text: str, now: float) -> str:
        """The text safe to show; ``stopped`` once the middle has ended."""
        if self.stopped:
            return ""
        if self.first_at is None:
            self.first_at = now
        out = self._indented(text) if self.n_indent > 0 else text
        self.new_line = self.new_line or "\n" in out
        if self.t_max_s > 0 and self.new_line and now - self.first_at >= self.t_max_s:
            self.stopped = True
        return out

    def _indented(self, text: str) -> str:
        out = []
        for ch in text:
            if self.line_start:
                if ch in " \t":
                    self.held += ch
                    continue
                if ch != "\n" and len(self.held) < self.n_indent:
                    self.stopped, self.held = True, ""
                    break
                out.append(self.held)
                self.held, self.line_start = "", False
            out.append(ch)
            self.line_start = ch == "\n"
        return "".join(out)

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


# ---- the request's events, through the stops ---------------------------------------------------


@dataclass
class Progress:
    """What the answer reports: counts from ``Started`` and the deltas, and the times."""

    arrival: float = field(default_factory=time.perf_counter)
    started: float | None = None  # the engine took it (after any wait for the model's load)
    first: float | None = None
    prompt: int = 0
    cached: int = 0
    completion: int = 0

    def see(self, event: object) -> None:
        if isinstance(event, Started):
            self.prompt, self.cached = event.prompt_tokens, event.cached_tokens
            self.started = self.started or time.perf_counter()
        elif isinstance(event, TextDelta):
            self.first = self.first or time.perf_counter()
            self.completion += event.tokens

    def ended(self, reason: str) -> Finished:
        """The request's end where a typing stop ended it."""
        return Finished(
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=self.prompt,
            completion_tokens=self.completion,
            cached_tokens=self.cached,
        )


async def guarded(
    rest: AsyncIterator[list[ChoiceEvent]], stop: TypingStop, progress: Progress
) -> AsyncIterator[list[ChoiceEvent]]:
    """``rest`` through ``stop``: its text deltas as ``stop`` releases them, ended
    (``length``) when it stops. Ending it closes the sessions, which aborts the sequence
    in the engine."""
    try:
        async for batch in rest:
            out, ended = _through(batch, stop, progress)
            yield out
            if ended:
                return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def _now() -> float:
    """The clock the typing stops read: trio's (tests substitute their own)."""
    return trio.current_time()


def _through(
    batch: list[ChoiceEvent], stop: TypingStop, progress: Progress
) -> tuple[list[ChoiceEvent], bool]:
    out: list[ChoiceEvent] = []
    for i, event in batch:
        progress.see(event)
        if isinstance(event, TextDelta):
            text = stop.feed(event.text, _now())
            out.append((i, msgspec.structs.replace(event, text=text)))
            if stop.stopped:
                return [*out, (i, progress.ended("length"))], True
        elif isinstance(event, Finished):
            rest = stop.flush()
            if rest:
                out.append((i, TextDelta(text=rest)))
            out.append((i, event))
        else:
            out.append((i, event))
    return out, False


# ---- /infill --------------------------------------------------------------------------------


def infill_request(w: wire.InfillRequest, rid: str, v: Validator, fim: FimSettings):
    """The internal request of an ``/infill`` body (sampling range-checked)."""
    check(
        len(w.input_extra) <= fim.max_extra_files,
        "input_extra",
        f"at most {fim.max_extra_files} input_extra entries (fim.max_extra_files)",
    )
    check(w.n_probs == 0, "n_probs", "n_probs (token probabilities) is not available on /infill")
    check(w.n_indent >= 0, "n_indent", "n_indent must be >= 0")
    check(w.t_max_predict_ms >= 0, "t_max_predict_ms", "t_max_predict_ms must be >= 0 (0: off)")
    asked = w.n_predict if w.n_predict is not None else w.max_tokens
    v.in_range(asked, "n_predict")
    sampling = SamplingParams(
        max_tokens=None if asked is None or asked < 0 else asked,
        temperature=max(w.temperature, 0.0),  # llama.cpp: a negative temperature is greedy
        top_p=w.top_p,
        top_k=w.top_k,
        min_p=w.min_p,
        repetition_penalty=w.repeat_penalty,
        presence_penalty=w.presence_penalty,
        frequency_penalty=w.frequency_penalty,
        seed=None if w.seed < 0 else w.seed,
        stop=v.stops(w.stop),
    )
    files = tuple(FimFile(filename=c.filename, text=c.text) for c in w.input_extra)
    parts = FimInput(
        prefix=w.input_prefix,
        suffix=w.input_suffix,
        middle=w.prompt,
        files=files,
        repo=fim.repo_name,
        param="input_suffix",
    )
    return CompletionRequest(
        request_id=rid,
        prompt="",
        sampling=v.sampling(sampling, max_tokens_param="n_predict"),
        arrival=time.time(),
        fim=parts,
    )


def stop_type(event: Finished) -> str:
    if event.finish_reason == "stop":
        return "word" if event.stop_string else "eos"
    return {"length": "limit", "abort": "abort"}.get(event.finish_reason, event.finish_reason)


@dataclass
class Answer:
    """``/infill``'s answers: the whole one, a streamed chunk, the last chunk."""

    model: str
    w: wire.InfillRequest
    progress: Progress

    def last(self, content: str, event: Finished, has_new_line: bool) -> wire.Completion:
        p, now = self.progress, time.perf_counter()
        first = p.first or now
        u = Usage.of([event])
        # llama.cpp's prompt time: its prompt's processing, not a wait for the model's load
        prompt_ms, predicted_ms = (first - (p.started or p.arrival)) * 1e3, (now - first) * 1e3
        evaluated = u.prompt - u.cached
        return wire.Completion(
            content=content,
            stop=True,
            model=self.model,
            tokens_predicted=u.completion,
            tokens_evaluated=u.prompt,
            tokens_cached=u.cached,
            truncated=False,
            has_new_line=has_new_line,
            stop_type=stop_type(event),
            stopping_word=event.stop_string or "",
            generation_settings=self.settings(),
            timings=wire.Timings(
                prompt_n=evaluated,
                prompt_ms=prompt_ms,
                prompt_per_token_ms=prompt_ms / max(evaluated, 1),
                prompt_per_second=evaluated / max(prompt_ms / 1e3, 1e-9),
                predicted_n=u.completion,
                predicted_ms=predicted_ms,
                predicted_per_token_ms=predicted_ms / max(u.completion, 1),
                predicted_per_second=u.completion / max(predicted_ms / 1e3, 1e-9),
                cache_n=u.cached,
            ),
        )

    def settings(self) -> wire.GenerationSettings:
        w = self.w
        return wire.GenerationSettings(
            n_predict=w.n_predict if w.n_predict is not None else (w.max_tokens or -1),
            temperature=w.temperature,
            top_k=w.top_k,
            top_p=w.top_p,
            min_p=w.min_p,
            seed=w.seed,
            stop=w.stop,
            n_indent=w.n_indent,
            t_max_predict_ms=w.t_max_predict_ms,
            model=self.model,
        )

    def encode(self, obj: wire.Completion) -> bytes:
        if self.w.response_fields is None:
            return wire.encoder.encode(obj)
        fields = wire.only_fields(msgspec.to_builtins(obj), self.w.response_fields)
        return wire.encoder.encode(fields)


class InfillStream:
    """``/infill`` streamed: a ``data:`` frame per delta (``content``, ``stop: false``),
    the last with the counts and timings; no terminator, as llama.cpp."""

    terminator = b""

    def __init__(self, answer: Answer):
        self.answer, self.new_line = answer, False

    def opening(self) -> list[bytes]:
        return []

    def started(self, i: int, event: Started) -> list[bytes]:
        return []

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        if not event.text:
            return []
        self.new_line = self.new_line or "\n" in event.text
        return [sse.frame(wire.encoder.encode(wire.CompletionChunk(content=event.text)))]

    def finished(self, i: int, event: Finished) -> list[bytes]:
        return [sse.frame(self.answer.encode(self.answer.last("", event, self.new_line)))]

    def closing(self, usage: Usage) -> list[bytes]:
        return []

    def failed(self, error: ApiError) -> list[bytes]:
        return [sse.frame(ERRORS.body(error))]

    def keepalive(self) -> list[bytes]:
        return [sse.KEEPALIVE_COMMENT]


@dataclass
class Infill:
    """The ``/infill`` route's state: the pipeline, the settings, the open requests."""

    pipeline: Pipeline
    fim: FimSettings
    superseder: Superseder | None = None  # None: fim.supersede off

    async def run(self, model: str, mv: Validator, w: wire.InfillRequest) -> Response:
        req = infill_request(w, f"infill-{uuid.uuid4().hex}", mv, self.fim)
        progress = Progress()
        answer = Answer(model, w, progress)
        key = (request.remote_addr, model, "/infill", file_key(w.input_prefix, w.input_suffix))
        first, rest = await start_newest(self.superseder, key, self.pipeline, [req], model)
        stop = TypingStop(w.n_indent, w.t_max_predict_ms / 1e3)
        events = guarded(_from(first, rest), stop, progress)
        first = await anext(events)
        if w.stream:
            return sse.stream(InfillStream(answer), first, events)
        (choice,) = await collect(1, first, events)
        assert choice.finished is not None
        return self._whole(answer, choice.text, choice.finished)

    def _whole(self, answer: Answer, text: str, event: Finished) -> Response:
        body = answer.encode(answer.last(text, event, "\n" in text))
        return Response(body, content_type="application/json")


async def _from(
    first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]
) -> AsyncIterator[list[ChoiceEvent]]:
    """The started request's events as one stream, its first batch first."""
    try:
        yield first
        async for batch in rest:
            yield batch
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


# ---- /tokenize and /detokenize ----------------------------------------------------------------


async def _tokenizer(pipeline: Pipeline, model: str):
    await load(pipeline, model)  # a 503 / 500 where it cannot load
    info = pipeline.model_info(model)
    if info is None:
        raise ApiError("model_loading", f"model {model!r} is not loaded yet", retry_after=1)
    return info


def tokenize(info, w: wire.TokenizeRequest) -> wire.TokenizeResponse:
    """llama.cpp's ``/tokenize``: ``add_special`` puts the BOS first, ``parse_special``
    false keeps special tokens spelled in the text as text (a 400 where the model's
    tokenizer cannot)."""
    try:
        w.content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError("invalid_request", "content is not UTF-8 text", param="content") from exc
    tokenizer = info.tokenizer
    ids = _encode(tokenizer, w.content, w.add_special, w.parse_special)
    if not w.with_pieces:
        return wire.TokenizeResponse(tokens=list(ids))
    texts = TokenTexts(tokenizer)
    pieces = []
    for token in ids:
        text, raw = texts(token)
        piece: str | list[int] = text if "\ufffd" not in text else list(raw)
        pieces.append(wire.Piece(id=token, piece=piece))
    return wire.TokenizeResponse(tokens=pieces)


def _encode(tokenizer, content: str, add_special: bool, parse_special: bool) -> list[int]:
    try:
        return tokenizer.encode(
            content, add_special_tokens=add_special, split_special_tokens=not parse_special
        )
    except TypeError:  # a tokenizer without split_special_tokens: it parses them
        if not parse_special:
            raise ApiError(
                "invalid_request",
                "parse_special: false is not available for this model: its tokenizer cannot "
                "keep special tokens spelled in the text as text; leave parse_special out "
                "(true)",
                param="parse_special",
            ) from None
        return tokenizer.encode(content, add_special_tokens=add_special)


def detokenize(info, w: wire.DetokenizeRequest) -> wire.DetokenizeResponse:
    """llama.cpp's ``/detokenize`` (on a worker thread: the ids are checked first)."""
    return wire.DetokenizeResponse(
        content=info.tokenizer.decode(w.tokens, skip_special_tokens=False)
    )


def _check_detokenize(info, w: wire.DetokenizeRequest, v: Validator, fim: FimSettings) -> None:
    check(
        len(w.tokens) <= fim.max_detokenize_tokens,
        "tokens",
        f"at most {fim.max_detokenize_tokens} tokens per /detokenize request "
        "(fim.max_detokenize_tokens)",
    )
    v.for_model(info.vocab_size).token_ids(w.tokens, "tokens")


# ---- routes ---------------------------------------------------------------------------------


def install(
    app: QuartTrio,
    pipeline: Pipeline,
    v: Validator,
    select: Select,
    on_error: OnError,
    fim: FimSettings,
    superseder: Superseder | None = None,
) -> Infill:
    """Register ``/infill``, ``/tokenize`` and ``/detokenize`` (and their ``/v1/`` twins
    where llama.cpp has them), their errors in llama.cpp's format."""
    api = Blueprint("llamacpp", __name__)
    infill = Infill(pipeline, fim, superseder)

    @api.post("/infill")
    async def infill_route() -> Response:
        w = v.decode(wire.infill_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        return await infill.run(model, mv, w)

    @api.post("/tokenize")
    async def tokenize_route() -> Response:
        w = v.decode(wire.tokenize_decoder, await request.get_data(cache=False))
        model, _ = select(w.model)
        info = await _tokenizer(pipeline, model)
        return json_response(await trio.to_thread.run_sync(tokenize, info, w))

    @api.post("/detokenize")
    async def detokenize_route() -> Response:
        w = v.decode(wire.detokenize_decoder, await request.get_data(cache=False))
        model, _ = select(w.model)
        info = await _tokenizer(pipeline, model)
        _check_detokenize(info, w, v, fim)
        return json_response(await trio.to_thread.run_sync(detokenize, info, w))

    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)
    return infill


__all__ = ["ERRORS", "install"]
