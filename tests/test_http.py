"""HTTP surface over the fake runner: status codes, error bodies, SSE framing, disconnects."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from daemon.app import create_app
from daemon.pipeline import ServerState
from daemon.settings import load_settings
from tests.conftest import chat, real_server, running_graph, settings_with

CHAT = "/v1/chat/completions"


@asynccontextmanager
async def client(settings=None):
    settings = settings or load_settings()
    async with running_graph(settings) as (pipeline, runner):
        app = create_app(pipeline, settings)
        yield app.test_client(), pipeline, runner


def user(text, **extra):
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


async def error_of(response, status):
    assert response.status_code == status
    body = json.loads(await response.get_data())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_chat_non_streaming():
    async with client() as (c, _, _):
        r = await c.post(CHAT, json=user("hello"))
        body = json.loads(await r.get_data())
    assert r.status_code == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "HELLO"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


def sse_events(raw: bytes):
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [f.removeprefix("data: ") for f in frames]


async def test_chat_streaming_framing():
    async with client() as (c, _, _):
        r = await c.post(
            CHAT, json=user("hey", stream=True, stream_options={"include_usage": True})
        )
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = sse_events(await r.get_data())
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == "HEY"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completions_streaming_and_not():
    async with client() as (c, _, _):
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        body = json.loads(await r.get_data())
        s = await c.post("/v1/completions", json={"prompt": "abc", "stream": True})
        frames = sse_events(await s.get_data())
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "AB"
    assert body["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1])
    assert text == "ABC"


async def test_stop_as_string_and_list():
    async with client() as (c, _, _):
        a = json.loads(await (await c.post(CHAT, json=user("one two", stop="TWO"))).get_data())
        b = json.loads(
            await (await c.post(CHAT, json=user("one two", stop=["E T", "X"]))).get_data()
        )
    assert a["choices"][0]["message"]["content"] == "ONE "
    assert b["choices"][0]["message"]["content"] == "ON"


async def test_max_completion_tokens_and_unknown_fields():
    async with client() as (c, _, _):
        r = await c.post(CHAT, json=user("hello", max_completion_tokens=2, some_future_field=1))
        body = json.loads(await r.get_data())
    assert body["choices"][0]["message"]["content"] == "HE"


async def test_bad_json_is_400():
    async with client() as (c, _, _):
        r = await c.post(CHAT, data=b"{not json", headers={"content-type": "application/json"})
        err = await error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
        ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role"),
        ({}, None),
    ],
)
async def test_wrong_types_name_the_field(body, param):
    async with client() as (c, _, _):
        err = await error_of(await c.post(CHAT, json=body), 400)
    assert err["param"] == param
    if param is None:
        assert "messages" in err["message"]


F = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 100}, "n"),
        ({"n": 0}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**7}, "max_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (
            {"tools": F, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": F, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": F + F}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "wat"}},
                }
            },
            "response_format",
        ),
        (
            {"tools": F, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ],
)
async def test_refused_options_are_400_not_ignored(extra, param):
    async with client() as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("x", **extra)), 400)
    assert err["param"] == param


async def test_oversized_body_is_413():
    settings = settings_with(server={"max_body_bytes": 1000})
    async with client(settings) as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("x" * 5000)), 413)
    assert "max_body_bytes" in err["message"]


async def test_unknown_route_is_404_in_openai_format():
    async with client() as (c, _, _):
        await error_of(await c.get("/v1/nope"), 404)
        await error_of(await c.get(CHAT), 405)


async def test_unknown_model_is_404_unless_aliases_allowed():
    async with client() as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("x", model="gpt-9")), 404)
        ok = await c.post(CHAT, json=user("x", model="fake-model"))
    assert err["code"] == "model_not_found"
    assert ok.status_code == 200
    async with client(settings_with(model={"accept_other_ids": True})) as (c, _, _):
        assert (await c.post(CHAT, json=user("x", model="gpt-9"))).status_code == 200


async def test_models_and_health():
    async with client() as (c, pipeline, _):
        models = json.loads(await (await c.get("/v1/models")).get_data())
        assert [m["id"] for m in models["data"]] == ["fake-model"]
        assert (await c.get("/health")).status_code == 200
        pipeline.state = ServerState.DRAINING
        assert (await c.get("/health")).status_code == 503
        err = await error_of(await c.post(CHAT, json=user("x")), 503)
        assert "draining" in err["message"]
        pipeline.state = ServerState.LOADING
        assert (await c.get("/health")).status_code == 503


async def test_queue_full_is_429_with_retry_after():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 0})
    async with client(settings) as (c, pipeline, runner):
        runner.step_delay = 0.01
        blocker = await pipeline.submit(chat("b", "q" * 200))
        r = await c.post(CHAT, json=user("x"))
        await error_of(r, 429)
        assert r.headers["Retry-After"] == "1"
        await blocker.close()


async def test_prefill_error_is_500_for_that_request_only():
    async with client() as (c, _, _):
        bad = await c.post(CHAT, json=user("FAIL"))
        good = await c.post(CHAT, json=user("fine"))
        err = await error_of(bad, 500)
    assert "prefill" in err["message"]
    assert good.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_generation(stream):
    async with real_server() as (url, pipeline, runner):
        runner.step_delay = 0.01
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            if stream:
                async with http.stream("POST", CHAT, json=user("z" * 3000, stream=True)) as r:
                    async for line in r.aiter_lines():
                        if '"content":"Z' in line:
                            break  # hang up after the first token
            else:
                with trio.move_on_after(0.3):
                    await http.post(CHAT, json=user("z" * 3000))
        steps = runner.decode_steps
        with trio.fail_after(3):
            while runner.running or runner.prefilling:
                await trio.sleep(0.005)
        assert len(runner.removed) == 1
        assert runner.decode_steps - steps <= 3
