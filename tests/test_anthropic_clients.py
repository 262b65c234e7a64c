"""What real Anthropic clients send (Claude Code 2.1's first requests, shape for shape) and
what they read back: every field honoured or refused, the billing header dropped, system
turns placed, cache breakpoints, context edits, usage with cache reads, the answer's shape.

Unit tests build the ``ChatRequest`` with ``chat_request``; HTTP tests run the app over
the scripted fake runner (its template renders ``<role>content`` and template variables
as ``<name=value>``, one token per character).
"""

from __future__ import annotations

import copy
import json
import logging
from contextlib import asynccontextmanager

import pytest
from mlxd.daemon.api.anthropic import (
    CLEARED_RESULT,
    chat_request,
    clear_tool_results,
    conversation,
    edit_context,
)
from mlxd.daemon.api.common import Validator
from mlxd.daemon.api.errors import ApiError
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.protocol import anthropic as wire
from mlxd.protocol.messages import ChatRequest, Message, ToolCall

from tests.conftest import running_graph, settings_with
from tests.fakes import FakeRunner
from tests.test_anthropic import HEADERS, MSG, TOOLS, ask, post, stream
from tests.test_openai_features import CALL

COUNT = MSG + "/count_tokens"
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=sdk-cli;"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}


def claude_code_body(**changes) -> dict:
    """A first Claude Code request, shortened: the same fields and shapes as captured."""
    body = {
        "model": "claude-opus-5-5",
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAttribution.\n</system-reminder>\n",
                    },
                    {"type": "text", "text": "Say hello"},
                ],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": "# Environment\n - Platform: linux",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "system": [
            {"type": "text", "text": BILLING},
            {
                "type": "text",
                "text": "You are a Claude agent.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "\nHarness rules.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA},
            {
                "name": "DeferredToolPlaceholder",
                "description": "never call this tool.",
                "input_schema": {"type": "object", "properties": {}},
                "defer_loading": True,
            },
        ],
        "metadata": {"user_id": json.dumps({"device_id": "d8", "session_id": "af6d"})},
        "max_tokens": 128000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": True,
    }
    body.update(changes)
    return body


def build(body: dict) -> ChatRequest:
    w = wire.messages_decoder.decode(json.dumps({"max_tokens": 100, **body}))
    return chat_request(w, "r", Validator(load_settings()))


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        build(body)
    assert info.value.status == 400
    return info.value


async def count(c, body) -> dict:
    body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
    r = await c.post(COUNT, json=body, headers=HEADERS)
    data = json.loads(await r.get_data())
    assert r.status_code == 200, data
    return data


@asynccontextmanager
async def client(settings=None, runner=None):
    settings = settings or load_settings()
    async with running_graph(settings, runner=runner) as (pipeline, runner):
        yield create_app(pipeline, settings).test_client(), runner


# ---- every field Claude Code sends ---------------------------------------------------------


async def test_claude_code_request_accepted_streaming_and_not():
    """Everything but the 128k max_tokens (see the clamp test below) as Claude Code sends it."""
    body = claude_code_body(max_tokens=1000)
    async with client() as (c, _):
        evs = await stream(c, body)
        full = await post(c, {**body, "stream": False})
        counted = await count(c, body)
    assert evs[0]["message"]["model"] == "claude-opus-5-5" and full["model"] == "claude-opus-5-5"
    assert full["stop_reason"] == "end_turn" and evs[-2]["delta"]["stop_reason"] == "end_turn"
    assert full["usage"]["input_tokens"] == counted["input_tokens"]
    assert counted["context_management"] == {"original_input_tokens": counted["input_tokens"]}
    assert full["context_management"] == {"applied_edits": []}
    assert evs[-2]["context_management"] == {"applied_edits": []}


async def test_claude_code_max_tokens_is_clamped():
    """128000 is more than fits: shrunk to what fits, not refused (engine.max_tokens_cap and
    the context window); needs the shared clamp in Validator.sampling and the tokenizer."""
    async with client() as (c, _):
        full = await post(c, claude_code_body(stream=False))
        evs = await stream(c, claude_code_body())
    assert full["stop_reason"] == "end_turn"
    assert evs[-1]["type"] == "message_stop"


def test_claude_code_request_as_chat_request():
    req = build(claude_code_body())
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "user"]
    assert req.messages[0].content == "You are a Claude agent.\n\nHarness rules."
    assert req.messages[2].content == (
        "<system-reminder>\n# Environment\n - Platform: linux\n</system-reminder>"
    )
    assert [t.name for t in req.tools] == ["Bash"]  # the deferred tool stays out of the prompt
    assert req.template_kwargs == {"enable_thinking": True}
    assert req.cache_breakpoints == (0, 2)


# ---- the billing header -----------------------------------------------------------------------


def test_billing_header_never_reaches_the_prompt():
    req = build(claude_code_body())
    assert all(BILLING not in str(m.content) for m in req.messages)
    alone = build({"messages": [{"role": "user", "content": "hi"}], "system": BILLING})
    assert [m.role for m in alone.messages] == ["user"]
    first_line = build({"messages": [{"role": "user", "content": "hi"}], "system": BILLING + "\nS"})
    assert first_line.messages[0].content == "S"
    unrelated = build({"messages": [{"role": "user", "content": "hi"}], "system": "x-billing"})
    assert unrelated.messages[0].content == "x-billing"


async def test_billing_header_changes_no_prompt_token():
    """Two requests that differ only in the billing block render the same prompt."""
    one = claude_code_body(max_tokens=1000, stream=False)
    two = copy.deepcopy(one)
    two["system"][0]["text"] = "x-anthropic-billing-header: cc_version=9.9.999.fff; cch=1;"
    without = copy.deepcopy(one)
    del without["system"][0]
    async with client() as (c, _):
        counts = [(await count(c, b))["input_tokens"] for b in (one, two, without)]
        served = [(await post(c, b))["usage"]["input_tokens"] for b in (one, two)]
    assert counts[0] == counts[1] == counts[2] == served[0] == served[1]


# ---- system turns inside messages ---------------------------------------------------------------


def test_leading_system_turns_join_the_system_prompt():
    req = build(
        {
            "system": "S",
            "messages": [
                {"role": "system", "content": "more rules"},
                {"role": "system", "content": [{"type": "text", "text": "and these"}]},
                {"role": "user", "content": "hi"},
            ],
        }
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "S"),
        ("system", "more rules"),
        ("system", "and these"),
        ("user", "hi"),
    ]


def test_mid_conversation_system_turn_follows_the_tool_results():
    """After a tool call, the reminder waits until the call's result has its turn."""
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "rain"}
    req = build(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [call]},
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [result, {"type": "text", "text": "and?"}]},
            ],
            "tools": TOOLS,
        }
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "tool", "user", "user"]
    assert req.messages[3].content == "<system-reminder>\nBe brief.\n</system-reminder>"


def test_system_turn_holds_text_only():
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    err = refused(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [image]}]}
    )
    assert err.param == "messages[1]"


async def test_system_turns_render_through_the_template():
    body = claude_code_body(max_tokens=1000, stream=False)
    async with client() as (c, _):
        counted = await count(c, body)
        answer = await post(c, body)
    # the fake model answers the last user turn upper-cased: the reminder is in it, in place
    assert "<SYSTEM-REMINDER>\n# ENVIRONMENT" in answer["content"][-1]["text"]
    assert "SAY HELLO\n\n<SYSTEM-REMINDER>" in answer["content"][-1]["text"]
    assert counted["input_tokens"] == answer["usage"]["input_tokens"]


# ---- thinking and effort ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("thinking", "effort", "kwargs"),
    [
        (None, None, {}),
        ({"type": "adaptive"}, None, {"enable_thinking": True}),
        ({"type": "adaptive", "display": "omitted"}, "medium", {"enable_thinking": True}),
        ({"type": "adaptive"}, "low", {"enable_thinking": False}),
        ({"type": "adaptive"}, "max", {"enable_thinking": True}),
        (None, "low", {"enable_thinking": False}),
        (None, "xhigh", {"enable_thinking": True}),
        ({"type": "enabled", "budget_tokens": 1024}, "low", {"enable_thinking": True}),
        ({"type": "disabled"}, "high", {"enable_thinking": False}),
    ],
)
def test_thinking_and_effort_set_enable_thinking(thinking, effort, kwargs):
    body: dict = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
    if thinking:
        body["thinking"] = thinking
    if effort:
        body["output_config"] = {"effort": effort}
    assert build(body).template_kwargs == kwargs


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ],
)
async def test_unknown_effort_and_thinking_values_are_400(extra, param):
    async with client() as (c, _):
        err = await post(c, ask("x", **extra), 400)
    assert err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]


def test_budget_tokens_is_checked_against_the_requested_max_tokens():
    thinking = {"type": "enabled", "budget_tokens": 5000}
    err = refused({**ask("x"), "thinking": thinking, "max_tokens": 4000})
    assert err.param == "thinking.budget_tokens"


async def test_budget_tokens_below_a_clamped_max_tokens_is_accepted():
    """budget < the requested max_tokens passes even though max_tokens is then clamped."""
    thinking = {"type": "enabled", "budget_tokens": 8000}
    async with client() as (c, _):
        full = await post(c, {**ask("x"), "thinking": thinking, "max_tokens": 128000})
    assert full["stop_reason"] == "end_turn"


async def test_display_omitted_returns_empty_signed_thinking():
    settings = settings_with(tokenizer={"reasoning_tags": "<think>,</think>"})
    shown = ask("!<think>hmm</think>Done.", thinking={"type": "adaptive"})
    omitted = ask("!<think>hmm</think>Done.", thinking={"type": "adaptive", "display": "omitted"})
    async with client(settings) as (c, _):
        full, hidden = await post(c, shown), await post(c, omitted)
        evs_shown, evs_hidden = await stream(c, shown), await stream(c, omitted)
    assert full["content"][0]["thinking"] == "hmm"
    assert hidden["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": full["content"][0]["signature"],
    }
    assert hidden["content"][1]["text"] == "Done."
    for evs, deltas in (
        (evs_shown, ["thinking_delta", "signature_delta"]),
        (evs_hidden, ["signature_delta"]),
    ):
        block0 = [
            e["delta"]["type"]
            for e in evs
            if e["type"] == "content_block_delta" and e["index"] == 0
        ]
        assert set(block0) == set(deltas) and block0[-1] == "signature_delta"
        sig = [
            e["delta"]["signature"]
            for e in evs
            if e.get("delta", {}).get("type") == "signature_delta"
        ]
        assert sig == [full["content"][0]["signature"]]


# ---- cache_control → cache breakpoints ----------------------------------------------------------


def test_cache_control_marks_the_message_that_holds_it():
    mark = {"type": "ephemeral"}
    call = {
        "type": "tool_use",
        "id": "t1",
        "name": "get_weather",
        "input": {},
        "cache_control": mark,
    }
    inner = {"type": "text", "text": "rain", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {
        "system": "S",
        "tools": [{**TOOLS[0], "cache_control": mark}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}]},  # 1: unmarked
            {"role": "assistant", "content": [call]},  # 2
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [inner]}],
            },  # 3
            {"role": "assistant", "content": "ok"},  # 4
            {
                "role": "user",
                "content": [{"type": "text", "text": "b", "cache_control": mark}],
            },  # 5
        ],
    }
    assert build(body).cache_breakpoints == (0, 2, 3, 5)
    no_tools_mark = {**body, "tools": TOOLS}
    assert build(no_tools_mark).cache_breakpoints == (2, 3, 5)
    system_marked = {
        **body,
        "system": [{"type": "text", "text": "S", "cache_control": mark}],
        "tools": TOOLS,
    }
    assert build(system_marked).cache_breakpoints == (0, 2, 3, 5)
    assert (
        build(
            {"messages": [{"role": "user", "content": "x"}], "tools": body["tools"]}
        ).cache_breakpoints
        == ()
    )


def test_bad_cache_control_is_400():
    block = {"type": "text", "text": "a", "cache_control": {"type": "forever"}}
    with pytest.raises(Exception, match="cache_control"):
        wire.messages_decoder.decode(json.dumps(ask([block])))


# ---- tools -------------------------------------------------------------------------------------


def test_tool_definitions_with_extra_fields():
    tool = {
        **TOOLS[0],
        "type": "custom",
        "cache_control": {"type": "ephemeral"},
        "input_examples": [{"city": "Paris"}],
        "eager_input_streaming": True,
        "strict": True,
        "description": "Weather.",
    }
    tool["input_schema"] = {**tool["input_schema"], "additionalProperties": False}
    (t,) = build({**ask("x"), "tools": [tool]}).tools
    assert t.description == 'Weather.\n\nInput examples:\n{"city": "Paris"}'


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]}, "tools[0]"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
        (
            {"context_management": {"edits": [{"type": "compact_20260112"}]}},
            "context_management.edits[0]",
        ),
        (
            {"context_management": {"edits": [{"type": "clear_everything"}]}},
            "context_management.edits[0]",
        ),
        (
            {
                "context_management": {
                    "edits": [
                        {
                            "type": "clear_tool_uses_20250919",
                            "keep": {"type": "input_tokens", "value": 3},
                        }
                    ]
                }
            },
            "context_management.edits[0].keep",
        ),
    ],
)
async def test_fields_mlxd_cannot_honour_are_400(extra, param):
    async with client() as (c, _):
        err = await post(c, ask("x", **extra), 400)
        r = await c.post(COUNT, json={"messages": ask("x")["messages"], **extra}, headers=HEADERS)
        counted = json.loads(await r.get_data())
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param)
    assert r.status_code == 400 and counted["error"]["message"].startswith(param)


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = build(
        {**ask("x"), "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert req.constraint is not None and req.constraint.kind == "json_schema"
    assert req.constraint.schema == schema and req.constraint.param == "output_config.format"
    older = build({**ask("x"), "output_format": {"type": "json_schema", "schema": schema}})
    assert older.constraint is not None and older.constraint.param == "output_format"


def test_history_thinking_and_redacted_thinking_are_accepted():
    turns = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "EqQBCkYIBxgCKkC"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3"},
                {"type": "text", "text": "hello", "citations": None},
            ],
        },
        {"role": "user", "content": "again"},
    ]
    req = build({"messages": turns})
    # thinking goes back as the turn's reasoning (templates that render it do); redacted
    # thinking has no text to give
    assert req.messages[1] == Message(role="assistant", content="hello", reasoning="hmm")


# ---- context_management: clear_tool_uses -------------------------------------------------------


def _history(n: int, names=("get_weather",)) -> tuple[Message, ...]:
    out: list[Message] = [Message(role="user", content="go")]
    for i in range(n):
        name = names[i % len(names)]
        out.append(
            Message(
                role="assistant",
                content="",
                tool_calls=(ToolCall(id=f"c{i}", name=name, arguments='{"a": 1}'),),
            )
        )
        out.append(Message(role="tool", tool_call_id=f"c{i}", content=f"result {i} " + "x" * 50))
    return tuple(out)


def test_clear_tool_results_keeps_the_latest_and_the_excluded():
    messages = _history(5, names=("get_weather", "read"))
    edit = wire.ClearToolUses(
        keep=wire.TokenCount(type="tool_uses", value=2),
        exclude_tools=["read"],
        clear_tool_inputs=["get_weather"],
    )
    out, n = clear_tool_results(messages, edit)
    results = [m.content for m in out if m.role == "tool"]
    # c0 get_weather, c1 read (excluded), c2 get_weather cleared; c3, c4 kept
    kept = [f"result {i} " + "x" * 50 for i in range(5)]
    assert results == [CLEARED_RESULT, kept[1], CLEARED_RESULT, kept[3], kept[4]]
    assert n == 2
    args = [m.tool_calls[0].arguments for m in out if m.tool_calls]
    assert args == ["{}", '{"a": 1}', "{}", '{"a": 1}', '{"a": 1}']
    default, n_default = clear_tool_results(messages, wire.ClearToolUses())
    assert (
        n_default == 2
        and [m.tool_calls[0].arguments for m in default if m.tool_calls][0] == '{"a": 1}'
    )


async def test_edit_context_trigger_and_clear_at_least():
    req = ChatRequest(request_id="r", messages=_history(4), sampling=build(ask("x")).sampling)

    async def chars(r: ChatRequest) -> int:
        return sum(
            len(str(m.content)) + sum(len(c.arguments) for c in m.tool_calls) for m in r.messages
        )

    edit = wire.ClearToolUses(keep=wire.TokenCount(type="tool_uses", value=1))
    low, applied, original = await edit_context(req, [edit], chars)
    assert applied == [] and low is req and original == await chars(req)  # under 100k tokens
    trigger = wire.TokenCount(type="tool_uses", value=3)
    cut, applied, _ = await edit_context(
        req, [wire.ClearToolUses(trigger=trigger, keep=edit.keep)], chars
    )
    saved = 3 * (len("result 0 " + "x" * 50) - len(CLEARED_RESULT))
    assert applied == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3, "cleared_input_tokens": saved}
    ]
    assert [m.content for m in cut.messages if m.role == "tool"][-1].startswith("result 3")
    least = wire.TokenCount(type="input_tokens", value=saved + 1)
    strict = wire.ClearToolUses(trigger=trigger, keep=edit.keep, clear_at_least=least)
    same, applied, _ = await edit_context(req, [strict], chars)
    assert same is req and applied == []


async def test_clear_tool_uses_over_http():
    history = [{"role": "user", "content": "weather?"}]
    for i in range(3):
        use = {"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": "Paris"}}
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": "sunny " * 50}
        history += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    history.append({"role": "user", "content": "thanks"})
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 100},
        "keep": {"type": "tool_uses", "value": 1},
    }
    body = {"messages": history, "tools": TOOLS, "context_management": {"edits": [edit]}}
    async with client() as (c, _):
        counted = await count(c, body)
        full = await post(c, {**body, "max_tokens": 50})
        evs = await stream(c, {**body, "max_tokens": 50})
        plain = await count(c, {"messages": history, "tools": TOOLS})
    (applied,) = full["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 2
    assert counted["context_management"]["original_input_tokens"] == plain["input_tokens"]
    assert counted["input_tokens"] == plain["input_tokens"] - applied["cleared_input_tokens"]
    assert full["usage"]["input_tokens"] == counted["input_tokens"]
    assert evs[-2]["context_management"]["applied_edits"] == [applied]


# ---- the answer's shape: usage, ids, model echo --------------------------------------------------


class CachingRunner(FakeRunner):
    """Reports the first ``CACHED`` prompt tokens as read from a prefix cache."""

    CACHED = 7

    def start(self, request):
        super().start(request)
        cached = min(self.CACHED, len(request.prompt_tokens) - 1)
        self.prefilling[request.request_id].prefilled = cached
        return cached


async def test_usage_splits_cache_reads_from_input():
    async with client(runner=CachingRunner()) as (c, _):
        full = await post(c, ask("hello"))
        evs = await stream(c, ask("hello"))
        counted = await count(c, ask("hello"))
    prompt = counted["input_tokens"]
    expected = {
        "input_tokens": prompt - 7,
        "cache_read_input_tokens": 7,
        "cache_creation_input_tokens": 0,
        "output_tokens": 5,
    }
    nulls = {"server_tool_use": None, "output_tokens_details": None}
    zeros = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    full_only = {"cache_creation": zeros, "service_tier": "standard", "inference_geo": None}
    assert full["usage"] == {**expected, **nulls, **full_only}
    assert evs[0]["message"]["usage"] == {**expected, **nulls, **full_only, "output_tokens": 0}
    # message_delta: cumulative, input numbers included (its own shape: no tier or region)
    assert evs[-2]["usage"] == {**expected, **nulls}


async def test_tool_use_ids_are_toolu_and_pass_back():
    body = ask("!Sure. " + CALL, tools=TOOLS, model="claude-sonnet-4-5")
    async with client() as (c, _):
        full = await post(c, body)
        evs = await stream(c, body)
        use = full["content"][1]
        history = [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}],
            },
        ]
        again = await post(c, {"messages": history, "max_tokens": 50, "tools": TOOLS})
    assert use["id"].startswith("toolu_") and len(use["id"]) > len("toolu_")
    (start,) = [
        e["content_block"] for e in evs if e["type"] == "content_block_start" and e["index"] == 1
    ]
    assert start["type"] == "tool_use" and start["id"].startswith("toolu_")
    assert (
        full["model"] == "claude-sonnet-4-5" and evs[0]["message"]["model"] == "claude-sonnet-4-5"
    )
    assert "SUNNY" in again["content"][0]["text"]
    req = build({"messages": history, "tools": TOOLS})
    assert (
        req.messages[1].tool_calls[0].id == use["id"] and req.messages[2].tool_call_id == use["id"]
    )


async def test_model_defaults_to_the_served_id():
    async with client() as (c, _):
        full = await post(c, ask("hi"))
        models = json.loads(await (await c.get("/v1/models")).get_data())
    assert full["model"] == models["data"][0]["id"]


async def test_count_tokens_takes_every_claude_code_field():
    body = claude_code_body()
    async with client() as (c, _):
        counted = await count(c, body)
        bare = await count(
            c,
            {
                "messages": body["messages"],
                "system": body["system"],
                "tools": body["tools"],
                "thinking": body["thinking"],
            },
        )
    assert counted["input_tokens"] == bare["input_tokens"] > 0
    assert set(counted) == {"input_tokens", "context_management"}


def test_conversation_reports_the_billing_line():
    w = wire.count_decoder.decode(
        json.dumps({"messages": [{"role": "user", "content": "x"}], "system": BILLING})
    )
    assert conversation(w).billing


async def test_billing_header_is_logged_once_at_debug(caplog):
    body = claude_code_body(max_tokens=1000, stream=False)
    with caplog.at_level(logging.DEBUG, logger="mlxd"):
        async with client() as (c, _):
            await post(c, body)
            await count(c, body)
    lines = [r for r in caplog.records if "billing-header" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        (None, ["third"]),
        ("all", ["first", "second", "third"]),
        ({"type": "thinking_turns", "value": 2}, ["second", "third"]),
    ],
)
def test_clear_thinking_drops_earlier_thinking_but_the_kept_turns(keep, kept):
    def turn(thought):
        return {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": thought, "signature": "s"},
                {"type": "text", "text": "ok"},
            ],
        }

    turns = [
        {"role": "user", "content": "a"},
        turn("first"),
        {"role": "user", "content": "b"},
        turn("second"),
        {"role": "user", "content": "c"},
        turn("third"),
        {"role": "user", "content": "d"},
    ]
    edit = {"type": "clear_thinking_20251015", **({"keep": keep} if keep else {})}
    req = build({"messages": turns, "context_management": {"edits": [edit]}})
    assert [m.reasoning for m in req.messages if m.reasoning] == kept
    plain = build({"messages": turns})
    assert [m.reasoning for m in plain.messages if m.reasoning] == ["first", "second", "third"]
