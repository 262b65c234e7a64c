"""Embeddings: ``POST /v1/embeddings`` (OpenAI), over one core that other APIs share.

The core, free of any API's wire types (Ollama's ``/api/embed`` calls it too)::

    async def embed(
        pipeline: Pipeline,
        model: str,                                # a served id (the app's ``select``)
        inputs: Sequence[str | Sequence[int]],     # texts, or token-id lists
        *,
        limits: EmbeddingLimits,                   # EmbeddingLimits.of(settings)
        dimensions: int | None = None,             # None: the model's own size
        truncate: bool = False,                    # cut inputs to the model's limit (else 400)
        param: str = "input",                      # the request field, for 400s
    ) -> EmbeddingResult                           # .vectors (n, d) float32, .prompt_tokens

It raises ``ApiError`` (each API renders it in its own format): 400 for a model that
does not embed, no inputs or too many (``embeddings.max_inputs``), an empty input, a
token id outside the vocabulary (checked before MLX sees it), an input longer than the
model takes (``embeddings.max_input_tokens``, else its context; OpenAI refuses rather
than truncates, and so does ``/v1/embeddings``) and a ``dimensions`` the model cannot
give: the native size always, a smaller one only where the model declares Matryoshka
sizes (``[[models]] matryoshka_dimensions`` or its config.json), and then it is cut and
renormalised. 429 when the model's queue is full (``embeddings.max_queued_inputs``);
the model-loading 503s and the queue timeout and deadline (``[admission]``) as for
chat.

The request skips the admission queue and the tokenizer actor: its texts are
tokenized here in a worker thread with the model's tokenizer once the model has
loaded; an ``Embed`` goes to the generation actor, whose ``EmbeddingCore`` batches it
with other requests' inputs, and its ``Embedded`` (or ``Failed``) comes back to its
mailbox. A client that leaves aborts it (the session's cleanup).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.actors.tokenizer import ModelUnavailable, PromptError, utf8_text
from mlxd.daemon.api.common import Select, Validator, check, json_response
from mlxd.daemon.api.errors import ApiError, OnError, install_errors
from mlxd.daemon.pipeline import Pipeline, Session
from mlxd.daemon.settings import Settings
from mlxd.protocol import embeddings as wire
from mlxd.protocol.embeddings import EmbeddingInfo
from mlxd.protocol.messages import Embed, Embedded, EmbedRequest, Failed
from quart import Blueprint, Response, request
from quart_trio import QuartTrio

EmbeddingInput = str | Sequence[int]


@dataclass(frozen=True)
class EmbeddingLimits:
    """What a request may ask (``[embeddings]``)."""

    max_inputs: int = 2048

    @classmethod
    def of(cls, settings: Settings) -> EmbeddingLimits:
        return cls(max_inputs=settings.embeddings.max_inputs)


@dataclass(frozen=True)
class EmbeddingResult:
    """One vector per input, in order: float32, shape (inputs, dimensions), L2-normalised
    where the model normalises; ``tokens``: each input's token count."""

    model: str
    vectors: np.ndarray
    tokens: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


async def embed(
    pipeline: Pipeline,
    model: str,
    inputs: Sequence[EmbeddingInput],
    *,
    limits: EmbeddingLimits,
    dimensions: int | None = None,
    truncate: bool = False,
    param: str = "input",
) -> EmbeddingResult:
    """Embed ``inputs`` with ``model`` (see the module docstring)."""
    assert pipeline.models is not None, "embed before the actors run"
    check(
        model not in pipeline.models.adapters,
        "model",
        f"{model!r} is a LoRA adapter of a chat model: it does not serve embeddings",
    )
    entry = pipeline.models.entries[model]
    check(
        entry.kind == "embedding",
        "model",
        f"model {model!r} is a chat model: it does not serve embeddings (a [[models]] entry "
        'with kind = "embedding" does)',
    )
    _check_inputs(inputs, limits, param)
    check(dimensions is None or dimensions >= 1, "dimensions", "dimensions must be at least 1")
    rid = f"embd-{uuid.uuid4().hex}"
    session = pipeline.open_session(rid, model)
    try:
        try:
            info = await pipeline.models.loaded(model, rid)
        except ModelUnavailable as exc:
            raise ApiError.from_failed(exc.failed) from None
        assert info.embedding is not None, "an embedding entry loaded without its traits"
        tokens = await trio.to_thread.run_sync(  # CPU work: off the trio thread
            _tokens, info, inputs, truncate, param, limiter=pipeline.count_limiter
        )
        size = _check_dimensions(dimensions, info.embedding, model)
        request = EmbedRequest(request_id=rid, model=model, inputs=tuple(tokens))
        await pipeline.engine.send(Embed(request=request))
        vectors = await _result(session)
    except ApiError as error:
        _observe(session, error)
        raise
    finally:
        await session.close()
    return EmbeddingResult(model, _cut(vectors, size, info.embedding), tuple(map(len, tokens)))


def _observe(session: Session, error: ApiError) -> None:
    """A refusal after the session opened is the session's outcome (its trace, not the
    error handler, counts it)."""
    if not error.in_session:
        failed = Failed(
            request_id=session.request_id,
            reason=error.reason,  # type: ignore[arg-type]
            message=str(error),
            param=error.param,
        )
        session.trace.observe([failed], trio.current_time())
        error.in_session = True


def _check_inputs(inputs: Sequence[EmbeddingInput], limits: EmbeddingLimits, param: str) -> None:
    check(len(inputs) > 0, param, f"{param} must hold at least one input")
    check(
        len(inputs) <= limits.max_inputs,
        param,
        f"at most {limits.max_inputs} inputs per request (embeddings.max_inputs); "
        f"got {len(inputs)}",
    )
    for i, item in enumerate(inputs):
        where = f"{param}[{i}]"
        check(len(item) > 0, where, f"{where} is empty: every input needs a token")
        if isinstance(item, str):
            try:
                utf8_text(item, where)
            except PromptError as exc:
                raise ApiError("invalid_request", str(exc), param=where) from None


def _tokens(
    info: ModelInfo, inputs: Sequence[EmbeddingInput], truncate: bool, param: str
) -> list[tuple[int, ...]]:
    """Texts tokenized as the model's tokenizer does (its special tokens included),
    token-id inputs as given; then checked (worker thread)."""
    out = []
    for i, item in enumerate(inputs):
        ids = tuple(info.tokenizer.encode(item)) if isinstance(item, str) else tuple(item)
        check(len(ids) > 0, f"{param}[{i}]", f"{param}[{i}] has no tokens")
        out.append(ids)
    assert info.embedding is not None
    return _check_tokens(out, info.vocab_size, info.embedding, truncate, param)


def _check_tokens(
    tokens: list[tuple[int, ...]], vocab: int, e: EmbeddingInfo, truncate: bool, param: str
) -> list[tuple[int, ...]]:
    """Token ids inside the vocabulary (MLX checks no bounds); lengths within the model's."""
    out = []
    for i, ids in enumerate(tokens):
        bad = [t for t in ids if not 0 <= t < vocab]
        check(not bad, f"{param}[{i}]", f"token ids must be in [0, {vocab}): {bad[:5]}")
        if len(ids) > e.max_tokens:
            check(
                truncate,
                f"{param}[{i}]",
                f"{param}[{i}] is {len(ids)} tokens; this model embeds at most {e.max_tokens} "
                "(embeddings.max_input_tokens, or the model's context)",
            )
            ids = ids[: e.max_tokens]
        out.append(ids)
    return out


def _check_dimensions(dimensions: int | None, e: EmbeddingInfo, model: str) -> int:
    if dimensions is None or dimensions == e.dimensions:
        return e.dimensions
    sizes = ", ".join(map(str, (*e.matryoshka, e.dimensions)))
    check(
        dimensions in e.matryoshka,
        "dimensions",
        f"model {model!r} makes {e.dimensions}-dimensional vectors"
        + (
            f" and may be cut to {sizes}; not {dimensions}"
            if e.matryoshka
            else f" and declares no smaller (Matryoshka) sizes: dimensions must be {e.dimensions}"
        ),
    )
    return dimensions


async def _result(session: Session) -> np.ndarray:
    async for batch in session.events():
        for event in batch:
            if isinstance(event, Embedded):
                session.mailbox.engine_done = True
                return event.vectors
            if isinstance(event, Failed):
                raise ApiError.from_failed(event)
    raise ApiError("internal_error", "the embedding request ended without a result")


def _cut(vectors: np.ndarray, size: int, e: EmbeddingInfo) -> np.ndarray:
    """The first ``size`` dimensions (a Matryoshka cut), renormalised where the model
    normalises."""
    if size == vectors.shape[1]:
        return vectors
    cut = vectors[:, :size]
    if e.normalize:
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut.astype(np.float32)


# ---- OpenAI's /v1/embeddings ------------------------------------------------------------

_INPUT_FORMS = (
    "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


def openai_inputs(value: str | list) -> list[EmbeddingInput]:
    """OpenAI's four input forms as a list of inputs (a 400 for anything else)."""
    if isinstance(value, str):
        return [value]
    check(len(value) > 0, "input", "input must not be an empty list")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(_is_id(v) for v in value):
        return [tuple(value)]
    check(
        all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value), "input", _INPUT_FORMS
    )
    return [tuple(v) for v in value]


def _is_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def openai_body(result: EmbeddingResult, encoding: str) -> wire.EmbeddingList:
    data = [
        wire.EmbeddingItem(index=i, embedding=_encode(vector, encoding))
        for i, vector in enumerate(result.vectors)
    ]
    usage = wire.EmbeddingUsage(
        prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens
    )
    return wire.EmbeddingList(data=data, model=result.model, usage=usage)


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def install(
    app: QuartTrio,
    pipeline: Pipeline,
    v: Validator,
    select: Select,
    on_error: OnError,
    limits: EmbeddingLimits,
) -> None:
    """Register ``/v1/embeddings``, its errors in OpenAI's format."""
    from mlxd.daemon.api.openai import ERRORS

    api = Blueprint("embeddings", __name__)

    @api.post("/v1/embeddings")
    async def embeddings() -> Response:
        w = v.decode(wire.embeddings_decoder, await request.get_data(cache=False))
        model, _ = select(w.model)
        check(
            w.encoding_format in ("float", "base64"),
            "encoding_format",
            "encoding_format must be 'float' or 'base64'",
        )
        inputs = openai_inputs(w.input)
        result = await embed(pipeline, model, inputs, limits=limits, dimensions=w.dimensions)
        return json_response(openai_body(result, w.encoding_format))

    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)
