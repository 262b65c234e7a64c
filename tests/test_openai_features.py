"""OpenAI features over the scripted fake runner: n, logprobs, tool calls, reasoning, echo.

The fake model answers the last user turn upper-cased, or verbatim after a
leading ``!``: that is how these tests make it emit model-specific markup.
"""

from __future__ import annotations

import json

import trio

from tests.conftest import settings_with
from tests.test_http import CHAT, client, sse_events, user

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


async def post_json(c, path, body):
    r = await c.post(path, json=body)
    assert r.status_code == 200, await r.get_data()
    return json.loads(await r.get_data())


async def read_stream(c, path, body, headers=None, on_chunk=lambda data: None) -> bytes:
    """A streamed body read as it comes (the test client's ``post`` holds 10 frames at most);
    ``on_chunk`` sees what has arrived so far after each chunk."""
    headers = {"content-type": "application/json", **(headers or {})}
    async with c.request(path, method="POST", headers=headers) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        data = b""
        while True:
            try:
                data += await conn.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                break
            on_chunk(data)
    assert conn.status_code == 200, data
    return data


async def post_stream(c, path, body):
    frames = sse_events(await read_stream(c, path, body))
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


async def test_n_choices_streaming_and_not():
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, user("hello", n=3))
        chunks = await post_stream(c, CHAT, user("hey", n=2))
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(ch["message"]["content"] == "HELLO" for ch in body["choices"])
    assert body["usage"]["completion_tokens"] == 15
    for i in (0, 1):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"].get("content") or "" for m in mine) == "HEY"
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["stop"]


async def test_chat_logprobs_streaming_and_not():
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, user("abc", logprobs=True, top_logprobs=3))
        chunks = await post_stream(c, CHAT, user("abc", logprobs=True))
        plain = await post_json(c, CHAT, user("abc"))
    content = body["choices"][0]["logprobs"]["content"]
    assert [p["token"] for p in content] == ["A", "B", "C"]
    for p in content:
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert p["bytes"] == list(p["token"].encode())
    streamed = [
        p
        for ch in chunks
        if ch["choices"] and ch["choices"][0].get("logprobs")
        for p in ch["choices"][0]["logprobs"]["content"]
    ]
    assert [p["token"] for p in streamed] == ["A", "B", "C"]
    assert all(p["top_logprobs"] == [] for p in streamed)
    assert plain["choices"][0]["logprobs"] is None


async def test_completion_logprobs_and_echo():
    async with client() as (c, _, _):
        body = await post_json(c, "/v1/completions", {"prompt": "xy", "logprobs": 2, "echo": True})
    choice = body["choices"][0]
    assert choice["text"] == "xyXY"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["X", "Y"]
    assert lp["text_offset"] == [2, 3]
    assert all(len(top) == 2 for top in lp["top_logprobs"])


async def test_completion_suffix_is_refused():
    async with client() as (c, _, _):
        r = await c.post("/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert r.status_code == 400
    assert json.loads(await r.get_data())["error"]["param"] == "suffix"


async def test_tool_call_is_parsed_not_leaked():
    req = user("!Checking. " + CALL, tools=TOOLS)
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, req)
        chunks = await post_stream(c, CHAT, req)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    pieces = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function"
    assert [p["function"].get("name") for p in pieces if "id" in p] == ["get_weather"]
    assert {p["index"] for p in pieces} == {0}
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_without_tools_markup_is_plain_content():
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, user("!" + CALL))
        none = await post_json(c, CHAT, user("!" + CALL, tools=TOOLS, tool_choice="none"))
    assert body["choices"][0]["message"]["content"] == CALL
    assert none["choices"][0]["message"]["content"] == CALL


async def test_tool_history_round_trip_renders():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, {"messages": messages, "tools": TOOLS, "temperature": 0})
    # The fake template has no tool support: the result went in as a user turn.
    assert "SUNNY" in body["choices"][0]["message"]["content"]


async def test_reasoning_is_split_streaming_and_not():
    settings = settings_with(tokenizer={"reasoning_tags": "<think>,</think>"})
    req = user("!<think>Let me see.</think>\n\nIt is 4.")
    async with client(settings) as (c, _, _):
        body = await post_json(c, CHAT, req)
        chunks = await post_stream(c, CHAT, req)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me see."
    assert message["content"] == "It is 4."
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."


async def test_chat_template_kwargs_reach_the_template():
    async with client() as (c, _, _):
        plain = await post_json(c, CHAT, user("hi"))
        kw = await post_json(c, CHAT, user("hi", chat_template_kwargs={"enable_thinking": False}))
    # The fake template renders each extra variable into the prompt.
    assert kw["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len(
        "<enable_thinking=False>"
    )


async def test_json_response_format_is_accepted():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, user('!{"a": 1}', response_format=fmt))
    assert json.loads(body["choices"][0]["message"]["content"]) == {"a": 1}


async def test_model_by_id():
    async with client(settings_with(model={"accept_other_ids": False})) as (c, _, _):
        card = await post_model(c, "/v1/models/fake-model", 200)
        missing = await post_model(c, "/v1/models/other", 404)
    assert card["id"] == "fake-model"
    assert missing["error"]["code"] == "model_not_found"


async def test_one_model_serves_any_id_and_names_itself():
    """model.accept_other_ids = "auto" with one model: any id is served by it; answers,
    the model card and the mlxd-model header name the served model."""
    async with client() as (c, _, _):
        r = await c.post(CHAT, json=user("hi", model="gpt-4o"))
        body = json.loads(await r.get_data())
        chunks = await post_stream(c, CHAT, user("hi", model="gpt-4o"))
        text = await post_json(c, "/v1/completions", {"prompt": "x", "model": "davinci"})
        resp = await post_json(c, "/v1/responses", {"input": "x", "model": "gpt-5"})
        card = await post_model(c, "/v1/models/gpt-4o", 200)
    assert r.status_code == 200 and r.headers["mlxd-model"] == "fake-model"
    assert body["model"] == "fake-model" and body["choices"][0]["message"]["content"] == "HI"
    assert {ch["model"] for ch in chunks} == {"fake-model"}
    assert text["model"] == "fake-model" and resp["model"] == "fake-model"
    assert card["id"] == "fake-model"


async def post_model(c, path, status):
    r = await c.get(path)
    assert r.status_code == status
    return json.loads(await r.get_data())


async def test_several_models_an_unknown_id_is_404_unless_forced_and_the_header_names_it():
    from tests.test_models_multi import FakeModel, ask, multi_settings, served

    models = {"a": FakeModel(), "b": FakeModel()}
    async with served(multi_settings("a", "b"), models) as (c, _):
        b = await c.post(CHAT, json=ask("b"))
        unknown = await c.post(CHAT, json=ask("gpt-4o"))
    assert b.headers["mlxd-model"] == "b"
    assert unknown.status_code == 404 and "mlxd-model" not in unknown.headers
    forced = multi_settings("a", "b")
    forced.model.accept_other_ids = True
    async with served(forced, {"a": FakeModel(), "b": FakeModel()}) as (c, _):
        r = await c.post(CHAT, json=ask("gpt-4o"))
    assert r.status_code == 200 and r.headers["mlxd-model"] == "a"
    assert json.loads(await r.get_data())["model"] == "a"


# ---- legacy function calling, reasoning_effort, refused and metadata-only fields --------------

FUNCTIONS = [t["function"] for t in TOOLS]


async def test_legacy_functions_answer_with_function_call_streaming_and_not():
    req = user("!" + CALL, functions=FUNCTIONS)
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, req)
        chunks = await post_stream(c, CHAT, req)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "function_call"
    message = choice["message"]
    assert "tool_calls" not in message and message["content"] is None
    assert message["function_call"]["name"] == "get_weather"
    assert json.loads(message["function_call"]["arguments"]) == {"city": "Paris"}
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert not any("tool_calls" in d for d in deltas)
    pieces = [d["function_call"] for d in deltas if "function_call" in d]
    assert [p.get("name") for p in pieces if "name" in p] == ["get_weather"]
    assert json.loads("".join(p["arguments"] for p in pieces)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"


async def test_legacy_function_call_choice_and_history():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    async with client() as (c, _, _):
        answered = await post_json(
            c, CHAT, {"messages": history, "functions": FUNCTIONS, "temperature": 0}
        )
        off = await post_json(c, CHAT, user("!" + CALL, functions=FUNCTIONS, function_call="none"))
        forced = await post_json(
            c, CHAT, user("!" + CALL, functions=FUNCTIONS, function_call={"name": "get_weather"})
        )
        unknown = await c.post(
            CHAT, json=user("x", functions=FUNCTIONS, function_call={"name": "g"})
        )
        both = await c.post(CHAT, json=user("x", functions=FUNCTIONS, tools=TOOLS))
    # the fake template has no tool support: the call and its result went in as text
    assert "SUNNY" in answered["choices"][0]["message"]["content"]
    assert off["choices"][0]["message"]["content"] == CALL
    assert forced["choices"][0]["message"]["function_call"]["name"] == "get_weather"
    assert json.loads(await unknown.get_data())["error"]["param"] == "function_call"
    assert json.loads(await both.get_data())["error"]["param"] == "functions"


def test_legacy_history_pairs_the_function_turn_with_its_call():
    from mlxd.daemon.api.openai import _messages
    from mlxd.protocol.openai import WireFunctionCall, WireMessage

    call = WireFunctionCall(name="f", arguments="{}")
    turns = [
        WireMessage(role="assistant", function_call=call),
        WireMessage(role="function", name="f", content="42"),
    ]
    assistant, result = _messages(turns)
    (tool_call,) = assistant.tool_calls
    assert (tool_call.name, result.role, result.tool_call_id) == ("f", "tool", tool_call.id)


async def test_reasoning_effort_sets_enable_thinking():
    async with client() as (c, _, _):
        plain = await post_json(c, CHAT, user("hi"))
        on = await post_json(c, CHAT, user("hi", reasoning_effort="high"))
        off = await post_json(c, CHAT, user("hi", reasoning_effort="minimal"))
        agree = await post_json(
            c,
            CHAT,
            user("hi", reasoning_effort="none", chat_template_kwargs={"enable_thinking": False}),
        )
    # the fake template renders each extra variable into the prompt
    prompt = plain["usage"]["prompt_tokens"]
    assert on["usage"]["prompt_tokens"] == prompt + len("<enable_thinking=True>")
    assert off["usage"]["prompt_tokens"] == prompt + len("<enable_thinking=False>")
    assert agree["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]


def test_prompt_cache_key_reaches_the_request():
    from mlxd.daemon.api.common import Validator
    from mlxd.daemon.api.openai import chat_requests
    from mlxd.daemon.settings import load_settings
    from mlxd.protocol.openai import chat_decoder

    w = chat_decoder.decode(json.dumps(user("x", prompt_cache_key="agent-7")).encode())
    (request,) = chat_requests(w, "r", Validator(load_settings()))
    assert request.cache_key == "agent-7"


async def test_metadata_fields_are_accepted_and_change_nothing():
    meta = {
        "store": True,
        "metadata": {"a": "b"},
        "service_tier": "auto",
        "safety_identifier": "u1",
        "user": "u1",
        "prompt_cache_key": "k",
        "prediction": {"type": "content", "content": "HI"},
        "modalities": ["text"],
        "verbosity": "medium",
    }
    async with client() as (c, _, _):
        body = await post_json(c, CHAT, user("hi", **meta))
    assert body["choices"][0]["message"]["content"] == "HI"
