"""HTTP surface over the fake runner: status codes, error bodies, SSE framing, disconnects."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
import trio.testing
from mlxd.daemon.app import create_app
from mlxd.daemon.pipeline import ServerState
from mlxd.daemon.settings import load_settings

from tests.conftest import (
    AbortSent,
    assert_idle,
    chat,
    metric,
    real_server,
    running_graph,
    settings_with,
    wait_until,
)

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
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "HELLO",
        "refusal": None,
        "annotations": [],
    }
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
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
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
        ({"max_tokens": -1}, "max_tokens"),  # above the cap is clamped (tests/test_max_tokens.py)
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
    async with client(settings_with(model={"accept_other_ids": False})) as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("x", model="gpt-9")), 404)
        ok = await c.post(CHAT, json=user("x", model="fake-model"))
    assert err["code"] == "model_not_found"
    assert ok.status_code == 200
    async with client(settings_with(model={"accept_other_ids": True})) as (c, _, _):
        assert (await c.post(CHAT, json=user("x", model="gpt-9"))).status_code == 200


@pytest.mark.parametrize("accept", ["auto", True])
async def test_clearing_the_cache_of_an_unknown_model_is_404_and_clears_nothing(accept):
    """An action on a model takes its exact id (as load and unload do): with one model
    served, ``model.accept_other_ids`` lets chat serve any id, but ``DELETE /v1/cache``
    of an alias would clear the real model's cache."""
    async with client(settings_with(model={"accept_other_ids": accept})) as (c, _, runner):
        err = await error_of(await c.delete("/v1/cache?model=nope"), 404)
        served = await c.post(CHAT, json=user("x", model="nope"))  # the alias still serves
        await trio.sleep(0.05)  # a ClearCache would have reached the engine by now
        refused_cleared = runner.cleared
        named = await c.delete("/v1/cache?model=fake-model")
        every = await c.delete("/v1/cache")
        with trio.fail_after(60):
            while runner.cleared < 2:
                await trio.sleep(0.01)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'nope'" in err["message"] and "'fake-model'" in err["message"]
    assert served.status_code == 200 and refused_cleared == 0
    assert named.status_code == 200 and every.status_code == 200


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
        sent = AbortSent(pipeline.engine, runner)
        pipeline.engine = sent  # counts the engine's steps when the Abort is sent
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            if stream:
                async with http.stream("POST", CHAT, json=user("z" * 3000, stream=True)) as r:
                    async for line in r.aiter_lines():
                        if '"content":"Z' in line:
                            break  # hang up after the first token
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(http.post, CHAT, json=user("z" * 3000)))
                    await wait_until(lambda: runner.running)  # decoding
                    nursery.cancel_scope.cancel()  # the client hangs up
        with trio.fail_after(60):
            while runner.running or runner.prefilling:
                await trio.sleep(0.005)
        assert len(runner.removed) == 1
        assert sent.steps_at_abort is not None
        assert runner.decode_steps - sent.steps_at_abort <= 1


# ---- limits --------------------------------------------------------------------------------


async def test_too_many_messages_is_400_naming_the_limit():
    settings = settings_with(tokenizer={"max_messages": 3})
    async with client(settings) as (c, _, _):
        many = {"messages": [{"role": "user", "content": "x"}] * 4}
        err = await error_of(await c.post(CHAT, json=many), 400)
        ok = await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}] * 3})
    assert err["param"] == "messages" and "tokenizer.max_messages" in err["message"]
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("settings", "extra", "setting"),
    [
        (
            {"engine": {"max_tokens_cap": 8, "max_tokens_overflow": "refuse"}},
            {"max_tokens": 9},
            "engine.max_tokens_cap",
        ),
        ({"engine": {"max_stop_strings": 1}}, {"stop": ["a", "b"]}, "engine.max_stop_strings"),
        ({"engine": {"max_stop_length": 2}}, {"stop": "abc"}, "engine.max_stop_length"),
    ],
)
async def test_limit_violations_name_the_setting(settings, extra, setting):
    async with client(settings_with(**settings)) as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("x", **extra)), 400)
    assert setting in err["message"]


async def test_prompt_token_limit_and_body_limit_name_the_setting():
    async with client(settings_with(engine={"max_prompt_tokens": 20})) as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("y" * 40)), 400)
    assert "engine.max_prompt_tokens" in err["message"]
    async with client(settings_with(server={"max_body_bytes": 100})) as (c, _, _):
        err = await error_of(await c.post(CHAT, json=user("y" * 200)), 413)
    assert "100 bytes (server.max_body_bytes)" in err["message"]


# ---- auth and CORS -------------------------------------------------------------------------


async def test_api_keys_bearer_and_x_api_key_health_stays_open(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops\nfile-key\n\n")
    settings = settings_with(auth={"api_keys": ["k1"], "api_key_file": str(keyfile)})
    async with client(settings) as (c, _, _):
        missing = await c.post(CHAT, json=user("x"))
        wrong = await c.post(CHAT, json=user("x"), headers={"Authorization": "Bearer nope"})
        bearer = await c.post(CHAT, json=user("x"), headers={"Authorization": "Bearer k1"})
        x_key = await c.post(CHAT, json=user("x"), headers={"x-api-key": "file-key"})
        health = await c.get("/health")
        closed = [
            (await c.get(path)).status_code for path in ("/metrics", "/v1/status", "/v1/models")
        ]
        opened = await c.get("/v1/status", headers={"x-api-key": "k1"})
    err = await error_of(missing, 401)
    assert err["code"] == "invalid_api_key"
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    await error_of(wrong, 401)
    assert bearer.status_code == 200 and x_key.status_code == 200
    assert health.status_code == 200
    assert closed == [401, 401, 401]
    assert opened.status_code == 200


async def test_an_unreadable_or_empty_key_file_is_a_startup_error(tmp_path):
    from mlxd.daemon.app import create_app

    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for path in (empty, tmp_path / "missing"):
        settings = settings_with(auth={"api_key_file": str(path)})
        async with running_graph(settings) as (pipeline, _):
            with pytest.raises(ValueError, match="auth.api_key_file"):
                create_app(pipeline, settings)


async def test_cors_is_off_by_default_and_on_for_listed_origins():
    origin = {"Origin": "http://app.example"}
    async with client() as (c, _, _):
        r = await c.post(CHAT, json=user("x"), headers=origin)
    assert "Access-Control-Allow-Origin" not in r.headers
    settings = settings_with(
        server={"cors_origins": ["http://app.example"]}, auth={"api_keys": ["k"]}
    )
    async with client(settings) as (c, _, _):
        preflight = await c.options(
            CHAT, headers={**origin, "Access-Control-Request-Method": "POST"}
        )
        r = await c.post(CHAT, json=user("x"), headers={**origin, "x-api-key": "k"})
        other = await c.post(
            CHAT, json=user("x"), headers={"Origin": "http://evil.example", "x-api-key": "k"}
        )
    assert preflight.status_code == 204  # no key needed for the preflight
    assert "x-api-key" in preflight.headers["Access-Control-Allow-Headers"]
    assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "Access-Control-Allow-Origin" not in other.headers


# ---- observability -------------------------------------------------------------------------


async def test_metrics_count_requests_tokens_and_latencies():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 0})
    async with client(settings) as (c, pipeline, runner):
        for _ in range(3):
            assert (await c.post(CHAT, json=user("hello"))).status_code == 200
        runner.step_delay = 0.01
        blocker = await pipeline.submit(chat("b", "q" * 200))
        assert (await c.post(CHAT, json=user("x"))).status_code == 429
        await blocker.close()
        await assert_idle(pipeline, runner)
        r = await c.get("/metrics")
        text = (await r.get_data()).decode()
    assert r.headers["content-type"].startswith("text/plain")
    assert metric(text, "mlxd_requests_total", 'finish_reason="stop",status="200"') == 3
    assert metric(text, "mlxd_requests_rejected_total", 'reason="queue_full"') == 1
    assert metric(text, "mlxd_requests_total", 'finish_reason="abort",status="499"') == 1
    assert metric(text, "mlxd_generation_tokens_total") >= 15
    # the blocker was never read: no first token or start seen for it
    for histogram in (
        "time_to_first_token",
        "e2e_request_latency",
        "inter_token_latency",
        "queue_time",
    ):
        assert metric(text, f"mlxd_{histogram}_seconds_count") == 3
    for gauge in ("mlxd_requests_running", "mlxd_requests_waiting", "mlxd_kv_reserved_bytes"):
        assert metric(text, gauge) == 0
    assert metric(text, "mlxd_engine_requests", 'state="decoding"') == 0
    assert metric(text, "mlxd_decode_steps_total") > 0
    assert metric(text, "mlxd_cache_hit_rate") == 0
    assert "mlxd_memory_active_bytes" in text and "mlxd_batch_size" in text


async def test_each_app_has_its_own_registry():
    async with client() as (c1, _, _), client() as (c2, _, _):
        await c1.post(CHAT, json=user("hello"))
        t1 = (await (await c1.get("/metrics")).get_data()).decode()
        t2 = (await (await c2.get("/metrics")).get_data()).decode()
    assert metric(t1, "mlxd_requests_total", 'finish_reason="stop",status="200"') == 1
    assert "mlxd_requests_total{" not in t2


async def test_status_lists_running_and_waiting_requests():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 2})
    async with client(settings) as (c, pipeline, runner):
        runner.step_delay = 0.01
        running = await pipeline.submit(chat("run", "r" * 300))
        events = running.events()
        await anext(events)  # Started
        await anext(events)  # some text
        queued = await pipeline.submit(chat("wait", "w"))
        await trio.testing.wait_all_tasks_blocked()  # admission has queued it
        body = json.loads(await (await c.get("/v1/status")).get_data())
        await events.aclose()
        await queued.close()
    reqs = body["requests"]
    assert [r["id"] for r in reqs["running"]] == ["run"]
    assert reqs["running"][0]["prompt_tokens"] > 300 and reqs["running"][0]["age_s"] > 0
    assert reqs["running"][0]["generated_tokens"] >= 1
    assert [(r["id"], r["state"]) for r in reqs["waiting"]] == [("wait", "queued")]
    assert body["admission"]["running"] == 1 and body["admission"]["waiting"] == 1
    assert body["engine"]["decoding"] == 1
    assert body["model"]["id"] == "fake-model"
    assert body["settings"]["admission"]["max_running"] == 1
    assert "api_keys" not in json.dumps(body["settings"])
    assert set(body["memory"]) >= {"active_bytes", "kv_reserved_bytes", "kv_budget_bytes"}
    assert body["cache"]["hit_rate"] == 0


async def test_one_log_line_per_request(caplog):
    caplog.set_level("INFO", logger="mlxd.requests")
    async with client() as (c, _, _):
        await c.post(CHAT, json=user("hello"))
        await c.post(CHAT, json=user("x", temperature=9))
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxd.requests"]
    assert len(lines) == 2
    done, refused = lines
    for field in (
        "id=chatcmpl-",
        "status=200",
        "prompt_tokens=",
        "cached_tokens=0",
        "generated_tokens=5",
        "ttft_ms=",
        "duration_ms=",
        "finish_reason=stop",
    ):
        assert field in done
    assert "status=400" in refused


async def test_deadline_mid_stream_ends_with_an_error_event():
    # 2 s: time for the stream's first tokens on a busy machine; 3000 steps take 30 s at least
    settings = settings_with(admission={"request_timeout_s": 2.0})
    async with real_server(settings) as (url, pipeline, runner):
        runner.step_delay = 0.01
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            streamed = await http.post(CHAT, json=user("z" * 3000, stream=True))
            blocking = await http.post(CHAT, json=user("z" * 3000))
    assert streamed.status_code == 200
    frames = sse_events(streamed.content)
    assert frames[-1] == "[DONE]"
    assert '"content":"Z' in frames[1]  # it was streaming when the deadline passed
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "request_timeout" and "request_timeout_s" in error["message"]
    assert blocking.status_code == 504
    assert blocking.json()["error"]["code"] == "request_timeout"


def test_priority_field_is_honoured_only_when_enabled():
    from mlxd.daemon.api.common import Validator
    from mlxd.protocol import openai as wire

    w = wire.chat_decoder.decode(b'{"messages": [], "priority": -5}')
    assert Validator(load_settings()).priority(w.priority) == 0
    assert Validator(settings_with(admission={"priority": True})).priority(w.priority) == -5


async def test_content_parts_are_typed_and_an_unknown_type_is_a_400_naming_it():
    def parts(*content):
        return {"messages": [{"role": "user", "content": list(content)}], "temperature": 0}

    text = [{"type": "text", "text": "he"}, {"type": "input_text", "text": "llo"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    async with client() as (c, _, _):
        ok = await c.post(CHAT, json=parts(*text))
        unknown = await error_of(await c.post(CHAT, json=parts({"type": "audio"})), 400)
        on_text_model = await error_of(await c.post(CHAT, json=parts(image)), 400)
        no_file_api = {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}
        responses = await error_of(await c.post("/v1/responses", json=no_file_api), 400)
    assert ok.status_code == 200
    assert unknown["param"] == "messages[0].content[0].type"
    assert "not supported by this text model" in on_text_model["message"]
    assert responses["param"] == "input[0].content[0]"
