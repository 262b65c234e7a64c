"""The HTTP surface (quart-trio): the app, health, and error handlers; APIs in ``daemon/api``.

``daemon/api/openai.py`` serves OpenAI chat/completions/models,
``daemon/api/anthropic.py`` Anthropic Messages and ``daemon/api/responses.py``
the OpenAI Responses API, over the shared plumbing in ``daemon/api/common.py``.
Errors before the first token get a real status code; errors after it end the
stream with an error event. Errors use the format of the API that was called.
"""

from __future__ import annotations

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from daemon.api import anthropic, openai, responses
from daemon.api.common import ApiError, Validator
from daemon.pipeline import Pipeline, ServerState
from daemon.settings import Settings

__all__ = ["ApiError", "create_app"]


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

    _install_error_handlers(app)
    return app


def _anthropic_route() -> bool:
    return request.path.startswith("/v1/messages")


def _install_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return exc.response(anthropic=_anthropic_route())

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {413: "request body is larger than server.max_body_bytes"}.get(
            status, exc.description or exc.name
        )
        return ApiError(status, message).response(anthropic=_anthropic_route())
