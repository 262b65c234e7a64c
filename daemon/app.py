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
from daemon.security import AllowedHosts, ApiKeys, Cors
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
    return app


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
    """Host check; API keys on every route but /health; CORS preflight and headers for
    allowed origins; JSON bodies only."""
    keys = ApiKeys.from_settings(settings.auth)
    cors = Cors(settings.server.cors_origins)
    hosts = AllowedHosts(settings.server.allowed_hosts, settings.server.host)

    @app.before_request
    async def guard() -> Response | None:
        host = request.headers.get("Host")
        if not hosts.allows(host):
            raise ApiError(
                403,
                f"host {host!r} is not served here (server.allowed_hosts)",
                code="host_not_allowed",
            )
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
