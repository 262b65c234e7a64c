"""The API surface on the real default model: structured output, forced tool calls,
logprobs, n, and Anthropic / Responses answers equal to chat (greedy)."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import pytest
import trio
from mlxd.daemon.supervisor import mlx_runner_factory

from tests.conftest import real_server
from tests.test_anthropic import events as anthropic_events
from tests.test_real_model import settings  # noqa: F401 - the session's settings fixture

pytestmark = pytest.mark.mlx

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 10}},
                "required": ["zone"],
            },
        },
    },
]


def chat(text, **extra):
    return {
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 40,
        **extra,
    }


async def test_structured_output_tools_and_logprobs(settings):  # noqa: F811
    async with real_server(settings, mlx_runner_factory(settings)) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def post(body):
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            plain = chat("Describe a person.", max_tokens=30)
            alone = await post(plain)
            results = {}

            async def one(key, body):
                results[key] = await post(body)

            async with trio.open_nursery() as nursery:  # constrained and plain in one batch
                nursery.start_soon(
                    one, "person", {**plain, "max_tokens": 60, "response_format": fmt}
                )
                nursery.start_soon(one, "plain", plain)
            person = results["person"]
            assert results["plain"]["choices"][0]["message"] == alone["choices"][0]["message"]
            weather = chat(
                "What's the weather in Paris?", max_tokens=60, tools=TOOLS, tool_choice="required"
            )
            forced = await post(weather)
            raw = (await http.post("/v1/chat/completions", json={**weather, "stream": True})).text
            named = {"type": "function", "function": {"name": "get_time"}}
            timed = await post(chat("Hello!", max_tokens=60, tools=TOOLS, tool_choice=named))
            lp = await post(
                chat("Name three colours.", max_tokens=12, logprobs=True, top_logprobs=5)
            )
            two = await post(chat("Name three colours.", max_tokens=12, n=2))
            bad = await http.post(
                "/v1/chat/completions",
                json=chat(
                    "x",
                    response_format={
                        "type": "json_schema",
                        "json_schema": {
                            "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}
                        },
                    },
                ),
            )

    content = person["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), PERSON)
    assert person["choices"][0]["finish_reason"] == "stop"

    for body, allowed in ((forced, {"get_weather", "get_time"}), (timed, {"get_time"})):
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in allowed
        schema = next(
            t["function"]["parameters"]
            for t in TOOLS
            if t["function"]["name"] == call["function"]["name"]
        )
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)

    frames = [
        json.loads(f.removeprefix("data: "))
        for f in raw.split("\n\n")
        if f and "[DONE]" not in f and not f.startswith(":")  # an SSE comment: a keep-alive
    ]
    deltas = [fr["choices"][0]["delta"] for fr in frames if fr["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""  # no markup leaks
    streamed = [tc for d in deltas for tc in d.get("tool_calls") or []]
    (call,) = forced["choices"][0]["message"]["tool_calls"]
    assert streamed[0]["function"]["name"] == call["function"]["name"]
    assert "".join(tc["function"]["arguments"] for tc in streamed) == call["function"]["arguments"]

    pieces = lp["choices"][0]["logprobs"]["content"]
    assert len(pieces) == lp["usage"]["completion_tokens"]
    assert "".join(p["token"] for p in pieces) == lp["choices"][0]["message"]["content"]
    for p in pieces:
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert all(math.isfinite(v) and v <= 0 for v in [p["logprob"], *tops])
        assert tops == sorted(tops, reverse=True) and len(tops) == 5
        assert p["logprob"] == pytest.approx(tops[0])  # greedy picks the likeliest token
    texts = [c["message"]["content"] for c in two["choices"]]
    assert texts == [lp["choices"][0]["message"]["content"]] * 2  # greedy choices agree

    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "response_format"


async def test_anthropic_and_responses_equal_chat(settings):  # noqa: F811
    question, system = "Tell me about the moon.", "You are a concise assistant."
    async with real_server(settings, mlx_runner_factory(settings)) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            ref = (
                await http.post(
                    "/v1/chat/completions",
                    json={"messages": messages, "temperature": 0, "max_tokens": 30},
                )
            ).json()
            anth = {
                "system": system,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 30,
                "temperature": 0,
            }
            msg = (await http.post("/v1/messages", json=anth)).json()
            streamed = anthropic_events(
                (await http.post("/v1/messages", json={**anth, "stream": True})).content
            )
            items = [{"role": "user", "content": question}]
            body = {
                "instructions": system,
                "input": items,
                "max_output_tokens": 30,
                "temperature": 0,
            }
            resp = (await http.post("/v1/responses", json=body)).json()
            count = (
                await http.post(
                    "/v1/messages/count_tokens",
                    json={"system": system, "messages": anth["messages"]},
                )
            ).json()

    text = ref["choices"][0]["message"]["content"]
    assert len(text) > 20
    assert msg["content"] == [{"type": "text", "text": text, "citations": None}]
    assert (
        "".join(e["delta"]["text"] for e in streamed if e["type"] == "content_block_delta") == text
    )
    assert resp["output"][0]["content"][0]["text"] == text
    # Anthropic's input_tokens are the prompt tokens not read from the cache
    prompt = msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"]
    assert prompt == ref["usage"]["prompt_tokens"] == count["input_tokens"]
    assert resp["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3", "json"])
def test_forced_call_grammar_round_trips_through_each_parser(settings, fmt):  # noqa: F811
    """For formats the small model is not trained on: the forced-call grammar of each
    format accepts a well-formed call to an offered tool (and only that), and the format's
    parser reads that very text back as the call."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer
    from mlxd.actors.engine.loading.load import resolve_model_dir
    from mlxd.actors.families.output import OutputParser
    from mlxd.actors.grammar import GrammarCompiler, tool_call_lark, tool_call_schema
    from mlxd.protocol.messages import Constraint, OutputSpec, Tool

    _, model_dir = resolve_model_dir("", Path(settings.model.cache_dir), lambda _line: None)
    tokenizer = load_tokenizer(model_dir)
    tools = (Tool(name="get_weather", parameters=WEATHER), Tool(name="other"))
    constraint = Constraint(kind="tool_call", tool_names=("get_weather",))
    args = '{"city":"Oslo","unit":"C"}'
    body = '{"name":"get_weather","arguments":' + args + "}"
    text = {
        "hermes": f"<tool_call>\n{body}\n</tool_call>",
        "mistral": f"[TOOL_CALLS][{body}]",
        "llama3": body,
        "json": body,
    }[fmt]
    compiler = GrammarCompiler(tokenizer)

    def accepts(candidate: str) -> bool:
        matcher = compiler.compile(constraint, tools, fmt).matcher
        tokens = tokenizer.encode(candidate, add_special_tokens=False)
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert "%json" in tool_call_lark(tool_call_schema(tools, ("get_weather",)), fmt)
    assert accepts(text)
    assert not accepts(text.replace("get_weather", "other"))
    assert not accepts(text.replace('"unit":"C"', '"unit":"K"'))
    parser = OutputParser(OutputSpec(tool_format=fmt))
    pieces = parser.feed(text).calls + parser.flush().calls
    assert pieces[0].name == "get_weather"
    assert json.loads("".join(p.arguments for p in pieces)) == json.loads(args)
