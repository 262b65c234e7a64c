"""Error reasons → HTTP status codes, and the error formats the APIs answer in.

A failure is a ``reason`` (``protocol.messages.Reason`` for a request's own
failures, plus the HTTP layer's: a bad Host, a missing key, an unknown route,
...). ``STATUS`` gives each reason its status code; each API module owns an
``ErrorFormat`` that names the reason in its own error type and writes its own
error body, and installs it for its routes (``install_errors``). Errors raised
before a route is matched (an unknown route or method) use the server's default
format, OpenAI's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, get_args

from mlxd.protocol.messages import Failed, Reason
from quart import Response, request
from werkzeug.exceptions import HTTPException

HttpReason = Literal[
    "bad_host",  # a malformed Host header
    "invalid_api_key",
    "host_not_allowed",  # a Host this server does not serve (server.allowed_hosts)
    "not_found",  # no such route
    "model_not_found",
    "method_not_allowed",
    "body_too_large",  # over server.max_body_bytes
    "body_timeout",  # the body did not arrive in time
    "unsupported_media_type",  # a POST body not declared JSON
    "not_ready",  # loading or draining
]
ErrorReason = Reason | HttpReason
REASONS: tuple[ErrorReason, ...] = (*get_args(Reason), *get_args(HttpReason))

STATUS: Mapping[ErrorReason, int] = {
    "invalid_request": 400,
    "too_deeply_nested": 400,
    "request_too_large": 400,
    "bad_host": 400,
    "invalid_api_key": 401,
    "host_not_allowed": 403,
    "not_found": 404,
    "model_not_found": 404,
    "method_not_allowed": 405,
    "body_timeout": 408,
    "client_not_reading": 408,
    "body_too_large": 413,
    "unsupported_media_type": 415,
    "queue_full": 429,
    "internal_error": 500,
    "not_ready": 503,
    "queue_timeout": 503,
    "model_loading": 503,
    "model_load_failed": 500,
    "out_of_memory": 503,
    "shutting_down": 503,
    "request_timeout": 504,
}
# Reasons whose status code says it all: no machine-readable ``code`` on the wire.
_GENERIC = ("invalid_request", "not_found", "method_not_allowed", "body_too_large")
_UNCODED = frozenset((*_GENERIC, "body_timeout", "not_ready"))
_BY_STATUS: Mapping[int, ErrorReason] = {
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    413: "body_too_large",
}


def code_of(reason: ErrorReason) -> str | None:
    """The reason as the wire's (and the metrics') ``code``; None for the generic ones."""
    return None if reason in _UNCODED else reason


class ApiError(Exception):
    """An error answered in the calling API's error format, with its reason's status."""

    def __init__(
        self,
        reason: ErrorReason,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ):
        super().__init__(message)
        self.reason, self.param, self.retry_after = reason, param, retry_after
        self.status = (
            status or STATUS[reason]
        )  # ``status``: an HTTP error with no reason of its own
        self.headers = headers or {}
        self.in_session = False  # counted and logged by its session, not the error handler

    @property
    def code(self) -> str | None:
        return code_of(self.reason)

    @classmethod
    def from_failed(cls, failed: Failed) -> ApiError:
        error = cls(
            failed.reason, failed.message, param=failed.param, retry_after=failed.retry_after
        )
        error.in_session = True
        return error

    @classmethod
    def from_http(cls, exc: HTTPException, max_body_bytes: int) -> ApiError:
        """Werkzeug's routing and body errors (404, 405, 413, ...)."""
        status = exc.code or 500
        reason = _BY_STATUS.get(status, "invalid_request" if status < 500 else "internal_error")
        if status == 413:
            message = f"request body is larger than {max_body_bytes} bytes (server.max_body_bytes)"
        elif status == 408:
            message = "the request body did not arrive in time (server.body_timeout_s)"
        else:
            message = exc.description or exc.name
        return cls(reason, message, status=status)


class ErrorFormat:
    """One API's error type per reason and its error body; ``body`` is the API's own."""

    def __init__(self, types: Mapping[ErrorReason, str], default: str):
        self.types, self.default = types, default

    def type_of(self, error: ApiError) -> str:
        return self.types.get(error.reason, self.default)

    def body(self, error: ApiError) -> bytes:
        raise NotImplementedError

    def response(self, error: ApiError) -> Response:
        headers = dict(error.headers)
        if error.retry_after:
            headers["Retry-After"] = str(int(error.retry_after))
        return Response(
            self.body(error), status=error.status, headers=headers, content_type="application/json"
        )


# Errors counted and logged where they are answered (a session counts its own).
OnError = Callable[[ApiError, str], None]


def install_errors(scaffold, fmt: ErrorFormat, on_error: OnError, max_body_bytes: int) -> None:
    """Answer ``ApiError`` and werkzeug's HTTP errors raised on ``scaffold`` (the app, or
    an API's blueprint) in ``fmt``."""

    def answer(error: ApiError) -> Response:
        if not error.in_session:
            on_error(error, request.path)
        return fmt.response(error)

    @scaffold.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return answer(exc)

    @scaffold.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return answer(ApiError.from_http(exc, max_body_bytes))
