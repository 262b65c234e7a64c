"""Each family's tool calls and reasoning through the whole daemon, in every API.

The scripted fake model answers verbatim after a leading ``!``, so a user turn
holding a family's markup (rendered by that family's real chat template, or as
gpt-oss writes it) is what the model "writes". The tokenizer wears the family's
real template, so mlxd picks the family's format as it would at load. Every API
must return the calls structured, with exact arguments, and the text before
them as content, streamed and whole.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings

from tests import templates
from tests.conftest import running_graph
from tests.fakes import CharTokenizer, FakeRunner
from tests.test_http import sse_events
from tests.test_openai_features import post_json, read_stream

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "options": {"type": "object"},
    },
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ARGS = [
    {"city": 'São Paulo "centre"\nnorth', "days": 3, "options": {"units": ["c"], "deep": {"a": 1}}},
    {"city": "Tokyo"},
]
PREFACE = "Let me check. "

FAMILIES = {  # template → format (as detected)
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "GLM-4.7-Flash": "glm47",
    "MiniMax-M2": "minimax_m2",
    "google-gemma-4-31B-it": "gemma4",
    "moonshotai-Kimi-K2": "kimi_k2",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3",
    "Qwen-Qwen3-0.6B": "hermes",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "openai-gpt-oss-120b": "harmony",
}
HARMONY = (
    "<|channel|>analysis<|message|>The user wants weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>" + PREFACE.strip() + "<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|>" + json.dumps(ARGS[0], ensure_ascii=False) + "<|call|>"
)


class FamilyTokenizer(CharTokenizer):
    """The char tokenizer wearing a family's real chat template (for detection)."""

    def __init__(self, template: str):
        self.chat_template = template


def _markup(name: str) -> tuple[str, list[dict], str]:
    """(what the model writes, the calls in it, the content before them)."""
    if name == "openai-gpt-oss-120b":
        return HARMONY, ARGS[:1], PREFACE.strip()
    calls = [
        {
            "id": f"c{i}aB3dE5fG",
            "type": "function",
            "function": {"name": "get_weather", "arguments": a},
        }
        for i, a in enumerate(ARGS)
    ]
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    _, text = templates.written(templates.source(name), "Hi", turn, TOOLS)
    text = text.split("</think>", 1)[-1].lstrip()  # the GLM / Qwen3.5 empty thinking block
    text = text.split("<|tool_response>", 1)[0]  # Gemma 4 stops on it (an end-of-turn token)
    return PREFACE + text, ARGS, PREFACE.rstrip()


@asynccontextmanager
async def family_client(name: str):
    settings = load_settings()
    runner = FakeRunner()

    def factory():
        info = ModelInfo(
            model_id="fake-model",
            model_dir=Path("."),
            context_length=16384,
            vocab_size=0x110000,
            tokenizer=FamilyTokenizer(templates.source(name)),
            backend="fake",
        )
        return runner, info

    async with running_graph(settings, factory=factory) as (pipeline, _):
        yield create_app(pipeline, settings).test_client()


def _args(calls: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    return [(n, json.loads(a)) for n, a in calls]


def _want(calls: list[dict]) -> list[tuple[str, dict]]:
    return [("get_weather", a) for a in calls]


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_every_api_returns_the_familys_calls(name):
    templates.template_dir()
    text, calls, content = _markup(name)
    chat = {
        "messages": [{"role": "user", "content": "!" + text}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 4000,
    }
    async with family_client(name) as c:
        whole = (await post_json(c, "/v1/chat/completions", chat))["choices"][0]
        streamed = sse_events(await read_stream(c, "/v1/chat/completions", chat))
        responses = await post_json(
            c,
            "/v1/responses",
            {
                "input": "!" + text,
                "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                "max_output_tokens": 4000,
            },
        )
        anthropic = await post_json(
            c,
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": "!" + text}],
                "tools": [{"name": "get_weather", "input_schema": PARAMS}],
            },
        )
        ollama = await post_json(
            c,
            "/api/chat",
            {
                "model": "m",
                "stream": False,
                "messages": [{"role": "user", "content": "!" + text}],
                "tools": TOOLS,
            },
        )
    want = _want(calls)
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls"
    assert (
        _args([(t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]])
        == want
    )
    assert (message["content"] or "").strip() == content

    deltas = [
        json.loads(f)["choices"][0]["delta"]
        for f in streamed[:-1]
        if '"choices": [{' in f or '"choices":[{' in f
    ]
    pieces: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.get("tool_calls") or ():
            entry = pieces.setdefault(t["index"], ["", ""])
            entry[0] += t["function"].get("name") or ""
            entry[1] += t["function"].get("arguments") or ""
    assert _args([tuple(v) for v in pieces.values()]) == want  # type: ignore[misc]
    assert "".join(d.get("content") or "" for d in deltas).strip() == content

    items = [i for i in responses["output"] if i["type"] == "function_call"]
    assert _args([(i["name"], i["arguments"]) for i in items]) == want
    uses = [b for b in anthropic["content"] if b["type"] == "tool_use"]
    assert [("get_weather", b["input"]) for b in uses] == want
    assert anthropic["stop_reason"] == "tool_use"
    calls_o = ollama["message"]["tool_calls"]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls_o] == want
    if name == "openai-gpt-oss-120b":  # its analysis channel is reasoning in every API
        assert message["reasoning_content"] == "The user wants weather."
        assert any(i["type"] == "reasoning" for i in responses["output"])
        assert anthropic["content"][0]["type"] == "thinking"
        assert ollama["message"]["thinking"] == "The user wants weather."


async def test_an_effort_gpt_oss_cannot_take_is_a_400_in_each_api():
    templates.template_dir()
    hi = [{"role": "user", "content": "hi"}]
    async with family_client("openai-gpt-oss-120b") as c:
        chat = await c.post(
            "/v1/chat/completions", json={"messages": hi, "reasoning_effort": "none"}
        )
        responses = await c.post(
            "/v1/responses", json={"input": "hi", "reasoning": {"effort": "none"}}
        )
        anthropic = await c.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 64, "messages": hi, "thinking": {"type": "disabled"}},
        )
        ollama = await c.post(
            "/api/chat", json={"model": "m", "messages": hi, "think": False, "stream": False}
        )
        fine = await c.post(
            "/v1/chat/completions",
            json={"messages": hi, "reasoning_effort": "low", "max_tokens": 4},
        )
    for r in (chat, responses, anthropic, ollama):
        assert r.status_code == 400, await r.get_data()
        assert "low, medium, high" in (await r.get_data()).decode()
    assert fine.status_code == 200
