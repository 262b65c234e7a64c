"""The HTTP surface (quart-trio): the app, health, operations routes, guards and errors.

``daemon/api/openai.py`` serves OpenAI chat/completions/models,
``daemon/api/embeddings.py`` OpenAI embeddings, ``daemon/api/anthropic.py`` Anthropic Messages and ``daemon/api/responses.py``
the OpenAI Responses API, ``daemon/api/ollama.py`` Ollama's ``/api/*``,
``daemon/api/infill.py`` llama.cpp's ``/infill``, ``/tokenize`` and ``/detokenize``,
``daemon/api/adapters.py`` vLLM's LoRA adapter load and unload, over the shared
plumbing in ``daemon/api/common.py``.
Errors before the first token get a real status code; errors after it end the
stream with an error event. Each API module answers the errors raised on its
routes in its own format; errors with no route (an unknown path or method) and
the operations routes use OpenAI's.
Every route but ``/health`` and the dashboard's page (``daemon/dashboard/``: ``/``
and its script and style; its data routes are guarded) needs an API key when keys
are configured; CORS headers are added only for configured origins. Before any of that, the Host
header must name this server (``server.allowed_hosts``, else 403), and a POST
body must be declared JSON (else 415; a ``text/plain`` body, which a browser
may send cross-origin without asking, is never parsed).
"""

from __future__ import annotations

import msgspec
import trio
from mlxd.daemon import dashboard
from mlxd.daemon.api import adapters, anthropic, embeddings, infill, ollama, openai, responses
from mlxd.daemon.api.body import is_json_type
from mlxd.daemon.api.common import Validator, json_response
from mlxd.daemon.api.errors import ApiError, install_errors
from mlxd.daemon.api.supersede import Superseder
from mlxd.daemon.connections import FinishResponses
from mlxd.daemon.pipeline import Pipeline, ServerState
from mlxd.daemon.security import AllowedHosts, ApiKeys, Cors, well_formed_host
from mlxd.daemon.settings import Settings
from mlxd.daemon.telemetry import API_ROUTE, request_log, status_snapshot
from mlxd.protocol.messages import ClearCache
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, g, request
from quart_trio import QuartTrio

__all__ = ["ApiError", "create_app"]


def create_app(pipeline: Pipeline, settings: Settings) -> QuartTrio:
    """Build the app; the pipeline supplies the actor graph, settings the limits."""
    app = QuartTrio(__name__)
    app.config.update(
        MAX_CONTENT_LENGTH=settings.server.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=settings.server.body_timeout_s,  # a stalled body a route reads: 408
    )
    validator = Validator(settings)

    def select(requested: str | None) -> tuple[str, Validator]:
        """The served model a request's ``model`` names (none: the default; a LoRA
        adapter's id stays the adapter's, which its responses echo), and the validator for
        it; unknown: a 404 in the calling API's format."""
        models = pipeline.models
        if pipeline.state is not ServerState.READY or models is None:
            raise ApiError("not_ready", f"server is {pipeline.state.value}", retry_after=1)
        model = models.find(requested)
        if model is None:
            served = ", ".join(repr(m) for m in [*models.entries, *models.adapters])
            raise ApiError(
                "model_not_found",
                f"model {requested!r} not found; this server serves {served}",
                param="model",
            )
        info = models.info(model)
        g.mlxd_model = model  # the served id, for the response's mlxd-model header
        return model, validator.for_model(info.vocab_size if info else None)

    def on_error(error: ApiError, path: str) -> None:
        """An error before the request reached the pipeline: counted and logged here."""
        pipeline.telemetry.http_error(error.status)
        request_log.info("request id=- status=%d path=%s error=%r", error.status, path, str(error))

    max_body = settings.server.max_body_bytes
    install_errors(app, openai.ERRORS, on_error, max_body)  # unrouted: OpenAI's format
    newest = Superseder() if settings.fim.supersede else None  # editors' FIM requests
    openai.install(app, pipeline, validator, select, on_error, newest)
    anthropic.install(app, pipeline, validator, select, on_error)
    responses.install(app, pipeline, validator, select, on_error, settings.responses)
    limits = embeddings.EmbeddingLimits.of(settings)
    embeddings.install(app, pipeline, validator, select, on_error, limits)
    ollama.install(app, pipeline, validator, select, on_error, limits, newest)
    infill.install(app, pipeline, validator, select, on_error, settings.fim, newest)  # llama.cpp's

    @app.get("/health")
    async def health() -> Response:
        # SIGTERM's notice (server.drain_notice_s): draining for routers, still admitting
        state = "draining" if app.config.get(DRAIN_NOTICE) else pipeline.state.value
        status = 200 if state == ServerState.READY.value else 503
        return Response(
            msgspec.json.encode({"status": state}),
            status=status,
            content_type="application/json",
        )

    _install_engine_routes(app, pipeline, select)
    adapters.install(app, pipeline, validator)  # vLLM's LoRA adapter routes
    _install_observability(app, pipeline, settings, select)
    open_paths = _OPEN_PATHS
    if settings.dashboard.enabled:  # the page at / (its data routes need the API key)
        dashboard.install(app, pipeline, settings)
        open_paths |= dashboard.PAGE_PATHS
    _install_guards(app, settings, open_paths)
    hosts = AllowedHosts(settings.server.allowed_hosts, settings.server.host)
    server = settings.server
    app.asgi_app = FinishResponses(  # type: ignore[method-assign]
        HostGuard(app.asgi_app, hosts),  # outermost: every response ends its connection's turn
        finish_s=server.send_timeout_s,
        body_s=server.body_timeout_s,
        max_body_bytes=server.max_body_bytes,
    )
    return app


_REFUSED = "mlxd.host_refused"  # the scope key HostGuard leaves its refusal under


class HostGuard:
    """ASGI middleware: the Host header must be well formed (else 400) and name this
    server (else 403). It is checked before Quart's router parses it (a malformed one
    makes the router raise outside any handler): a refused request reaches the app
    with a harmless Host and the refusal, which the first guard raises, so the error
    is answered in the format of the API whose route was asked for."""

    def __init__(self, app, hosts: AllowedHosts):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(_header(scope, b"host"))
            if error is not None:
                headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"]
                headers.append((b"host", b"localhost"))
                scope = {**scope, "headers": headers, _REFUSED: error}
        await self.app(scope, receive, send)

    def refusal(self, host: str | None) -> ApiError | None:
        if host is None:
            return None  # HTTP/1.0 without Host: not a browser, nothing to rebind
        if not well_formed_host(host):
            return ApiError("bad_host", f"malformed Host header {host[:100]!r}")
        if not self.hosts.allows(host):
            return ApiError(
                "host_not_allowed", f"host {host!r} is not served here (server.allowed_hosts)"
            )
        return None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _install_engine_routes(app: QuartTrio, pipeline: Pipeline, select) -> None:
    """Prefix-cache and speculative-decoding stats of one model (``?model=``; the
    default one unless named); clearing the prefix cache (of every loaded model unless
    one is named, by its exact id: an unknown one is a 404 whatever
    ``model.accept_other_ids`` says, as for the load and unload routes)."""

    @app.get("/v1/cache")
    async def cache_stats() -> Response:
        model, _ = select(request.args.get("model"))
        stats = pipeline.stats_of(model).counters.prefix_cache
        body = {"enabled": stats is not None, **(msgspec.structs.asdict(stats) if stats else {})}
        return json_response(body)

    @app.delete("/v1/cache")
    async def cache_clear() -> Response:
        named = request.args.get("model")
        model, _ = select(named)
        models = pipeline.models
        if named and models is not None and named not in models.entries:
            # an exact id, as for /v1/models/{id}/load and /unload: an alias
            # (model.accept_other_ids) would clear another model's cache
            served = ", ".join(repr(m) for m in models.entries)
            raise ApiError(
                "model_not_found",
                f"model {named!r} not found; this server serves {served}",
                param="model",
            )
        tier = request.args.get("tier", "")
        if tier not in ("", "ram", "disk"):
            raise ApiError("invalid_request", f"tier: 'ram' or 'disk', not {tier!r}", param="tier")
        await pipeline.engine.send(ClearCache(model=model if named else "", tier=tier))
        return json_response({"cleared": True, "tier": tier or "all"})

    @app.get("/v1/speculative")
    async def speculative_stats() -> Response:
        model, _ = select(request.args.get("model"))
        stats = pipeline.stats_of(model).counters.speculative
        body = msgspec.to_builtins(stats) if stats is not None else {"enabled": False}
        return json_response(body)


def _install_observability(app: QuartTrio, pipeline: Pipeline, settings: Settings, select) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(pipeline.telemetry.exposition(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info() -> Response:
        """What SGLang's router (``mlxd cluster``) reads when it registers this daemon: the
        model it lists in its own /v1/models (503 while the model loads)."""
        model, _ = select(None)
        limits = {"max_running_requests": settings.admission.max_running}
        return json_response({"served_model_name": model, **limits})

    @app.get("/v1/status")
    async def server_status() -> Response:
        live, now = pipeline.live(), trio.current_time()
        return json_response(status_snapshot(live, pipeline.telemetry, settings, now))


_OPEN_PATHS = frozenset({"/health"})
DRAIN_NOTICE = "MLXD_DRAIN_NOTICE"  # the app config flag the supervisor sets on SIGTERM
_KEYS = "MLXD_API_KEYS"  # the app config entry holding the accepted keys (SIGHUP renews it)


def reload_api_keys(app: QuartTrio, settings: Settings) -> str:
    """SIGHUP: read ``auth.api_key_file`` again and serve with the keys it holds now; a file
    that cannot be read (or holds no key) keeps the keys in use. What happened, to log."""
    if not settings.auth.api_key_file:
        return "no auth.api_key_file to re-read; nothing changed"
    try:
        app.config[_KEYS] = ApiKeys.from_settings(settings.auth)
    except ValueError as exc:
        return f"kept the API keys in use: {exc}"
    return f"re-read the API keys from {settings.auth.api_key_file}"


def _install_guards(app: QuartTrio, settings: Settings, open_paths: frozenset[str]) -> None:
    """API keys on every route but ``open_paths`` (/health, the dashboard's page); CORS
    preflight and headers for allowed origins; JSON bodies only."""
    app.config[_KEYS] = ApiKeys.from_settings(settings.auth)
    cors = Cors(settings.server.cors_origins)

    @app.before_request
    async def guard() -> Response | None:
        refused = request.scope.get(_REFUSED)
        if refused is not None:
            raise refused
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and cors.allows(origin):
            return Response(b"", status=204, headers=cors.preflight_headers(origin or ""))
        API_ROUTE.set(request.path)  # the handler's sessions record it (their task's context)
        keys: ApiKeys = app.config[_KEYS]
        if keys.enabled and request.path not in open_paths and not keys.allows(request.headers):
            raise ApiError(
                "invalid_api_key",
                "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        content_type = request.headers.get("Content-Type")
        if request.method == "POST" and not is_json_type(content_type):
            raise ApiError(
                "unsupported_media_type",
                f"the body must be JSON (Content-Type: application/json), not {content_type!r}",
            )
        return None

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if cors.allows(origin):
            response.headers.update(cors.headers(origin or ""))
        model = g.get("mlxd_model")
        if model is not None:  # the model that served it, whatever id the request named
            response.headers["mlxd-model"] = model
        return response
