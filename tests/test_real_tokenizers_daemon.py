"""Real family tokenizers through the whole daemon, in every API.

Tiny random-weight models wear Qwen3.5's and DeepSeek V4's real tokenizers
(``scripts/real_tokenizers.py``) with their families' templates: the markers are the
real single added tokens at their real ids. What a random model writes is noise but
for what mlxd constrains, so each test checks what mlxd adds: forced calls in the
family's markup, calls constrained once the model opens one (``tool_choice: auto``:
the model is pushed into the opener token by a logit bias), the split of reasoning
from the answer, and an earlier call and its result rendered back through the
template as single added tokens.

Only chat takes ``logit_bias``; for the other APIs the test's ``lean`` shim sets the
same sampling fields on the requests they submit (what a model that leans towards
the opener would do by itself).
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import msgspec
import pytest
from mlxd.daemon.app import create_app

from tests.conftest import running_graph, settings_with
from tests.test_openai_features import post_json, read_stream

pytestmark = pytest.mark.mlx

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMS}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# kind → (the call opener, every marker of its call markup, the reasoning tags)
KINDS = {
    "qwen35": ("<tool_call>", ("<tool_call>", "</tool_call>"), ("<think>", "</think>")),
    "deepseek_v4": (
        "<｜tool▁calls▁begin｜>",
        (
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ),
        ("<think>", "</think>"),
    ),
}
MARKUP = (
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<parameter=",
    "｜tool",
    "<think>",
    "</think>",
)


@dataclass
class Daemon:
    """The daemon on one model: its test client, the model's tokenizer, the requests the
    APIs submitted, and ``lean``: sampling fields set on every request they submit."""

    client: Any
    hf: Any
    pipeline: Any
    lean: dict = field(default_factory=dict)
    submitted: list = field(default_factory=list)

    def token_id(self, marker: str) -> int:
        ids = self.hf.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, (marker, ids)  # one added token
        return ids[0]


@asynccontextmanager
async def daemon(model_dir, tmp_path):
    from mlxd.daemon.supervisor import mlx_runner_factory
    from transformers import AutoTokenizer

    settings = settings_with(model={"path": str(model_dir), "cache_dir": str(tmp_path)})
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, _):
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        d = Daemon(create_app(pipeline, settings).test_client(), hf, pipeline)
        submit = pipeline.submit

        async def leaning(request, bell=None):
            if d.lean:
                sampling = msgspec.structs.replace(request.sampling, **d.lean)
                request = msgspec.structs.replace(request, sampling=sampling)
            d.submitted.append(request)
            return await submit(request, bell)

        pipeline.submit = leaning
        yield d


def _clean(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


def _valid(arguments: str | dict) -> dict:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, PARAMS)
    return value


def _sse(raw: bytes) -> list[dict]:
    lines = raw.decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def _streamed_chat_call(raw: bytes) -> tuple[str, str, str]:
    """(content, the first call's name, its arguments) from a streamed chat answer."""
    content, name, arguments = "", "", ""
    for frame in _sse(raw):
        for choice in frame.get("choices") or ():
            delta = choice["delta"]
            content += delta.get("content") or ""
            for t in delta.get("tool_calls") or ():
                if t["index"] == 0:
                    name += t["function"].get("name") or ""
                    arguments += t["function"].get("arguments") or ""
    return content, name, arguments


async def _every_api(c, extra: dict) -> dict:
    """One request in each API (``extra``: each API's own fields, by API)."""
    chat = {"messages": ASK, "tools": TOOLS, "max_tokens": 48, "temperature": 0}
    chat |= extra.get("chat", {})
    responses = {"input": ASK[0]["content"], "tools": RESPONSES_TOOLS, "max_output_tokens": 48}
    responses |= {"temperature": 0, **extra.get("responses", {})}
    anthropic = {"model": "m", "max_tokens": 48, "messages": ASK, "tools": ANTHROPIC_TOOLS}
    anthropic |= {"temperature": 0, **extra.get("anthropic", {})}
    ollama = {"model": "m", "messages": ASK, "tools": TOOLS, "stream": False}
    ollama |= {"options": {"num_predict": 48, "temperature": 0}, **extra.get("ollama", {})}
    out = {
        "chat": await post_json(c, "/v1/chat/completions", chat),
        "chat_stream": await read_stream(c, "/v1/chat/completions", chat),
        "responses": await post_json(c, "/v1/responses", responses),
        "anthropic": await post_json(c, "/v1/messages", anthropic),
        "anthropic_stream": await read_stream(c, "/v1/messages", anthropic),
    }
    if "ollama" in extra:
        out["ollama"] = await post_json(c, "/api/chat", ollama)
    return out


def _check_calls(got: dict) -> None:
    """Each API returned a structured call valid for the schema, no markup in the text."""
    message = got["chat"]["choices"][0]["message"]
    _clean(message["content"])
    (call, *_) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    whole = _valid(call["function"]["arguments"])
    content, name, arguments = _streamed_chat_call(got["chat_stream"])
    _clean(content)
    assert (name, json.loads(arguments)) == ("get_weather", whole)  # greedy: the same call
    items = [i for i in got["responses"]["output"] if i["type"] == "function_call"]
    assert items and items[0]["name"] == "get_weather"
    _valid(items[0]["arguments"])
    for i in got["responses"]["output"]:
        for part in i.get("content") or ():
            _clean(part.get("text"))
    uses = [b for b in got["anthropic"]["content"] if b["type"] == "tool_use"]
    assert uses and uses[0]["name"] == "get_weather"
    _valid(uses[0]["input"])
    _clean(" ".join(b.get("text", "") for b in got["anthropic"]["content"]))
    frames = _sse(got["anthropic_stream"])
    partial = "".join(
        f["delta"].get("partial_json", "") for f in frames if f["type"] == "content_block_delta"
    )
    assert partial.startswith("{")
    if "ollama" in got:
        message = got["ollama"]["message"]
        _clean(message["content"])
        (call, *_) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        _valid(call["function"]["arguments"])


@pytest.mark.parametrize("kind", list(KINDS))
async def test_the_family_markup_through_every_api(kind, real_tokenizer_model, tmp_path):
    """One daemon per tokenizer (loading a 129k / 248k vocabulary is the slow part)."""
    async with daemon(real_tokenizer_model(kind), tmp_path) as d:
        await forced_calls(d, kind)
        await calls_constrained_once_opened(d, kind)
        await reasoning_split(d)
        await history_round_trip(d, kind)
        await a_cut_call(d, kind)


# ---- forced calls ------------------------------------------------------------------------

NO_THINKING = {  # each API's way to ask for no reasoning (Qwen3.5 thinks by default)
    "chat": {"reasoning_effort": "none"},
    "responses": {"reasoning": {"effort": "none"}},
    "anthropic": {"thinking": {"type": "disabled"}},
    "ollama": {"think": False},
}


def _with(fields: dict) -> dict:
    return {api: {**NO_THINKING[api], **fields.get(api, {})} for api in fields}


async def forced_calls(d: Daemon, kind: str) -> None:
    """``tool_choice: required`` / a named tool: the call in the family's markup, each
    marker its single added token (the logprobs show the tokens the model wrote)."""
    opener, markers, _ = KINDS[kind]
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = await _every_api(
        d.client,
        _with(
            {
                "chat": {"tool_choice": "required"},
                "responses": {"tool_choice": "required"},
                "anthropic": {"tool_choice": {"type": "any"}},
            }
        ),
    )
    _check_calls(got)
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": 48}
    body |= {"temperature": 0, "logprobs": True, **NO_THINKING["chat"]}
    choice = (await post_json(d.client, "/v1/chat/completions", body))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    _valid(choice["message"]["tool_calls"][0]["function"]["arguments"])
    written = [p["token"] for p in choice["logprobs"]["content"]]
    for marker in markers:
        d.token_id(marker)
    assert written[0] == opener, written  # one token, not spelled out
    assert {m for m in written if m in markers} >= {opener}, written


# ---- calls constrained once opened (auto mode) ------------------------------------------


async def calls_constrained_once_opened(d: Daemon, kind: str) -> None:
    """``tool_choice: auto``: the random model, pushed into the opener token, writes noise
    after it but for the lazy grammar, which makes it a call valid for the schema."""
    opener = d.token_id(KINDS[kind][0])
    chat = {"logit_bias": {str(opener): 100}, "parallel_tool_calls": False}
    chat_got = await _every_api(d.client, _with({"chat": chat}))
    d.lean["logit_bias"] = {opener: 100.0}
    got = await _every_api(
        d.client,
        _with(
            {
                "responses": {"parallel_tool_calls": False},
                "anthropic": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                "ollama": {},
            }
        ),
    )
    d.lean.clear()
    _check_calls({**got, "chat": chat_got["chat"], "chat_stream": chat_got["chat_stream"]})
    # the request's constrain_tool_calls: false opts out: nothing holds what follows the opener
    body = {"messages": ASK, "tools": TOOLS, "logit_bias": {str(opener): 100}}
    body["constrain_tool_calls"] = False
    body |= {"max_tokens": 24, "temperature": 0, **NO_THINKING["chat"]}
    message = (await post_json(d.client, "/v1/chat/completions", body))["choices"][0]["message"]
    calls = message.get("tool_calls") or ()
    assert not any(_is_valid(c["function"]["arguments"]) for c in calls), calls


def _is_valid(arguments: str) -> bool:
    try:
        _valid(arguments)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- reasoning --------------------------------------------------------------------------


def _reasoning(got: dict) -> dict[str, tuple[str, str]]:
    """Each API's (reasoning, answer text)."""
    chat = got["chat"]["choices"][0]["message"]
    out = {"chat": (chat.get("reasoning_content") or "", chat["content"] or "")}
    r = got["responses"]["output"]
    out["responses"] = (
        "".join(p["text"] for i in r if i["type"] == "reasoning" for p in i.get("content") or ()),
        "".join(p["text"] for i in r if i["type"] == "message" for p in i["content"]),
    )
    a = got["anthropic"]["content"]
    out["anthropic"] = (
        "".join(b["thinking"] for b in a if b["type"] == "thinking"),
        "".join(b["text"] for b in a if b["type"] == "text"),
    )
    o = got["ollama"]["message"]
    out["ollama"] = (o.get("thinking") or "", o["content"])
    return out


THINKING = {
    "chat": {"reasoning_effort": "high", "tools": [], "logprobs": True},
    "responses": {"reasoning": {"effort": "high"}, "tools": []},
    "anthropic": {
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [],
        "max_tokens": 2048,
    },
    "ollama": {"think": True, "tools": []},
}


async def reasoning_split(d: Daemon) -> None:
    """Thinking on: the prompt ends in ``<think>`` (one token); what the model writes up to
    ``</think>`` (one token, which a bias makes likely at a seeded draw) is reasoning in
    every API, what follows is the answer; neither tag reaches the text."""
    close = d.token_id("</think>")
    chat = {"messages": ASK, **THINKING["chat"], "max_tokens": 16}
    split = None
    added = set(d.hf.get_added_vocab()) - {"</think>"}  # hidden from the text: avoided
    draws = [(bias, seed) for bias in (8.0, 10.0) for seed in range(8)]
    for bias, seed in draws:  # a draw that closes the reasoning once, after some text
        d.lean.update(logit_bias={close: bias}, seed=seed, temperature=1.0)
        choice = (await post_json(d.client, "/v1/chat/completions", chat))["choices"][0]
        tokens = [p["token"] for p in choice["logprobs"]["content"]]
        once = tokens.count("</think>") == 1 and 0 < tokens.index("</think>") < len(tokens) - 1
        if once and not added & set(tokens):
            split = tokens
            break
    assert split is not None, "no seed closed the reasoning"
    d.lean["max_tokens"] = 16
    got = await _every_api(d.client, THINKING)
    d.lean.clear()
    at = split.index("</think>")
    want = ("".join(split[:at]).strip(), "".join(split[at + 1 :]).strip())
    for api, (reasoning, answer) in _reasoning(got).items():
        assert (reasoning.strip(), answer.strip()) == want, api
        _clean(reasoning)
        _clean(answer)


# ---- an earlier call and its result, sent back -------------------------------------------

ARGS = {"city": "Paris", "days": 2}
RESULT = "Sunny, 21 C"
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
}
HISTORIES = {
    "chat": [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ],
    "anthropic": [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}],
        },
    ],
    "responses": [
        {"role": "user", "content": ASK[0]["content"]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": json.dumps(ARGS),
        },
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
    ],
    "ollama": [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": ARGS}}],
        },
        {"role": "tool", "content": RESULT},
    ],
}


async def history_round_trip(d: Daemon, kind: str) -> None:
    """An assistant call and its result in the history: every API renders them through the
    template into the same prompt tokens, each marker its one added token."""
    _, markers, _ = KINDS[kind]
    small = {"max_tokens": 2, "temperature": 0}
    d.submitted.clear()
    c = d.client
    bodies = {
        "chat": {"messages": HISTORIES["chat"], "tools": TOOLS, **small},
        "responses": {"input": HISTORIES["responses"], "tools": RESPONSES_TOOLS},
        "anthropic": {"model": "m", "messages": HISTORIES["anthropic"], **small},
        "ollama": {"model": "m", "messages": HISTORIES["ollama"], "tools": TOOLS},
    }
    bodies["responses"]["max_output_tokens"] = 2
    bodies["anthropic"]["tools"] = ANTHROPIC_TOOLS
    bodies["ollama"] |= {"stream": False, "options": {"num_predict": 2}}
    await post_json(c, "/v1/chat/completions", bodies["chat"])
    await post_json(c, "/v1/responses", bodies["responses"])
    await post_json(c, "/v1/messages", bodies["anthropic"])
    await post_json(c, "/api/chat", bodies["ollama"])
    builder = d.pipeline.builder
    prompts = [builder.tokens(r) for r in d.submitted]
    assert len(prompts) == 4 and all(p == prompts[0] for p in prompts[1:])
    ids = prompts[0]
    written = [m for m in markers if d.token_id(m) in ids]
    assert written and written[0] == KINDS[kind][0], written  # the call, opener first
    text = d.hf.decode(ids)
    assert RESULT in text and "Paris" in text
    # what a spelled-out marker would have been is not there: each is its added token
    for marker in written:
        spelled = d.hf.encode(marker[:2], add_special_tokens=False)
        assert not _contains(ids, spelled + d.hf.encode(marker[2:], add_special_tokens=False))


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


# ---- a call cut by the limit ------------------------------------------------------------


async def a_cut_call(d: Daemon, kind: str) -> None:
    """The limit cuts the call the model opened (``actors/families/cut.py``): every API
    returns it incomplete, with what was complete of its arguments, and no markup."""
    opener = d.token_id(KINDS[kind][0])
    d.lean.update(logit_bias={opener: 100.0}, max_tokens=14)
    got = await _every_api(
        d.client, _with({"chat": {}, "responses": {}, "anthropic": {}, "ollama": {}})
    )
    d.lean.clear()
    choice = got["chat"]["choices"][0]
    assert choice["finish_reason"] == "length"
    _clean(choice["message"]["content"])
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    (item,) = [i for i in got["responses"]["output"] if i["type"] == "function_call"]
    assert (item["status"], item["arguments"]) == ("incomplete", call["function"]["arguments"])
    assert got["anthropic"]["stop_reason"] == "max_tokens"
    (use,) = [b for b in got["anthropic"]["content"] if b["type"] == "tool_use"]
    assert all(PARAMS["properties"][k] for k in use["input"])  # only the schema's keys
    partial = "".join(
        f["delta"].get("partial_json", "")
        for f in _sse(got["anthropic_stream"])
        if f["type"] == "content_block_delta"
    )
    assert isinstance(json.loads(partial), dict)  # closed where the limit cut it
    assert got["ollama"]["done_reason"] == "length"
    (o_call,) = got["ollama"]["message"]["tool_calls"]
    assert o_call["function"]["arguments"] == use["input"]
    for api in ("responses", "anthropic", "ollama"):
        _clean(json.dumps(got[api], ensure_ascii=False).replace("<think>", ""))
