"""The HTTP surface (quart-trio): the app, health, operations routes, guards and errors.

``daemon/api/openai.py`` serves OpenAI chat/completions/models,
``daemon/api/anthropic.py`` Anthropic Messages and ``daemon/api/responses.py``
the OpenAI Responses API, over the shared plumbing in ``daemon/api/common.py``.
Errors before the first token get a real status code; errors after it end the
stream with an error event. Errors use the format of the API that was called.
Every route but ``/health`` needs an API key when keys are configured; CORS
headers are added only for configured origins. Before any of that, the Host
header must name this server (``server.allowed_hosts``, else 403), and a POST
body must be declared JSON (else 415; a ``text/plain`` body, which a browser
may send cross-origin without asking, is never parsed).
"""

from __future__ import annotations

import dataclasses

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from daemon.api import anthropic, openai, responses
from daemon.api.body import is_json_type
from daemon.api.common import ApiError, Validator, json_response
from daemon.pipeline import Pipeline, ServerState
from daemon.security import AllowedHosts, ApiKeys, Cors, well_formed_host
from daemon.settings import Settings
from daemon.telemetry import request_log, status_snapshot
from protocol.messages import ClearCache

__all__ = ["ApiError", "create_app"]


def create_app(pipeline: Pipeline, settings: Settings) -> QuartTrio:
    """Build the app; the pipeline supplies the actor graph, settings the limits."""
    app = QuartTrio("mlxd")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.server.max_body_bytes, RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60
    )
    validator = Validator(settings, lambda: pipeline.info.vocab_size if pipeline.info else None)

    def ready() -> str:
        if pipeline.state is not ServerState.READY or pipeline.info is None:
            raise ApiError(
                503, f"server is {pipeline.state.value}", kind="service_unavailable", retry_after=1
            )
        return pipeline.info.model_id

    openai.install(app, pipeline, validator, ready)
    anthropic.install(app, pipeline, validator, ready)
    responses.install(app, pipeline, validator, ready)

    @app.get("/health")
    async def health() -> Response:
        status = 200 if pipeline.state is ServerState.READY else 503
        return Response(
            msgspec.json.encode({"status": pipeline.state.value}),
            status=status,
            content_type="application/json",
        )

    _install_engine_routes(app, pipeline, ready)
    _install_observability(app, pipeline, settings)
    _install_guards(app, settings)
    _install_error_handlers(app, settings, pipeline)
    hosts = AllowedHosts(settings.server.allowed_hosts, settings.server.host)
    app.asgi_app = HostGuard(app.asgi_app, hosts, pipeline)  # type: ignore[method-assign]
    return app


class HostGuard:
    """ASGI middleware: the Host header must be well formed (else 400) and name this
    server (else 403), checked before Quart's router parses it (a malformed one makes
    the router raise outside any handler)."""

    def __init__(self, app, hosts: AllowedHosts, pipeline: Pipeline):
        self.app, self.hosts, self.telemetry = app, hosts, pipeline.telemetry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(_header(scope, b"host"))
            if error is not None:
                await self.refuse(scope, send, error)
                return
        await self.app(scope, receive, send)

    def refusal(self, host: str | None) -> ApiError | None:
        if host is None:
            return None  # HTTP/1.0 without Host: not a browser, nothing to rebind
        if not well_formed_host(host):
            return ApiError(400, f"malformed Host header {host[:100]!r}", code="bad_host")
        if not self.hosts.allows(host):
            return ApiError(
                403,
                f"host {host!r} is not served here (server.allowed_hosts)",
                code="host_not_allowed",
            )
        return None

    async def refuse(self, scope, send, error: ApiError) -> None:
        self.telemetry.http_error(error.status)
        request_log.info(
            "request id=- status=%d path=%s error=%r", error.status, scope["path"], str(error)
        )
        anthropic_route = scope["path"].startswith("/v1/messages")
        body = error.anthropic_body() if anthropic_route else error.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _install_engine_routes(app: QuartTrio, pipeline: Pipeline, ready) -> None:
    """Prefix-cache and speculative-decoding stats; clearing the prefix cache."""

    @app.get("/v1/cache")
    async def cache_stats() -> Response:
        ready()
        stats = pipeline.info.cache_stats
        body = {"enabled": stats is not None, **(dataclasses.asdict(stats) if stats else {})}
        return json_response(body)

    @app.delete("/v1/cache")
    async def cache_clear() -> Response:
        ready()
        await pipeline.engine.send(ClearCache())
        return json_response({"cleared": True})

    @app.get("/v1/speculative")
    async def speculative_stats() -> Response:
        ready()
        stats = pipeline.info.spec_stats
        body: dict = {"enabled": False}
        if stats is not None:
            body = dataclasses.asdict(stats)
            body["enabled"] = stats.enabled
            body["acceptance_rate"] = stats.acceptance_rate
        return json_response(body)


def _install_observability(app: QuartTrio, pipeline: Pipeline, settings: Settings) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(pipeline.telemetry.exposition(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def server_status() -> Response:
        return json_response(status_snapshot(pipeline, settings, trio.current_time()))


_OPEN_PATHS = frozenset({"/health"})


def _install_guards(app: QuartTrio, settings: Settings) -> None:
    """API keys on every route but /health; CORS preflight and headers for allowed
    origins; JSON bodies only."""
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
        content_type = request.headers.get("Content-Type")
        if request.method == "POST" and not is_json_type(content_type):
            raise ApiError(
                415,
                f"the body must be JSON (Content-Type: application/json), not {content_type!r}",
                code="unsupported_media_type",
            )
        return None

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if cors.allows(origin):
            response.headers.update(cors.headers(origin or ""))
        return response


def _anthropic_route() -> bool:
    return request.path.startswith("/v1/messages")


def _install_error_handlers(app: QuartTrio, settings: Settings, pipeline: Pipeline) -> None:
    telemetry = pipeline.telemetry

    def early(error: ApiError) -> Response:
        """An error before the request reached the pipeline: counted and logged here."""
        if not error.in_session:
            telemetry.http_error(error.status)
            request_log.info(
                "request id=- status=%d path=%s error=%r", error.status, request.path, str(error)
            )
        return error.response(anthropic=_anthropic_route())

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
