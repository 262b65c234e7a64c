"""OpenAI Responses API over the scripted fake runner: items in and out, the event stream."""

from __future__ import annotations

import json

import pytest

from tests.test_http import client
from tests.test_openai_features import CALL, read_stream

RESP = "/v1/responses"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


async def post(c, body, status=200):
    r = await c.post(RESP, json=body)
    data = json.loads(await r.get_data())
    assert r.status_code == status, data
    return data


def events(raw: bytes) -> list[dict]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            event_line, data_line = frame.split("\n")
            data = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {data['type']}"
            out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


async def test_string_input():
    async with client() as (c, _, _):
        body = await post(c, {"input": "hello", "instructions": "be brief", "temperature": 0})
    assert body["object"] == "response" and body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"] == [
        {"type": "output_text", "text": "HELLO", "annotations": [], "logprobs": []}
    ]
    assert body["usage"]["output_tokens"] == 5


async def test_items_with_developer_role_and_function_results():
    items = [
        {"role": "developer", "content": "use tools"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "weather?"}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    async with client() as (c, _, _):
        body = await post(c, {"input": items, "tools": TOOLS})
    assert "SUNNY" in body["output"][0]["content"][0]["text"]


async def test_stream_event_sequence():
    async with client() as (c, _, _):
        evs = events(await read_stream(c, RESP, {"input": "hey"}))
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e["delta"] for e in evs[4:-4]) == "HEY"
    assert evs[-4]["text"] == "HEY"
    final = evs[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "HEY"
    assert final["usage"]["output_tokens"] == 3


async def test_function_call_streaming_and_not():
    body = {"input": "!" + CALL, "tools": TOOLS}
    async with client() as (c, _, _):
        full = await post(c, body)
        evs = events(await read_stream(c, RESP, body))
    (call,) = full["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    kinds = [e["type"] for e in evs]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    assert evs[-1]["response"]["output"][0]["name"] == "get_weather"


async def test_max_output_tokens_is_incomplete():
    async with client() as (c, _, _):
        body = await post(c, {"input": "abcdef", "max_output_tokens": 2})
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]"),
        ({"input": "x", "background": True}, "background"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "chat_template": "{{ x }}"}, "chat_template"),
        ({"input": "x", "include": ["file_search_call.results", "bogus"]}, "include[1]"),
        ({"input": "x", "truncation": "middle"}, "truncation"),
        ({"input": "x", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": "x", "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        (
            {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": "x", "top_logprobs": 99}, "top_logprobs"),
        (
            {
                "input": "x",
                "tools": [{"type": "custom", "name": "c", "format": {"type": "regexp"}}],
            },
            "tools[0].format",
        ),
        ({"input": [{"type": "mystery"}]}, "input[0]"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
async def test_errors(body, param):
    async with client() as (c, _, _):
        err = await post(c, body, 400)
    assert err["error"]["param"] == param


async def test_usage_reports_the_prompt_tokens_served_from_the_cache():
    async with client() as (c, _, runner):
        start = runner.start
        runner.start = lambda request: (start(request), 4)[1]  # 4 prompt tokens were cached
        body = await post(c, {"input": "hello"})
        evs = events(await read_stream(c, RESP, {"input": "hello"}))
        chat = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]}
        )
        chat_usage = json.loads(await chat.get_data())["usage"]
    for usage in (body["usage"], evs[-1]["response"]["usage"]):
        assert usage["input_tokens_details"] == {"cached_tokens": 4}
        assert usage["input_tokens"] == chat_usage["prompt_tokens"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert chat_usage["prompt_tokens_details"]["cached_tokens"] == 4
