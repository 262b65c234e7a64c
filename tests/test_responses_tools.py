"""Responses API with agent clients' tools and fields, over the scripted fake runner:
Codex's captured first request, namespace / custom / hosted tools, reasoning items,
logprobs, max_tool_calls, incomplete items and the echoed settings."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings

from tests.conftest import running_graph, settings_with
from tests.test_openai_features import CALL, read_stream
from tests.test_responses import RESP, TOOLS, events, post

CODEX = Path(__file__).parent / "data" / "codex_request.json"
WEATHER = TOOLS[0]


@asynccontextmanager
async def client(settings=None, context_length=4096):
    settings = settings or load_settings()
    async with running_graph(settings, context_length=context_length) as (pipeline, runner):
        yield create_app(pipeline, settings).test_client(), runner


def recording(runner) -> list:
    """The tokenized requests the fake runner starts, from now on."""
    seen: list = []
    start = runner.start

    def record(request):
        seen.append(request)
        return start(request)

    runner.start = record
    return seen


def prompt_of(request) -> str:
    return "".join(chr(t) for t in request.prompt_tokens)


def kinds(evs: list[dict]) -> list[str]:
    return [e["type"] for e in evs]


def namespaced(*tools) -> dict:
    return {"type": "namespace", "name": "weather_ns", "description": "Weather.", "tools": [*tools]}


def call(name: str, arguments: str = '{"city": "Paris"}') -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


# ---- Codex ----------------------------------------------------------------------------------


async def test_codex_first_request_streams():
    """Codex CLI's real first request (namespace and hosted tools, developer messages with
    ids, reasoning summary, encrypted reasoning, store false, prompt_cache_key) runs."""
    body = json.loads(CODEX.read_text())
    async with client(context_length=200_000) as (c, runner):
        seen = recording(runner)
        evs = events(await read_stream(c, RESP, body))
        stored = await c.get(f"{RESP}/{evs[-1]['response']['id']}")
    assert kinds(evs)[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds(evs)[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds(evs)[4:-4]) == {"response.output_text.delta"}
    final = evs[-1]["response"]
    assert final["output"][0]["content"][0]["text"].endswith("SAY HELLO")
    assert final["prompt_cache_key"] == body["prompt_cache_key"]
    assert final["reasoning"] == {"effort": None, "summary": "auto", "generate_summary": None}
    assert final["store"] is False and final["client_metadata"] == body["client_metadata"]
    assert final["tools"] == body["tools"]  # echoed as sent, web_search included
    assert stored.status_code == 404  # store: false
    (request,) = seen
    assert request.cache_key == body["prompt_cache_key"]
    prompt = prompt_of(request)
    for name in ("exec_command", "spawn_agent", "wait_agent", "update_goal"):
        assert f'"{name}"' in prompt  # namespace tools offered under their own names
    assert '"web_search"' not in prompt  # the hosted tool is left out


async def test_codex_namespace_call_names_its_namespace():
    """Codex routes a call by (namespace, name): the item carries both."""
    body = json.loads(CODEX.read_text())
    reply = "!" + call("spawn_agent", '{"message": "go"}')
    body["input"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": reply}]
    async with client(context_length=200_000) as (c, _):
        evs = events(await read_stream(c, RESP, body))
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == [
        {
            "type": "function_call",
            "id": done[0]["id"],
            "call_id": done[0]["call_id"],
            "name": "spawn_agent",
            "arguments": '{"message": "go"}',
            "status": "completed",
            "namespace": "multi_agent_v1",
        }
    ]


# ---- namespace tools -------------------------------------------------------------------------


async def test_namespace_tool_calls_streaming_and_not():
    body = {"input": "!" + CALL, "tools": [namespaced(WEATHER)]}
    async with client() as (c, _):
        full = await post(c, body)
        evs = events(await read_stream(c, RESP, body))
    (item,) = full["output"]
    assert (item["name"], item["namespace"]) == ("get_weather", "weather_ns")
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    added = next(e for e in evs if e["type"] == "response.output_item.added")["item"]
    assert (added["name"], added["namespace"], added["status"]) == (
        "get_weather",
        "weather_ns",
        "in_progress",
    )
    assert evs[-1]["response"]["output"][0]["namespace"] == "weather_ns"


async def test_namespace_tool_whose_name_is_taken_is_offered_qualified():
    """A namespace tool named like a plain tool is offered as ``namespace__name``; the
    call comes back as the namespace's tool, and earlier calls render under that name."""
    history = [
        {"role": "user", "content": "weather?"},
        {
            "type": "function_call",
            "call_id": "c0",
            "name": "get_weather",
            "namespace": "weather_ns",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c0", "output": "rain"},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "!" + call("weather_ns__get_weather")},
    ]
    async with client() as (c, runner):
        seen = recording(runner)
        body = await post(c, {"input": history, "tools": [WEATHER, namespaced(WEATHER)]})
    (item,) = body["output"]
    assert (item["name"], item["namespace"]) == ("get_weather", "weather_ns")
    prompt = prompt_of(seen[0])
    assert '"name": "weather_ns__get_weather"' in prompt and '"name": "get_weather"' in prompt
    assert prompt.count("weather_ns__get_weather") >= 2  # the tool and the earlier call


async def test_plain_function_call_has_no_namespace():
    async with client() as (c, _):
        body = await post(c, {"input": "!" + CALL, "tools": TOOLS})
    assert "namespace" not in body["output"][0]


# ---- custom tools ------------------------------------------------------------------------------

PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
PATCH_TEXT = "*** Begin Patch\\n*** End Patch"


async def test_custom_tool_call_streaming_and_not():
    reply = "!" + call("apply_patch", f'{{"input": "{PATCH_TEXT}"}}')
    async with client() as (c, runner):
        seen = recording(runner)
        full = await post(c, {"input": reply, "tools": [PATCH]})
        evs = events(await read_stream(c, RESP, {"input": reply, "tools": [PATCH]}))
    (item,) = full["output"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch"
    assert item["input"] == "*** Begin Patch\n*** End Patch"
    assert item["status"] == "completed"
    assert kinds(evs)[2:-1] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    assert evs[3]["delta"] == evs[4]["input"] == item["input"]
    assert evs[-2]["item"]["input"] == item["input"]
    prompt = prompt_of(seen[0])
    assert '"input"' in prompt and "*** Begin Patch" in prompt  # its string and its grammar


async def test_custom_tool_call_and_output_in_history():
    history = [
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "DIFF"},
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "applied"},
    ]
    async with client() as (c, runner):
        seen = recording(runner)
        body = await post(c, {"input": history, "tools": [PATCH]})
    assert body["status"] == "completed"
    prompt = prompt_of(seen[0])
    assert '{"input": "DIFF"}' in prompt and "applied" in prompt


async def test_forced_custom_tool_choice():
    reply = "!" + call("apply_patch", '{"input": "x"}')
    choice = {"type": "custom", "name": "apply_patch"}
    async with client() as (c, _):
        body = await post(c, {"input": reply, "tools": [PATCH], "tool_choice": choice})
    assert body["output"][0]["type"] == "custom_tool_call"


# ---- hosted tools ------------------------------------------------------------------------------


async def test_hosted_tools_are_left_out_with_a_log_line(caplog):
    hosted = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}]
    async with client() as (c, runner):
        seen = recording(runner)
        with caplog.at_level(logging.INFO, logger="mlxd.responses"):
            body = await post(c, {"input": "hi", "tools": [*hosted, *TOOLS]})
    assert body["status"] == "completed" and body["tools"][:2] == hosted
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxd.responses"]
    assert len(lines) == 1 and "web_search, file_search" in lines[0]
    prompt = prompt_of(seen[0])
    assert "get_weather" in prompt and "web_search" not in prompt


async def test_strict_hosted_tools_refuses_them():
    settings = settings_with(responses={"strict_hosted_tools": True})
    async with client(settings) as (c, _):
        err = await post(c, {"input": "hi", "tools": [*TOOLS, {"type": "web_search"}]}, 400)
    assert err["error"]["param"] == "tools[1]" and "hosted" in err["error"]["message"]


# ---- reasoning ---------------------------------------------------------------------------------

THINKING = settings_with(tokenizer={"reasoning_tags": "<think>,</think>"})
THOUGHT = "!<think>Let me see.</think>\n\nIt is 4."


async def test_reasoning_item_carries_the_reasoning_text():
    async with client(THINKING) as (c, _):
        body = await post(c, {"input": THOUGHT})
        evs = events(await read_stream(c, RESP, {"input": THOUGHT}))
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert reasoning["encrypted_content"] is None  # not included
    assert message["content"][0]["text"] == "It is 4."
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    deltas = [e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Let me see."
    assert "response.reasoning_text.done" in kinds(evs)
    assert evs[-1]["response"]["output"][0] == {
        **reasoning,
        "id": evs[-1]["response"]["output"][0]["id"],
    }


@pytest.mark.parametrize("summary", ["auto", "concise", "detailed"])
async def test_reasoning_summary_carries_the_whole_text(summary):
    """There is no summarizer: a requested summary is the reasoning text itself."""
    body = {"input": THOUGHT, "reasoning": {"summary": summary}}
    async with client(THINKING) as (c, _):
        full = await post(c, body)
        evs = events(await read_stream(c, RESP, body))
    reasoning = full["output"][0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Let me see."}]
    assert reasoning["content"] is None
    assert kinds(evs)[2:4] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
    ]
    deltas = [e for e in evs if e["type"] == "response.reasoning_summary_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "Let me see."
    assert all(e["summary_index"] == 0 for e in deltas)
    assert "response.reasoning_summary_part.done" in kinds(evs)


# ---- logprobs, max_tool_calls, incomplete items, echoes ---------------------------------------


async def test_logprobs_through_include_and_top_logprobs():
    body = {"input": "abc", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    async with client() as (c, _):
        full = await post(c, body)
        evs = events(await read_stream(c, RESP, body))
        plain = await post(c, {"input": "abc"})
    logprobs = full["output"][0]["content"][0]["logprobs"]
    assert [p["token"] for p in logprobs] == ["A", "B", "C"]
    assert all(len(p["top_logprobs"]) == 2 and p["logprob"] == -0.25 for p in logprobs)
    streamed = [p for e in evs if e["type"] == "response.output_text.delta" for p in e["logprobs"]]
    assert [p["token"] for p in streamed] == ["A", "B", "C"]
    assert full["top_logprobs"] == 2
    assert plain["output"][0]["content"][0]["logprobs"] == []


async def test_max_tool_calls_drops_the_calls_past_it():
    body = {"input": "!" + CALL * 3, "tools": TOOLS, "max_tool_calls": 2}
    async with client() as (c, _):
        full = await post(c, body)
        evs = events(await read_stream(c, RESP, body))
        free = await post(c, {**body, "max_tool_calls": None})
    assert [i["type"] for i in full["output"]] == ["function_call"] * 2
    assert len([e for e in evs if e["type"] == "response.output_item.done"]) == 2
    assert len(free["output"]) == 3
    assert full["max_tool_calls"] == 2


async def test_items_cut_by_max_output_tokens_are_incomplete():
    cut_text = {"input": "abcdef", "max_output_tokens": 2}
    cut_call = {"input": "!" + CALL, "tools": TOOLS, "max_output_tokens": 50}
    async with client() as (c, _):
        text = await post(c, cut_text)
        text_evs = events(await read_stream(c, RESP, cut_text))
        fc = await post(c, cut_call)
        fc_evs = events(await read_stream(c, RESP, cut_call))
    assert text["status"] == "incomplete" and text["output"][0]["status"] == "incomplete"
    assert fc["status"] == "incomplete"
    (item,) = fc["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(item["arguments"])
    for evs in (text_evs, fc_evs):
        assert evs[-1]["type"] == "response.incomplete"
        assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        done = next(e for e in evs if e["type"] == "response.output_item.done")
        assert done["item"]["status"] == "incomplete"
        assert evs[-1]["response"]["output"][0]["status"] == "incomplete"


async def test_completed_items_before_the_cut_stay_completed():
    # the limit cuts the text after the call (a cut call opener is dropped: tests/test_cut_calls)
    body = {"input": "!" + CALL + " and more", "tools": TOOLS, "max_output_tokens": 82}
    async with client() as (c, _):
        full = await post(c, body)
    assert [i["status"] for i in full["output"]] == ["completed", "incomplete"]


async def test_request_settings_are_echoed():
    echoed = {
        "metadata": {"k": "v"},
        "user": "u1",
        "safety_identifier": "s1",
        "truncation": "auto",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "store": False,
        "prompt_cache_key": "pk",
        "reasoning": {"effort": "low", "summary": None, "generate_summary": None},
        "client_metadata": {"turn": "1"},
        "max_tool_calls": 3,
        "parallel_tool_calls": False,
        "instructions": "be brief",
        "previous_response_id": None,
    }
    async with client() as (c, _):
        body = await post(c, {"input": "x", "service_tier": "auto", **echoed})
    assert {k: body[k] for k in echoed} == echoed
    assert body["service_tier"] == "default" and body["background"] is False


async def test_max_output_tokens_above_the_cap_is_clamped():
    cap = 100
    async with client(settings_with(engine={"max_tokens_cap": cap})) as (c, _):
        body = await post(c, {"input": "hi", "max_output_tokens": cap * 10})
    assert body["status"] == "completed" and body["max_output_tokens"] == cap * 10


async def test_no_max_output_tokens_means_up_to_the_cap():
    """OpenAI's default: limited by the context only; here by engine.max_tokens_cap too,
    shrunk to the context left after the prompt, not engine.default_max_tokens."""
    settings = settings_with(engine={"default_max_tokens": 16, "max_tokens_cap": 1000})
    async with client(settings) as (c, runner):
        seen = recording(runner)
        await post(c, {"input": "hi"})
        await post(c, {"input": "hi", "max_output_tokens": 7})
        big = await post(c, {"input": "hi", "instructions": "x" * 3500})
    assert [r.sampling.max_tokens for r in seen[:2]] == [1000, 7]
    assert seen[2].sampling.max_tokens == 4096 - len(seen[2].prompt_tokens)
    assert big["status"] == "completed"
