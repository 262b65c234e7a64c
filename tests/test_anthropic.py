"""Anthropic Messages over the scripted fake runner: bodies, the exact event sequence, errors."""

from __future__ import annotations

import json

import pytest
import trio

from tests.conftest import real_server, settings_with
from tests.test_http import client
from tests.test_openai_features import CALL, read_stream

MSG = "/v1/messages"
HEADERS = {"x-api-key": "anything", "anthropic-version": "2023-06-01"}
TOOLS = [
    {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def ask(text, **extra):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 100, **extra}


async def post(c, body, status=200):
    r = await c.post(MSG, json=body, headers=HEADERS)
    data = json.loads(await r.get_data())
    assert r.status_code == status, data
    return data


def events(raw: bytes) -> list[dict]:
    """Each SSE frame's data, checking that its ``event:`` line names the data's type."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


async def stream(c, body):
    return events(await read_stream(c, MSG, body, HEADERS))


async def test_message_body():
    async with client() as (c, _, _):
        body = await post(
            c, ask("hello", system="be brief", temperature=0, top_k=5, metadata={"user_id": "u"})
        )
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "HELLO", "citations": None}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["output_tokens"] == 5


async def test_stream_event_sequence():
    async with client() as (c, _, _):
        evs = await stream(c, ask("hey"))
    kinds = [e["type"] for e in evs]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert evs[0]["message"]["content"] == [] and evs[0]["message"]["usage"]["input_tokens"] > 0
    assert evs[2]["content_block"] == {"type": "text", "text": "", "citations": None}
    assert "".join(e["delta"]["text"] for e in evs[3:-3]) == "HEY"
    assert evs[-2]["delta"] == {
        "container": None,
        "stop_details": None,
        "stop_reason": "end_turn",
        "stop_sequence": None,
    }
    assert evs[-2]["usage"]["output_tokens"] == 3


async def test_stop_sequence_and_max_tokens():
    async with client() as (c, _, _):
        stopped = await post(c, ask("one two", stop_sequences=["TWO"]))
        cut = await post(c, {**ask("abcdef"), "max_tokens": 2})
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "TWO"
    assert stopped["content"][0]["text"] == "ONE "
    assert cut["stop_reason"] == "max_tokens"


async def test_tool_use_streaming_and_not():
    body = ask("!Sure. " + CALL, tools=TOOLS)
    async with client() as (c, _, _):
        full = await post(c, body)
        evs = await stream(c, body)
    assert full["stop_reason"] == "tool_use"
    text, use = full["content"]
    assert text == {"type": "text", "text": "Sure. ", "citations": None}
    assert (
        use["type"] == "tool_use"
        and use["name"] == "get_weather"
        and use["input"] == {"city": "Paris"}
    )
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    partial = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1]
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


async def test_thinking_block_first():
    settings = settings_with(tokenizer={"reasoning_tags": "<think>,</think>"})
    body = ask(
        "!<think>hmm</think>Done.",
        thinking={"type": "enabled", "budget_tokens": 1024},
        max_tokens=2000,
    )
    async with client(settings) as (c, _, _):
        full = await post(c, body)
        evs = await stream(c, body)
    thinking, text = full["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "hmm"
    assert thinking["signature"]  # opaque, never empty
    assert text == {"type": "text", "text": "Done.", "citations": None}
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]


async def test_tool_result_history_and_count_tokens():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
        },
    ]
    async with client() as (c, _, _):
        body = await post(c, {"messages": messages, "max_tokens": 50, "tools": TOOLS})
        r = await c.post(
            MSG + "/count_tokens", json={"messages": messages, "tools": TOOLS}, headers=HEADERS
        )
        counted = json.loads(await r.get_data())
    assert "SUNNY" in body["content"][0]["text"]
    assert counted == {"input_tokens": body["usage"]["input_tokens"]}


# The answer's required-but-nullable fields (the Messages schema), as the official SDK
# declares them (anthropic/types/message.py, usage.py, raw_message_delta_event.py,
# message_delta_usage.py, tool_use_block.py).
MESSAGE_NULLS = {"stop_details": None, "container": None}
USAGE_EXTRA = {
    "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
    "service_tier": "standard",
    "server_tool_use": None,
    "inference_geo": None,
    "output_tokens_details": None,
}
DELTA_USAGE_EXTRA = {"server_tool_use": None, "output_tokens_details": None}


def present(obj: dict, expected: dict) -> dict:
    """``expected``'s keys as ``obj`` has them (a missing key shows as ``"<missing>"``)."""
    return {k: obj.get(k, "<missing>") for k in expected}


async def test_required_nullable_fields_are_sent_streaming_and_not():
    body = ask("!Sure. " + CALL, tools=TOOLS)
    async with client() as (c, _, _):
        full = await post(c, body)
        evs = await stream(c, body)
    start = evs[0]["message"]
    for message in (full, start):
        assert present(message, MESSAGE_NULLS) == MESSAGE_NULLS
        assert present(message["usage"], USAGE_EXTRA) == USAGE_EXTRA
    assert full["content"][-1]["type"] == "tool_use"
    assert full["content"][-1]["caller"] == {"type": "direct"}
    blocks = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["id"].startswith("toolu_")
    assert blocks[1] == {
        "type": "tool_use",
        "id": blocks[1]["id"],
        "name": "get_weather",
        "input": {},
        "caller": {"type": "direct"},
    }
    delta = evs[-2]
    assert delta["type"] == "message_delta"
    assert present(delta["delta"], MESSAGE_NULLS) == MESSAGE_NULLS
    assert present(delta["usage"], DELTA_USAGE_EXTRA) == DELTA_USAGE_EXTRA


async def test_the_official_sdk_types_validate_every_answer():
    """Pydantic validation with the SDK's own models (stricter than the SDK's parsing,
    which constructs without validating): each body and each stream event."""
    sdk = pytest.importorskip("anthropic")
    from pydantic import TypeAdapter

    settings = settings_with(tokenizer={"reasoning_tags": "<think>,</think>"})
    bodies = [
        ask("!Sure. " + CALL, tools=TOOLS),
        ask("one two", stop_sequences=["TWO"]),
        ask("!<think>hmm</think>Done.", thinking={"type": "enabled", "budget_tokens": 1024})
        | {"max_tokens": 2000},
    ]
    events = TypeAdapter(sdk.types.RawMessageStreamEvent)
    async with client(settings) as (c, _, _):
        for body in bodies:
            full = sdk.types.Message.model_validate(await post(c, body))
            assert full.stop_details is None and full.container is None
            assert full.usage.service_tier == "standard"
            assert full.usage.cache_creation.ephemeral_1h_input_tokens == 0
            assert all(b.caller.type == "direct" for b in full.content if b.type == "tool_use")
            for e in await stream(c, body):
                if e["type"] != "ping":  # the SDK skips pings before parsing
                    events.validate_python(e)


async def test_the_official_sdk_round_trips_a_tool_call_streaming_and_not():
    sdk = pytest.importorskip("anthropic")
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["input_schema"]}]

    def run(url: str) -> tuple:
        api = sdk.Anthropic(base_url=url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "!Sure. " + CALL}]
        first = api.messages.create(model="m", max_tokens=100, messages=messages, tools=tools)
        use = next(b for b in first.content if b.type == "tool_use")
        messages += [
            {"role": "assistant", "content": first.content},  # sent back as the SDK dumps it
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}],
            },
        ]
        with api.messages.stream(
            model="m", max_tokens=100, messages=messages[:1], tools=tools
        ) as s:
            final = s.get_final_message()
        again = api.messages.create(model="m", max_tokens=100, messages=messages)
        return first, use, final, again

    async with real_server() as (url, _, _):
        first, use, final, again = await trio.to_thread.run_sync(run, url)
    assert first.stop_reason == "tool_use" and use.input == {"city": "Paris"}
    assert use.caller is not None and use.caller.type == "direct"
    assert first.usage.cache_creation is not None and first.usage.service_tier == "standard"
    assert final.stop_reason == "tool_use" and final.stop_details is None
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert streamed.input == {"city": "Paris"} and streamed.caller.type == "direct"
    assert final.usage.output_tokens == first.usage.output_tokens
    assert again.stop_reason == "end_turn" and "OK" in again.content[0].text


async def test_the_official_sdk_reads_the_error_code():
    """A reason with a code carries it as ``error.details.error_code``: the SDK's
    ``error_code``, the same string as OpenAI's ``error.code``."""
    sdk = pytest.importorskip("anthropic")

    def run(url: str):
        api = sdk.Anthropic(base_url=url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "x"}]
        with pytest.raises(sdk.NotFoundError) as exc:
            api.messages.create(model="nope", max_tokens=10, messages=messages)
        return exc.value

    async with real_server(settings_with(model={"accept_other_ids": False})) as (url, _, _):
        error = await trio.to_thread.run_sync(run, url)
    assert (error.type, error.error_code) == ("not_found_error", "model_not_found")


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),  # no max_tokens
        (ask([{"type": "video", "url": "x"}]), 400, "invalid_request_error"),
        (
            ask([{"type": "image", "source": {"type": "base64", "data": ""}}]),
            400,
            "invalid_request_error",
        ),
        (ask("x", temperature=9), 400, "invalid_request_error"),
        (
            ask("x", tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}),
            400,
            "invalid_request_error",
        ),
        (ask("x", thinking={"type": "enabled", "budget_tokens": 10}), 400, "invalid_request_error"),
    ],
)
async def test_errors_in_anthropic_format(body, status, kind):
    async with client() as (c, _, _):
        err = await post(c, body, status)
    assert err["type"] == "error"
    assert err["error"]["type"] == kind
    assert set(err["error"]) == {"type", "message"}


async def test_unknown_model_is_not_found_when_other_ids_are_refused():
    async with client(settings_with(model={"accept_other_ids": False})) as (c, _, _):
        err = await post(c, ask("x", model="claude-9"), 404)
    assert err["error"]["type"] == "not_found_error"


async def test_oversized_body_is_request_too_large():
    async with client(settings_with(server={"max_body_bytes": 1000})) as (c, _, _):
        err = await post(c, ask("x" * 5000), 413)
    assert err["error"]["type"] == "request_too_large"
