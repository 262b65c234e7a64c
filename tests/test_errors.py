"""Error reasons: every one has a status code, an error type in every API, and a body."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from mlxd.daemon.api import anthropic, ollama, openai, responses
from mlxd.daemon.api.errors import REASONS, STATUS, ApiError, code_of
from mlxd.protocol.messages import Failed, Reason

FORMATS = {
    "openai": openai.ERRORS,
    "anthropic": anthropic.ERRORS,
    "responses": responses.ERRORS,
    "ollama": ollama.ERRORS,
}


def test_every_reason_has_a_status():
    assert set(STATUS) == set(REASONS)
    assert all(400 <= status < 600 for status in STATUS.values())


@pytest.mark.parametrize("reason", REASONS)
@pytest.mark.parametrize("api", FORMATS)
def test_every_reason_renders_in_every_api(api, reason):
    fmt = FORMATS[api]
    error = ApiError(reason, "why", param="max_tokens", retry_after=2)
    response = fmt.response(error)
    assert response.status_code == STATUS[reason]
    assert response.headers["Retry-After"] == "2"
    body = json.loads(fmt.body(error))
    code = code_of(reason)
    if api == "anthropic":  # the code where the SDK reads it (APIStatusError.error_code)
        assert body["type"] == "error"
        details = {"details": {"error_code": code}} if code else {}
        assert body["error"] == {
            "type": fmt.type_of(error),
            "message": "max_tokens: why",
            **details,
        }
    elif api == "ollama":  # Ollama's one field, and mlxd's code beside it
        assert body == {"error": "max_tokens: why", **({"code": code} if code else {})}
        return
    else:
        assert body["error"] == {
            "message": "why",
            "type": fmt.type_of(error),
            "param": "max_tokens",
            "code": code,
        }
    # The API's catch-all type only for the server's own failures and timeouts.
    if fmt.type_of(error) == fmt.default:
        assert STATUS[reason] >= 500 or STATUS[reason] == 408, reason


@pytest.mark.parametrize("reason", get_args(Reason))
def test_a_failed_request_keeps_its_reason(reason):
    error = ApiError.from_failed(Failed(request_id="r", reason=reason, message="m"))
    assert (error.reason, error.status, error.in_session) == (reason, STATUS[reason], True)


def test_generic_reasons_have_no_code():
    assert code_of("invalid_request") is None and code_of("not_found") is None
    assert code_of("queue_full") == "queue_full"


async def test_each_api_answers_its_own_routes_errors_and_unrouted_ones_are_openai():
    from tests.test_http import client

    async with client() as (c, _, _):
        unsupported = await c.post("/v1/messages", data=b"{}", headers={"Content-Type": "text/x"})
        anthropic_415 = json.loads(await unsupported.get_data())
        method = await c.get("/v1/messages")  # no route serves GET: the default format
        unrouted = json.loads(await method.get_data())
        missing = json.loads(await (await c.get("/v1/messages/nope")).get_data())
    assert unsupported.status_code == 415 and anthropic_415["type"] == "error"
    assert anthropic_415["error"]["type"] == "invalid_request_error"
    assert method.status_code == 405
    assert unrouted["error"]["type"] == "invalid_request_error"
    assert missing["error"]["type"] == "not_found_error" and missing["error"]["code"] is None
