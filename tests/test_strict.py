"""``strict: true`` on a tool: a schema OpenAI's strict mode takes, and arguments exactly it.

A schema strict mode cannot take is a 400 in the API's own error format naming the rule
and where it broke (chat, legacy functions, Responses, Anthropic); a strict tool's call
holds exactly the schema's keys, forced or in auto mode (``tests/fakes.GrammarRunner``).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from mlxd.actors.grammar import strict_schema_error

from tests.test_lazy_calls import lazy_client
from tests.test_openai_features import post_json

STRICT = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "when": {
            "type": "object",
            "properties": {"day": {"type": "integer"}},
            "required": ["day"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "when"],
    "additionalProperties": False,
}
ADDITIONAL = "'additionalProperties' is required to be supplied and to be false."
REQUIRED = "'required' is required to be supplied and to be an array including every key"


def _without(path: list[str], key: str) -> dict:
    """STRICT with ``key`` dropped from the object at ``path``."""
    schema = json.loads(json.dumps(STRICT))
    node = schema
    for p in path:
        node = node[p]
    del node[key]
    return schema


def _with(path: list[str], key: str, value) -> dict:
    schema = json.loads(json.dumps(STRICT))
    node = schema
    for p in path:
        node = node[p]
    node[key] = value
    return schema


# (schema, the rule's words, the context OpenAI names)
BROKEN = {
    "required missing": (_without([], "required"), REQUIRED, "()"),
    "a property not required": (_with([], "required", ["city"]), "Missing 'when'", "()"),
    "additionalProperties absent": (_without([], "additionalProperties"), ADDITIONAL, "()"),
    "additionalProperties true": (_with([], "additionalProperties", True), ADDITIONAL, "()"),
    "nested additionalProperties": (
        _without(["properties", "when"], "additionalProperties"),
        ADDITIONAL,
        "('properties', 'when')",
    ),
    "nested required": (
        _without(["properties", "when"], "required"),
        REQUIRED,
        "('properties', 'when')",
    ),
    "in an array's items": (
        _with(
            ["properties"],
            "tags",
            {"type": "array", "items": {"type": "object", "properties": {}}},
        )
        | {"required": ["city", "when", "tags"]},
        ADDITIONAL,
        "('properties', 'tags', 'items')",
    ),
}


def test_the_strict_rules_and_their_context():
    assert strict_schema_error(STRICT) is None
    for schema, words, context in BROKEN.values():
        error = strict_schema_error(schema)
        assert error is not None and words in error and f"context={context}" in error, error
    assert 'type: "object"' in (strict_schema_error({"type": "string"}) or "")


def _chat(parameters: dict, legacy: bool = False) -> dict:
    function = {"name": "book", "parameters": parameters, "strict": True}
    tools = (
        {"functions": [function]}
        if legacy
        else {"tools": [{"type": "function", "function": function}]}
    )
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **tools}


@pytest.mark.parametrize("case", sorted(BROKEN))
async def test_a_schema_strict_cannot_take_is_a_400_in_each_api(case):
    schema, words, context = BROKEN[case]
    bodies = {
        "/v1/chat/completions": (_chat(schema), "tools[0].function.parameters"),
        "/v1/chat/completions legacy": (_chat(schema, legacy=True), "functions[0].parameters"),
        "/v1/responses": (
            {
                "input": "hi",
                "tools": [
                    {"type": "function", "name": "book", "parameters": schema, "strict": True}
                ],
            },
            "tools[0].parameters",
        ),
        "/v1/messages": (
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [
                    {"name": "other", "input_schema": {"type": "object"}},
                    {"name": "book", "input_schema": schema, "strict": True},
                ],
            },
            "tools[1].input_schema",
        ),
    }
    if words != ADDITIONAL:  # Anthropic's strict tools take optional properties
        anthropic = bodies.pop("/v1/messages")[0]
    async with lazy_client() as c:
        if words != ADDITIONAL:
            r = await c.post("/v1/messages", json=anthropic)
            assert r.status_code == 200, await r.get_data()
        for route, (body, param) in bodies.items():
            r = await c.post(route.split()[0], json=body)
            assert r.status_code == 400, route
            err = json.loads(await r.get_data())
            message = err["error"]["message"]
            assert words in message and f"context={context}" in message, (route, message)
            assert "Invalid schema for function 'book'" in message
            if route == "/v1/messages":
                assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
                assert param in message or set(err["error"]) == {"type", "message"}
            else:
                assert err["error"]["param"] == param, route
        fine = await c.post("/v1/chat/completions", json=_chat(STRICT))
        loose = await c.post("/v1/chat/completions", json=_chat(_without([], "required")) | {})
    assert fine.status_code == 200
    assert loose.status_code == 400


# The model adds a key the schema does not have, at both levels, and leaves one out.
SCRIPT = (
    'Booking. <tool_call>\n{"name": "book", "arguments": {"city": "Oslo", "extra": 1, '
    '"when": {"day": 3, "hour": 9}}}\n</tool_call>'
)


def _strict_chat(choice) -> dict:
    function = {"name": "book", "parameters": STRICT, "strict": True}
    return {
        "messages": [{"role": "user", "content": f"@@{SCRIPT}@@"}],
        "tools": [{"type": "function", "function": function}],
        "tool_choice": choice,
        "max_tokens": 300,
    }


@pytest.mark.parametrize("choice", ["auto", "required"])
async def test_a_strict_tools_arguments_are_exactly_its_schema(choice):
    """Auto mode with the server's setting off: ``strict: true`` holds the call anyway."""
    async with lazy_client(constrain_auto_calls=False) as c:
        r = await post_json(c, "/v1/chat/completions", _strict_chat(choice))
        loose = _strict_chat(choice)
        del loose["tools"][0]["function"]["strict"]
        free = await post_json(c, "/v1/chat/completions", loose)
    args = json.loads(r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(args, STRICT)
    assert set(args) == {"city", "when"} and set(args["when"]) == {"day"}
    if choice == "auto":  # not strict, setting off: as the model wrote it
        written = free["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        assert json.loads(written)["extra"] == 1
