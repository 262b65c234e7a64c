"""max_tokens above what fits: clamped (the default) or refused, on every API.

The effective limit is the smallest of the request's value, ``engine.max_tokens_cap``,
the context left after the prompt and the memory budget; the answer then ends with
the API's length reason. The fake model answers the user turn upper-cased, one
token per character, so a long turn runs into whichever limit is lowest.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest
from mlxd.actors.tokenizer import PromptBuilder, PromptError
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings

from tests.conftest import running_graph, settings_with
from tests.fakes import CharTokenizer, fake_memory

CHAT = "/v1/chat/completions"
HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
# "<user>" + 30 characters + "<assistant>": a 47-token prompt; its answer is 30 tokens + EOS
TURN = "q" * 30
PROMPT = 47


@asynccontextmanager
async def client(settings=None, context_length=4096, memory=None):
    settings = settings or load_settings()
    graph = running_graph(settings, context_length=context_length, memory=memory)
    async with graph as (pipeline, _):
        yield create_app(pipeline, settings).test_client()


async def post(c, path, body, status=200):
    r = await c.post(path, json=body, headers=HEADERS)
    data = json.loads(await r.get_data())
    assert r.status_code == status, data
    return data


def chat(max_tokens, key="max_tokens", text=TURN):
    return {"messages": [{"role": "user", "content": text}], key: max_tokens}


# ---- chat: each limit in turn ---------------------------------------------------------------


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_above_the_context_left_is_clamped_to_it(key):
    async with client(context_length=PROMPT + 17) as c:
        body = await post(c, CHAT, chat(128_000, key))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Q" * 17
    assert body["usage"] == {**body["usage"], "prompt_tokens": PROMPT, "completion_tokens": 17}


async def test_above_the_cap_is_clamped_to_it():
    async with client(settings_with(engine={"max_tokens_cap": 8})) as c:
        body = await post(c, CHAT, chat(2**70))  # any integer: the cap is the limit
        fits = await post(c, CHAT, chat(8, text="hi"))
    assert body["choices"][0]["message"]["content"] == "Q" * 8
    assert body["choices"][0]["finish_reason"] == "length"
    assert fits["choices"][0]["finish_reason"] == "stop"


async def test_above_the_memory_budget_is_clamped_to_it_and_one_token_must_fit():
    memory = fake_memory(budget_bytes=(PROMPT + 10) * 1024)  # the prompt and 10 more tokens
    async with client(memory=memory) as c:
        body = await post(c, CHAT, chat(1000))
        err = await post(c, CHAT, chat(5, text="q" * 70), 400)  # its prompt alone is too big
    assert body["choices"][0]["message"]["content"] == "Q" * 10
    assert body["choices"][0]["finish_reason"] == "length"
    assert err["error"]["code"] == "request_too_large"


async def test_below_one_is_still_a_400():
    async with client() as c:
        zero = await post(c, CHAT, chat(0), 400)
        negative = await post(c, CHAT, chat(-5, "max_completion_tokens"), 400)
    assert zero["error"]["param"] == "max_tokens"
    assert negative["error"]["param"] == "max_completion_tokens"


# ---- the other APIs: their own length reasons -------------------------------------------


async def test_anthropic_max_tokens_is_clamped_and_stops_with_max_tokens():
    # Claude Code sends max_tokens 128000 with every request
    ask = {"messages": [{"role": "user", "content": TURN}], "max_tokens": 128_000}
    async with client(context_length=PROMPT + 12) as c:
        body = await post(c, "/v1/messages", ask)
    assert body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 12


async def test_responses_max_output_tokens_is_clamped_and_incomplete():
    async with client(settings_with(engine={"max_tokens_cap": 6})) as c:
        body = await post(c, "/v1/responses", {"input": TURN, "max_output_tokens": 500})
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 6


async def test_completions_max_tokens_is_clamped():
    async with client(context_length=40) as c:
        body = await post(c, "/v1/completions", {"prompt": "z" * 30, "max_tokens": 1000})
    assert body["choices"][0] == {**body["choices"][0], "text": "Z" * 10, "finish_reason": "length"}


# ---- refuse, as a setting ---------------------------------------------------------------------


async def test_refuse_setting_answers_400_for_each_limit():
    refuse = {"max_tokens_overflow": "refuse"}
    async with client(settings_with(engine={**refuse, "max_tokens_cap": 100})) as c:
        cap = await post(c, CHAT, chat(101), 400)
        anthropic = await post(c, "/v1/messages", {**chat(101), "max_tokens": 101}, 400)
    async with client(settings_with(engine=refuse), context_length=PROMPT + 17) as c:
        context = await post(c, CHAT, chat(18), 400)
        fits = await post(c, CHAT, chat(17))
    memory = fake_memory(budget_bytes=(PROMPT + 10) * 1024)
    async with client(settings_with(engine=refuse), memory=memory) as c:
        budget = await post(c, CHAT, chat(11), 400)
    assert cap["error"]["param"] == "max_tokens"
    assert "engine.max_tokens_cap" in cap["error"]["message"]
    assert "max_tokens" in anthropic["error"]["message"]
    assert context["error"]["param"] == "max_tokens" and "context" in context["error"]["message"]
    assert fits["choices"][0]["finish_reason"] == "length"
    assert budget["error"]["code"] == "request_too_large"


# ---- the builder alone ------------------------------------------------------------------------


def builder(clamp: bool, context: int = 100, memory=None) -> PromptBuilder:
    tokenizer = CharTokenizer()
    return PromptBuilder(
        tokenizer,
        context,
        default_max_tokens=50,
        vocab_size=0x110000,
        clamp_max_tokens=clamp,
        memory=memory,
    )


def test_builder_clamps_named_and_default_values_alike():
    b = builder(clamp=True, memory=fake_memory(budget_bytes=80 * 1024))
    assert b._max_tokens(60, 1000) == 20  # memory: 80 tokens in all
    assert b._max_tokens(60, None) == 20
    assert b._max_tokens(10, 30) == 30  # fits: as asked
    assert builder(clamp=True)._max_tokens(90, 1000) == 10  # the context


def test_builder_refuses_when_clamping_is_off():
    b = builder(clamp=False)
    assert b._max_tokens(60, None) == 40  # a default still shrinks
    assert b._max_tokens(60, 40) == 40
    with pytest.raises(PromptError, match="context is 100 tokens"):
        b._max_tokens(60, 41)
