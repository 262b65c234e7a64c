"""Validation at the edge (issue 11): every field range, body encoding and depth, content
type, Host header and the count_tokens queue, on every API, over the fake runner."""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from mlxd.daemon.api.body import is_json_type, json_depth
from mlxd.daemon.app import create_app
from mlxd.daemon.security import AllowedHosts
from mlxd.daemon.settings import load_settings

from tests.conftest import running_graph, settings_with

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
VOCAB = 0x110000  # the fake model's


@asynccontextmanager
async def client(settings=None):
    settings = settings or load_settings()
    async with running_graph(settings) as (pipeline, runner):
        yield create_app(pipeline, settings).test_client(), pipeline


def chat(**extra):
    return {"messages": [{"role": "user", "content": "x"}], "temperature": 0, **extra}


def anthropic(**extra):
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}


MINIMAL = {
    CHAT: chat(),
    COMPLETIONS: {"prompt": "x", "temperature": 0},
    MESSAGES: anthropic(),
    COUNT: {"messages": [{"role": "user", "content": "x"}]},
    RESPONSES: {"input": "x", "temperature": 0},
}


async def openai_error(response, status):
    assert response.status_code == status, await response.get_data()
    return json.loads(await response.get_data())["error"]


async def anthropic_error(response, status):
    assert response.status_code == status, await response.get_data()
    body = json.loads(await response.get_data())
    assert body["type"] == "error"
    return body["error"]


async def error_of(path, response, status):
    """(param or None, message) in the format of the API that was called."""
    if path.startswith(MESSAGES):
        err = await anthropic_error(response, status)
        return None, err["message"]
    err = await openai_error(response, status)
    return err["param"], err["message"]


# ---- numeric and index-like fields ---------------------------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def deep_arguments(depth):
    call = {**CALL, "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}
    return [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def long_call_name():
    turns = deep_arguments(1)
    turns[1]["tool_calls"][0]["function"]["name"] = "f" * 70_000
    return turns


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": VOCAB}, "top_k"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
        ({"logit_bias": {"1_0": 5}}, "logit_bias"),
        ({"logit_bias": {" 7": 5}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 1e300}, "presence_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"priority": 2**40}, "priority"),
        ({"max_tokens": -(2**70)}, "max_tokens"),  # above the cap is clamped: test_max_tokens.py
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"tools": [TOOL] * 129}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "description": "d" * 70_000}}
                ]
            },
            "tools[0]",
        ),
        ({"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, "chat_template_kwargs"),
        ({"messages": deep_arguments(50_000)}, "messages[1].tool_calls[0].function.arguments"),
        ({"messages": deep_arguments(65)}, "messages[1].tool_calls[0].function.arguments"),
        ({"messages": long_call_name()}, "messages[1].tool_calls[0]"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "banana"}]}, "messages[1].role"),
        ({"messages": [{"role": "User", "content": "x"}]}, "messages[0].role"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        (
            {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
            "reasoning_effort",
        ),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
    ],
)
async def test_chat_fields_out_of_range_are_400_naming_the_field(extra, param):
    async with client() as (c, _):
        param_got, message = await error_of(CHAT, await c.post(CHAT, json=chat(**extra)), 400)
    assert param_got == param, message


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": -1},  # off, as vLLM spells it
        {"top_k": VOCAB - 1},
        {"seed": 2**63 - 1, "n": 2},
        {"logit_bias": {"65": 100, "66": -100.5}},
        {"messages": deep_arguments(60)},
        {"repetition_penalty": 10},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        {"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]},
        {"temperature": 1e-320},  # 1/T overflows: greedy (test_a_tiny_temperature_is_greedy)
        {"reasoning_effort": "none"},
        {"reasoning_effort": "xhigh"},
    ],
)
async def test_chat_fields_at_the_edge_of_their_range_are_served(extra):
    async with client() as (c, _):
        r = await c.post(CHAT, json=chat(max_tokens=2, **extra))
    assert r.status_code == 200, await r.get_data()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [VOCAB]}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "top_k": VOCAB + 5}, "top_k"),
    ],
)
async def test_completions_fields_are_checked(body, param):
    async with client() as (c, _):
        r = await c.post(COMPLETIONS, json=body)
        param_got, message = await error_of(COMPLETIONS, r, 400)
    assert param_got == param, message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (MESSAGES, anthropic(top_k=-5), "top_k"),
        (MESSAGES, anthropic(top_k=VOCAB), "top_k"),
        (MESSAGES, anthropic(temperature=3), "temperature"),
        (MESSAGES, anthropic(max_tokens=0), "max_tokens"),
        (
            COUNT,
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}] * 200},
            "tools",
        ),
    ],
)
async def test_anthropic_fields_are_checked(path, body, field):
    async with client() as (c, _):
        _, message = await error_of(path, await c.post(path, json=body), 400)
    assert message.startswith(f"{field}:"), message


async def test_anthropic_tool_use_input_too_deep_is_400():
    deep: object = 1
    for _ in range(70):
        deep = [deep]
    turns = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": deep}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]},
    ]
    async with client() as (c, _):
        for path in (MESSAGES, COUNT):
            _, message = await error_of(
                path, await c.post(path, json=anthropic(messages=turns)), 400
            )
            assert "server.max_json_depth" in message


async def test_responses_fields_are_checked():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 50_000}
    out = {"type": "function_call_output", "call_id": "c", "output": "ok"}
    bodies = [
        ({"input": [{"role": "user", "content": "x"}, call, out]}, "input"),
        ({"input": "x", "temperature": 9}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}] * 129},
            "tools",
        ),
    ]
    async with client() as (c, _):
        for body, param in bodies:
            got, message = await error_of(RESPONSES, await c.post(RESPONSES, json=body), 400)
            assert got == param, message


# ---- integers beyond a double's range -------------------------------------------------------

HUGE = 10**400  # 401 digits; the float 1e400 is already the JSON decoder's 400
OLLAMA_CHAT, OLLAMA_GENERATE = "/api/chat", "/api/generate"


def ollama(path, **options):
    body = {"model": "m", "stream": False, "options": options}
    if path == OLLAMA_CHAT:
        return {**body, "messages": [{"role": "user", "content": "x"}]}
    return {**body, "prompt": "x"}


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, lambda n: chat(max_tokens=n), "max_tokens"),
        (CHAT, lambda n: chat(max_completion_tokens=n), "max_completion_tokens"),
        # max_completion_tokens wins, but the other one is still a number to check
        (CHAT, lambda n: chat(max_tokens=n, max_completion_tokens=5), "max_tokens"),
        (COMPLETIONS, lambda n: {"prompt": "x", "max_tokens": n}, "max_tokens"),
        (RESPONSES, lambda n: {"input": "x", "max_output_tokens": n}, "max_output_tokens"),
        (MESSAGES, lambda n: anthropic(max_tokens=n), "max_tokens"),
        (OLLAMA_CHAT, lambda n: ollama(OLLAMA_CHAT, num_predict=n), "options.num_predict"),
        (OLLAMA_GENERATE, lambda n: ollama(OLLAMA_GENERATE, num_predict=n), "options.num_predict"),
        (OLLAMA_CHAT, lambda n: ollama(OLLAMA_CHAT, num_ctx=n), "options.num_ctx"),
        (OLLAMA_GENERATE, lambda n: ollama(OLLAMA_GENERATE, seed=n), "options.seed"),
    ],
)
async def test_a_token_count_beyond_a_doubles_range_is_400_naming_the_field(
    path, body, field, sign
):
    """Above ``engine.max_tokens_cap`` a count is clamped (``test_max_tokens.py``), but a
    401-digit integer is out of range on every API, as ``seed``, ``top_k`` and ``n`` are."""
    data = json.dumps(body(sign * HUGE)).encode()
    headers = {"Content-Type": "application/json"}
    async with client() as (c, _):
        r = await c.post(path, data=data, headers=headers)
        if path.startswith("/api/"):
            assert r.status_code == 400, await r.get_data()
            message = json.loads(await r.get_data())["error"]
            assert message.startswith(f"{field} is out of range"), message
            return
        param, message = await error_of(path, r, 400)
    if path == MESSAGES:
        assert message.startswith(f"{field}: {field} is out of range"), message
    else:
        assert param == field, message
        assert "out of range" in message


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES, RESPONSES])
async def test_a_huge_count_within_a_doubles_range_is_still_clamped(path):
    field = "max_output_tokens" if path == RESPONSES else "max_tokens"
    body = {**MINIMAL[path], field: 10**300}
    async with client() as (c, _):
        r = await c.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, await r.get_data()


# ---- structured output that allows nothing ------------------------------------------------

LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
NESTED_LOOP = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/x"}},
    "required": ["a"],
    "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
}


@pytest.mark.parametrize("schema", [LOOP, NESTED_LOOP])
async def test_a_schema_that_allows_no_output_is_400_not_an_empty_answer(schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    async with client() as (c, _):
        for stream in (False, True):
            r = await c.post(CHAT, json=chat(response_format=fmt, stream=stream))
            param, message = await error_of(CHAT, r, 400)
            assert param == "response_format"
            assert "$ref" in message
        text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
        r = await c.post(RESPONSES, json={"input": "x", "text": text})
        assert (await error_of(RESPONSES, r, 400))[0] == "text.format"
        tool = {"name": "f", "input_schema": schema}
        body = anthropic(tools=[tool], tool_choice={"type": "tool", "name": "f"})
        _, message = await error_of(MESSAGES, await c.post(MESSAGES, json=body), 400)
        assert message.startswith("tool_choice:") and "$ref" in message


def test_recursive_schemas_that_allow_values_compile():
    from mlxd.actors.grammar import GrammarCompiler
    from mlxd.protocol.messages import Constraint

    from tests.fakes import CharTokenizer

    grammars = GrammarCompiler(CharTokenizer())
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert grammars.compile(Constraint(kind="json_schema", schema=tree)) is None  # check-only


# ---- the body itself -----------------------------------------------------------------------

ROUTES = [CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES]


@pytest.mark.parametrize("path", ROUTES)
async def test_deep_json_is_400_before_decoding_on_every_route(path):
    deep = b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b', "x": ' + b"{}" + b"}"
    unknown = b'{"zzz": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # a field nobody reads
    kwargs = ("600", {**MINIMAL[path], "chat_template_kwargs": _nested(600)})
    async with client() as (c, _):
        for body in (deep, unknown, json.dumps(kwargs[1]).encode()):
            r = await c.post(path, data=body, headers={"Content-Type": "application/json"})
            _, message = await error_of(path, r, 400)
            assert "server.max_json_depth" in message


def _nested(depth):
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("path", ROUTES)
async def test_invalid_utf8_is_400_on_every_route(path):
    good = json.dumps(MINIMAL[path]).encode()
    in_a_field = good.replace(b'"x"', b'"\xff\xfe"', 1)
    in_an_unknown_field = good[:-1] + b', "zz": "\xc3\x28"}'
    async with client() as (c, _):
        for body in (in_a_field, in_an_unknown_field):
            r = await c.post(path, data=body, headers={"Content-Type": "application/json"})
            _, message = await error_of(path, r, 400)
            assert "UTF-8" in message


@pytest.mark.parametrize("path", ROUTES)
async def test_a_body_not_declared_json_is_415_and_never_parsed(path):
    body = json.dumps(MINIMAL[path]).encode()
    async with client() as (c, _):
        for headers in (
            {"Content-Type": "text/plain"},
            {},
            {"Content-Type": "application/x-www-form-urlencoded"},
        ):
            r = await c.post(path, data=body, headers=headers)
            _, message = await error_of(path, r, 415)
            assert "application/json" in message
        for ok in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
            r = await c.post(path, data=body, headers={"Content-Type": ok})
            assert r.status_code == 200, (ok, await r.get_data())


def test_json_content_types():
    assert is_json_type("application/json")
    assert is_json_type("application/merge-patch+json; charset=UTF-8")
    assert not is_json_type("text/plain")
    assert not is_json_type("application/jsonx")
    assert not is_json_type(None)


# ---- Host header ---------------------------------------------------------------------------


async def test_a_foreign_host_header_is_403_in_the_api_format():
    async with client() as (c, _):  # bound to 127.0.0.1: loopback names only
        for path in ROUTES:
            r = await c.post(path, json=MINIMAL[path], headers={"Host": "evil.example:8000"})
            _, message = await error_of(path, r, 403)
            assert "server.allowed_hosts" in message
        assert (await c.get("/v1/models", headers={"Host": "rebound.example"})).status_code == 403
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
            r = await c.get("/v1/models", headers={"Host": host})
            assert r.status_code == 200, host


async def test_a_malformed_host_header_is_400_even_when_any_host_is_allowed():
    async with client(settings_with(server={"host": "0.0.0.0"})) as (c, _):
        for host in ("a" * 300, "x y", ""):  # the URL router raised on "a" * 300: a 500
            r = await c.post(MESSAGES, json=MINIMAL[MESSAGES], headers={"Host": host})
            _, message = await error_of(MESSAGES, r, 400)
            assert "Host" in message


async def test_allowed_hosts_setting_and_wildcard_binds():
    settings = settings_with(server={"allowed_hosts": ["llm.lan"]})
    async with client(settings) as (c, _):
        assert (await c.get("/v1/models", headers={"Host": "llm.lan:8000"})).status_code == 200
        assert (await c.get("/v1/models", headers={"Host": "localhost"})).status_code == 403
    async with client(settings_with(server={"host": "0.0.0.0"})) as (c, _):
        assert (await c.get("/v1/models", headers={"Host": "anything"})).status_code == 200


def test_allowed_hosts_derivation():
    assert AllowedHosts([], "127.0.0.1").allows("localhost:1")
    assert not AllowedHosts([], "127.0.0.1").allows("evil")
    assert AllowedHosts([], "::").allows("evil")
    assert AllowedHosts([], "192.168.1.5").names == {"192.168.1.5"}
    assert AllowedHosts(["*"], "127.0.0.1").allows("evil")
    assert AllowedHosts([], "127.0.0.1").allows(None)  # HTTP/1.0: no Host, not a browser


# ---- count_tokens has a bounded queue ------------------------------------------------------


async def test_count_tokens_beyond_its_queue_is_429_with_retry_after():
    settings = settings_with(tokenizer={"workers": 1, "count_tokens_max_waiting": 1})
    async with client(settings) as (c, pipeline):
        release = trio.Event()
        counted = pipeline.count_tokens

        async def slow_count(request):
            await release.wait()
            return await counted(request)

        pipeline.count_tokens = slow_count
        results: list = []

        async def post():
            results.append(await c.post(COUNT, json=MINIMAL[COUNT]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post)
            nursery.start_soon(post)
            await trio.testing.wait_all_tasks_blocked()  # both hold their places
            refused = await c.post(COUNT, json=MINIMAL[COUNT])
            release.set()
        err = await anthropic_error(refused, 429)
        assert err["type"] == "rate_limit_error"
        assert "count_tokens_max_waiting" in err["message"]
        assert refused.headers["Retry-After"] == "1"
        assert [r.status_code for r in results] == [200, 200]
        assert (await c.post(COUNT, json=MINIMAL[COUNT])).status_code == 200


# ---- the depth scanner ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"5", 0),
        (b"", 0),
        (b"{}", 1),
        (b'[[1], {"a": [2]}]', 3),
        (b'"[[[["', 0),
        (rb'{"a\"[[[": [1]}', 2),  # an escaped quote does not end the string
        (rb'{"a\\": [[1]]}', 3),  # an escaped backslash does not escape the quote
        (rb'["\\\"[", {"b": "}}}"}]', 2),
    ],
)
def test_json_depth(text, depth):
    assert json_depth(text) == depth


def test_json_depth_agrees_with_python_on_nested_documents():
    docs = [[{"a\\": ['"[', {"b": [1, "\\\\]"]}]}], {"x": [[[[]]]], 'y"': "{{"}, ["\\"] * 3]
    for doc in docs:
        text = json.dumps(doc).encode()
        assert json_depth(text) == _depth(doc)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_json_depth_is_fast_on_a_4mb_body():
    bodies = [
        b"[" * 2_000_000 + b"]" * 2_000_000,
        json.dumps([{"k": '"\\[{'} for _ in range(200_000)]).encode()[:4_000_000],
        (b'["ab",' * 700_000)[:4_000_000],
    ]
    for body in bodies:
        start = time.perf_counter()
        json_depth(body, 64)
        # linear: well under a second on any machine, busy or not; a quadratic scan of
        # 4 MB would take hours, so the bound can be generous
        assert time.perf_counter() - start < 10


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # in the body itself, the JSON decoder refuses it
        (CHAT, b'{"messages": [{"role": "user", "content": "a \\udfff b"}]}'),
        (COMPLETIONS, b'{"prompt": "\\ud800"}'),
        # inside a JSON string the server parses later (tool-call arguments)
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
            b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
            b'"arguments": "{\\"q\\": \\"\\\\ud800\\"}"}}]}, {"role": "tool", '
            b'"tool_call_id": "c1", "content": "1"}]}',
        ),
        (
            RESPONSES,
            b'{"input": [{"type": "function_call", "call_id": "c1", "name": "f", '
            b'"arguments": "{\\"q\\": \\"\\\\udfff\\"}"}, {"type": "function_call_output", '
            b'"call_id": "c1", "output": "12"}], "max_output_tokens": 4}',
        ),
    ],
)
async def test_an_unpaired_surrogate_escape_is_a_400_not_a_tokenizer_error(path, body):
    """Tokenizers take UTF-8, which cannot hold a lone surrogate (found by the fuzz suite:
    a Responses function_call's arguments reached the tokenizer and made a 500)."""
    async with client() as (c, _):
        r = await c.post(path, data=body, headers={"Content-Type": "application/json"})
        error = await openai_error(r, 400)
    assert error["code"] != "internal_error", error


def test_a_tiny_temperature_is_greedy():
    """Below 1e-5 (GREEDY_BELOW) the sampler's 1/T could overflow to inf: such a temperature
    is 0, greedy decoding, on every API (they all go through ``Validator.sampling``)."""
    from mlxd.daemon.api.common import GREEDY_BELOW, Validator
    from mlxd.protocol.messages import SamplingParams

    v = Validator(load_settings())
    for tiny, expected in ((1e-320, 0.0), (5e-324, 0.0), (GREEDY_BELOW / 2, 0.0), (0.1, 0.1)):
        assert v.sampling(SamplingParams(temperature=tiny)).temperature == expected


async def test_a_tiny_temperature_is_served_greedily_on_every_api():
    tiny = {"temperature": 1e-320}
    async with client() as (c, _):
        answers = [
            await c.post(CHAT, json={**chat(), **tiny}),
            await c.post(MESSAGES, json={**anthropic(), **tiny}),
            await c.post(RESPONSES, json={"input": "x", **tiny}),
        ]
    for r in answers:
        assert r.status_code == 200, await r.get_data()
