"""The dashboard's routes: the page, the JSON it polls, and load / unload of a model.

``GET /`` and the page's script and style are open (they hold no data and never a
key); ``GET /v1/dashboard`` and ``POST /v1/models/{id}/load|unload`` are API routes,
behind the API keys like any other. The JSON is built from what ``/v1/status`` reads
(the pipeline's ``Live`` view) and the history rings (``daemon/history.py``); a poll
passes the sequence numbers it has seen (``since``, ``recent_since``) and gets only
what is newer, so polling costs a few hundred bytes a second.
"""

from __future__ import annotations

import time
import uuid
from importlib import resources

import msgspec
import trio
from mlxd.actors.tokenizer import ModelUnavailable
from mlxd.daemon.api.common import json_response
from mlxd.daemon.api.errors import ApiError
from mlxd.daemon.history import History, RequestRow, Sample, Window
from mlxd.daemon.pipeline import Pipeline, ServerState
from mlxd.daemon.settings import Settings
from mlxd.daemon.telemetry import status_snapshot
from mlxd.protocol import status as wire
from mlxd.protocol.messages import Abort, EngineStats, SpeculativeCounters, Unload
from quart import Response, request
from quart_trio import QuartTrio

_STATIC = {  # path → (file beside this module, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(_STATIC)  # open without a key: they hold no data

# The page loads nothing from anywhere else, runs no inline script, and talks only to
# this server (its API routes, with the key the user typed, from session storage).
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class ModelRow(msgspec.Struct, kw_only=True):
    """One served model as the dashboard shows it (``ServedModel`` plus its requests)."""

    id: str
    state: str  # unloaded, loading, loaded or failed
    error: str
    kind: str | None  # known once it has loaded
    context_length: int | None
    weights_bytes: int
    kv_reserved_bytes: int
    # memory.admission "use": rows preempted and resumed, their snapshots' bytes, time out
    preemptions: int = 0
    resumes: int = 0
    preempted_bytes: int = 0
    preempted_seconds: float = 0.0
    loads: int
    unloads: int
    last_load_s: float
    last_unload_reason: str
    waiting_for_load: int
    open_requests: int  # requests for it now (queued, waiting or running)
    finished_requests: int  # requests for it that ended since start
    parent: str = ""  # a LoRA adapter's base model ("" for a model)


class View(msgspec.Struct, kw_only=True):
    """``GET /v1/dashboard``: the server now, plus the history newer than the cursors."""

    state: str
    uptime_s: float
    now: float  # Unix seconds (samples and requests carry the same clock)
    sample_period_s: float
    history_s: float
    models: list[ModelRow]
    admission: wire.AdmissionStatus
    memory: wire.MemoryStatus
    cache: wire.CacheStatus
    speculative: list[SpeculativeCounters]
    requests: wire.RequestsStatus  # open ones
    last_minute: Window
    samples: list[Sample]
    next_sample: int  # pass as ``since`` to get only newer samples
    recent: list[RequestRow]  # finished requests, oldest first
    next_recent: int  # pass as ``recent_since``


def _static(name: str) -> bytes:
    return resources.files("mlxd.daemon.dashboard").joinpath(name).read_bytes()


def _cursor(name: str) -> int:
    """A non-negative integer query parameter (0 when absent); else a 400."""
    raw = request.args.get(name, "0")
    if not raw.isdigit() or len(raw) > 18:
        raise ApiError("invalid_request", f"{name}: not a non-negative integer", param=name)
    return int(raw)


def install(app: QuartTrio, pipeline: Pipeline, settings: Settings) -> None:
    """The page (read once, now: a wheel serves its own copy) and the dashboard's routes."""
    pages = {path: (_static(name), kind) for path, (name, kind) in _STATIC.items()}
    history = pipeline.history
    assert history is not None, "the dashboard needs the history (dashboard.enabled)"

    async def page() -> Response:
        body, kind = pages[request.path]
        return Response(body, content_type=kind, headers=_PAGE_HEADERS)

    for path in pages:
        app.add_url_rule(path, f"dashboard_{path}", page, methods=["GET"])

    @app.get("/v1/dashboard")
    async def dashboard() -> Response:
        since, recent_since = _cursor("since"), _cursor("recent_since")
        return json_response(view(pipeline, history, settings, since, recent_since))

    _install_model_routes(app, pipeline, settings)


def view(
    pipeline: Pipeline, history: History, settings: Settings, since: int, recent_since: int
) -> View:
    live, wall = pipeline.live(), time.time()
    status = status_snapshot(live, pipeline.telemetry, settings, trio.current_time())
    counts: dict[str, int] = {}
    for session in pipeline.sessions.values():
        counts[session.trace.model] = counts.get(session.trace.model, 0) + 1
    d = settings.dashboard
    return View(
        state=status.state,
        uptime_s=status.uptime_s,
        now=wall,
        sample_period_s=d.sample_period_s,
        history_s=d.history_s,
        models=_rows(status, counts, history),
        admission=status.admission,
        memory=status.memory,
        cache=status.cache,
        speculative=status.speculative,
        requests=status.requests,
        last_minute=history.window(wall),
        samples=history.samples_since(since),
        next_sample=history.next_sample,
        recent=history.requests_since(recent_since),
        next_recent=history.next_request,
    )


def _rows(status: wire.Status, counts: dict[str, int], history: History) -> list[ModelRow]:
    """Each served model, followed by the LoRA adapters served over it."""
    rows = []
    for m in status.models:
        rows.append(_model_row(m, counts, history))
        for a in status.adapters:
            if a.base == m.id:
                rows.append(_adapter_row(a, m, counts, history))
    return rows


def _adapter_row(
    a: wire.ServedAdapter, base: wire.ServedModel, counts: dict[str, int], history: History
) -> ModelRow:
    return ModelRow(
        id=a.id,
        parent=a.base,
        state=a.state,
        error=a.error,
        kind=base.model.kind if base.model else None,
        context_length=base.model.context_length if base.model else None,
        weights_bytes=a.bytes,
        kv_reserved_bytes=0,
        loads=0,
        unloads=0,
        last_load_s=0.0,
        last_unload_reason="",
        waiting_for_load=0,
        open_requests=counts.get(a.id, 0),
        finished_requests=history.done_by_model.get(a.id, 0),
    )


def _model_row(m: wire.ServedModel, counts: dict[str, int], history: History) -> ModelRow:
    return ModelRow(
        id=m.id,
        state=m.state,
        error=m.error,
        kind=m.model.kind if m.model else None,
        context_length=m.model.context_length if m.model else None,
        weights_bytes=m.weights_bytes,
        kv_reserved_bytes=m.engine.kv_reserved if m.engine else 0,
        **_preemption(m.engine),
        loads=m.loads,
        unloads=m.unloads,
        last_load_s=m.last_load_s,
        last_unload_reason=m.last_unload_reason,
        waiting_for_load=m.waiting_for_load,
        open_requests=counts.get(m.id, 0),
        finished_requests=history.done_by_model.get(m.id, 0),
    )


def _preemption(engine: EngineStats | None) -> dict[str, int | float]:
    if engine is None:
        return {}
    return {
        "preemptions": engine.preemptions,
        "resumes": engine.resumes,
        "preempted_bytes": engine.preempted_bytes,
        "preempted_seconds": engine.preempted_seconds,
    }


def _install_model_routes(app: QuartTrio, pipeline: Pipeline, settings: Settings) -> None:
    """``POST /v1/models/{id}/load`` and ``/unload``: the operator's load and unload of a
    served model (the pool still applies its limits: loading one may unload the least
    recently used idle one). Both answer with the model's row once done."""
    wait_s = settings.model_pool.load_timeout_s

    def entry(model_id: str):
        models = pipeline.models
        if pipeline.state is not ServerState.READY or models is None:
            raise ApiError("not_ready", f"server is {pipeline.state.value}", retry_after=1)
        if model_id not in models.entries:  # an exact id: an alias would act on another
            served = ", ".join(repr(m) for m in models.entries)
            raise ApiError(
                "model_not_found", f"model {model_id!r} not found; this server serves {served}"
            )
        return models, models.entries[model_id]

    def row(model_id: str) -> Response:
        history = pipeline.history
        assert history is not None
        served = next(m for m in pipeline.live().models if m.id == model_id)
        counts = {model_id: sum(s.trace.model == model_id for s in pipeline.sessions.values())}
        return json_response(_model_row(served, counts, history))

    @app.post("/v1/models/<path:model_id>/load")
    async def load(model_id: str) -> Response:
        models, e = entry(model_id)
        pin = f"dashboard-load-{uuid.uuid4().hex}"  # keeps it loaded until the Abort below
        try:
            if e.kind == "embedding":  # no prompt builder: it embeds and never chats
                await models.loaded(model_id, pin)
            else:
                await models.prepare(model_id, pin)
        except ModelUnavailable as exc:
            f = exc.failed
            raise ApiError(f.reason, f.message, retry_after=f.retry_after) from None
        finally:
            with trio.CancelScope(shield=True):
                await pipeline.engine.send(Abort(request_id=pin))
        return row(model_id)

    @app.post("/v1/models/<path:model_id>/unload")
    async def unload(model_id: str) -> Response:
        models, e = entry(model_id)
        if e.state == "loading":
            raise ApiError("invalid_request", f"model {model_id!r} is loading", status=409)
        serving = [models.base_of(s.trace.model) for s in pipeline.sessions.values()]
        busy = serving.count(model_id) + e.waiting  # its adapters' requests too
        if e.state == "loaded" and busy:
            raise ApiError(
                "invalid_request",
                f"model {model_id!r} has {busy} request(s) in flight; unload it once idle",
                status=409,
            )
        if e.state == "loaded":
            await pipeline.engine.send(Unload(model=model_id))
            with trio.move_on_after(wait_s):
                while e.state == "loaded":
                    await e.changed.wait()
            if e.state == "loaded":  # a request took it meanwhile: the engine kept it
                raise ApiError(
                    "invalid_request",
                    f"model {model_id!r} is busy; unload it once idle",
                    status=409,
                )
        return row(model_id)
