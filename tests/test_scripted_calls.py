"""Calls in ``tool_choice: auto`` through the whole daemon, written by scripted models.

Each model wears Qwen3.5's real tokenizer and chat template (``<tool_call>`` is the
special token 248058) and writes one fixed answer greedily
(``scripts/tiny_models.build_script_model``: the next token is a function of the last
four). Tools are offered, thinking is off, and each answer is what a model would write
were it to go wrong in one way:

- prose, or a fenced code block, that spells ``<tool_call>`` in ordinary tokens: it stays
  prose (a call opens only on the special token);
- a call, then " Done.": with ``parallel_tool_calls: false`` the turn ends after the call;
- a call whose integer is ``1`` then ``0`` forever: the number ends within
  ``tokenizer.max_integer_digits`` and the call is whole.

Each test asks again with ``constrain_tool_calls: false`` (nothing holds what the model
writes) and shows what the grammar changed; on the code before these rules (e94b477^)
each test fails. ``running_graph`` asserts the engine idle after each daemon.
"""

from __future__ import annotations

import json
from functools import cache

import jsonschema
import pytest

from tests.test_openai_features import post_json, read_stream
from tests.test_real_tokenizers_daemon import daemon

pytestmark = pytest.mark.mlx

OPEN, CLOSE, END = 248058, 248059, 248046  # <tool_call>, </tool_call>, <|im_end|>
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMS}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_HEAD = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"

PROSE = " The tag <tool_call> opens a call."
FENCE = "```\n<tool_call>\n```"
SCRIPTS = {  # name → the answer: text in ordinary tokens, ints as token ids
    "prose": [PROSE, END],
    "fence": [FENCE, END],
    "call_then_text": [OPEN, CALL_HEAD + "3\n</parameter>\n</function>\n", CLOSE, " Done.", END],
    "digits": [OPEN, CALL_HEAD + "1", "0", "0", "0", "0"],  # then "0" forever
}
# Where the grammar ends the number, it writes the call's closing markup (in the tokens the
# vocabulary has for it); this model then ends the turn, as a model that meant one call would.
AFTER_CLOSING = ("</function>\n", [CLOSE, END])


@cache
def _tokenizer():
    from mlxd.scripts import real_tokenizers as rt
    from transformers import AutoTokenizer

    from tests import templates

    templates.template_dir()  # a skip where the templates are not installed
    tokenizer_dir = rt.build_real_tokenizer_model("qwen35")
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = hf.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<|im_end|>"])
    assert ids == [OPEN, CLOSE, END], ids
    return rt.ordinary_tokens(tokenizer_dir), hf


def _tail() -> list[int]:
    """The prompt's last four tokens: ``<think>\\n\\n</think>\\n\\n`` (thinking off)."""
    _, hf = _tokenizer()
    ids = hf.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, enable_thinking=False, tokenize=True
    )
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert hf.decode(ids[-4:]) == "<think>\n\n</think>\n\n", hf.decode(ids[-4:])
    return ids[-4:]


def scripted(name: str) -> tuple[object, list[int]]:
    """The model directory that writes ``SCRIPTS[name]``, and the answer's token ids."""
    from mlxd.scripts import real_tokenizers as rt

    vocab, hf = _tokenizer()
    answer = rt.spell(vocab, _tail(), SCRIPTS[name])
    scripts = [(_tail(), answer)]
    if name == "digits":
        text, then = AFTER_CLOSING
        scripts.append((hf.encode(text, add_special_tokens=False), then))
    return rt.build_scripted_model("qwen35", *scripts), answer


def _body(**extra) -> dict:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "auto", "temperature": 0}
    return body | {"max_tokens": 64, "reasoning_effort": "none", "logprobs": True, **extra}


async def _chat(d, **extra) -> dict:
    return (await post_json(d.client, "/v1/chat/completions", _body(**extra)))["choices"][0]


async def _messages(d, **extra) -> dict:
    body = {"model": "m", "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 64}
    body |= {"temperature": 0, "thinking": {"type": "disabled"}, **extra}
    return await post_json(d.client, "/v1/messages", body)


def _written(choice: dict) -> list[str]:
    return [p["token"] for p in choice["logprobs"]["content"]]


def _texts(answer: list[int]) -> list[str]:
    _, hf = _tokenizer()
    return [hf.decode([t]) for t in answer if t != END]


def _arguments(choice: dict) -> list[dict]:
    calls = choice["message"].get("tool_calls") or ()
    assert all(c["function"]["name"] == "get_weather" for c in calls), calls
    return [json.loads(c["function"]["arguments"]) for c in calls]


# ---- a call opens only on the special token ----------------------------------------------


async def test_prose_that_spells_the_tag_stays_prose(tmp_path):
    """`` <``, ``tool``, ``_call``, ``>`` are ordinary tokens: no call opens, the model writes
    its sentence to the end (chat and Anthropic). Opened on the text (as before), the
    grammar would have forced a call on it and cut the prose."""
    model, answer = scripted("prose")
    assert OPEN not in answer
    async with daemon(model, tmp_path) as d:
        choice = await _chat(d)
        assert choice["message"]["content"] == PROSE
        assert not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "stop"
        assert _written(choice) == _texts(answer)  # the model's own tokens, none masked
        message = await _messages(d)
        assert [(b["type"], b["text"]) for b in message["content"]] == [("text", PROSE)]
        assert message["stop_reason"] == "end_turn"
        # nothing constrained: the same (the parser reads text, and gives back as content a
        # call that does not parse)
        free = await _chat(d, constrain_tool_calls=False)
        assert (free["message"]["content"], free["finish_reason"]) == (PROSE, "stop")
        assert not free["message"].get("tool_calls")


async def test_a_fenced_tag_stays_prose(tmp_path):
    """The tag on its own line inside a code fence, in ordinary tokens: prose."""
    model, answer = scripted("fence")
    async with daemon(model, tmp_path) as d:
        choice = await _chat(d)
        assert (choice["message"]["content"], choice["finish_reason"]) == (FENCE, "stop")
        assert not choice["message"].get("tool_calls")
        assert _written(choice) == _texts(answer)
        free = await _chat(d, constrain_tool_calls=False)
        assert (free["message"]["content"], free["finish_reason"]) == (FENCE, "stop")


# ---- after a call: another call or the end ------------------------------------------------


async def test_no_text_after_a_call(tmp_path):
    """The model writes a call, then " Done.": with ``parallel_tool_calls: false`` the turn
    ends at ``</tool_call>`` (chat, streamed chat, Anthropic). Free, " Done." is content."""
    model, answer = scripted("call_then_text")
    async with daemon(model, tmp_path) as d:
        choice = await _chat(d, parallel_tool_calls=False)
        assert _arguments(choice) == [{"city": "Paris", "days": 3}]
        assert not choice["message"]["content"]
        assert choice["finish_reason"] == "tool_calls"
        written = _written(choice)
        assert written[0] == "<tool_call>" and written[-1] == "</tool_call>", written
        frames = _sse(await read_stream(d.client, "/v1/chat/completions", _stream_body()))
        content = "".join(
            c["delta"].get("content") or "" for f in frames for c in f.get("choices") or ()
        )
        reasons = [c["finish_reason"] for f in frames for c in f.get("choices") or ()]
        assert "Done" not in content and "tool_calls" in reasons, (content, reasons)
        message = await _messages(
            d, tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        )
        assert [b["type"] for b in message["content"]] == ["tool_use"], message["content"]
        assert message["content"][0]["input"] == {"city": "Paris", "days": 3}
        assert message["stop_reason"] == "tool_use"
        # nothing constrained: the call, then the model's text after it as content
        free = await _chat(d, parallel_tool_calls=False, constrain_tool_calls=False)
        assert _arguments(free) == [{"city": "Paris", "days": 3}]
        assert free["message"]["content"] == " Done."
        assert _written(free) == _texts(answer)


def _stream_body() -> dict:
    body = _body(parallel_tool_calls=False)
    del body["logprobs"]
    return body


def _sse(raw: bytes) -> list[dict]:
    return [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")]


# ---- numbers are bounded -----------------------------------------------------------------


async def _digits_call(d) -> dict:
    return await _chat(d, max_tokens=200)


async def test_digits_without_end_end_the_number(tmp_path):
    """The model writes ``days`` as ``1`` then ``0`` forever: the grammar ends the number, and
    the call is whole, valid for the schema, and the turn's end (``tool_calls``, not
    ``length``). Free, the limit cuts the call: ``days`` is lost."""
    model, _ = scripted("digits")
    async with daemon(model, tmp_path) as d:
        choice = await _digits_call(d)
        assert choice["finish_reason"] == "tool_calls"
        (arguments,) = _arguments(choice)
        jsonschema.validate(arguments, PARAMS)
        days = arguments["days"]
        assert arguments["city"] == "Paris"
        assert str(days).rstrip("0") == "1" and days < 2**63, days  # an int64 holds it
        written = _written(choice)
        assert written[-1] == "</tool_call>" and len(written) < 100, written
        free = await _chat(d, max_tokens=200, constrain_tool_calls=False)
        assert free["finish_reason"] == "length"
        assert [a.get("days") for a in _arguments(free)] == [None], free["message"]


async def test_an_integer_has_at_most_max_integer_digits(tmp_path):
    """``tokenizer.max_integer_digits`` (18): the number the model would write forever ends
    with at most 18 digits."""
    model, _ = scripted("digits")
    async with daemon(model, tmp_path) as d:
        (arguments,) = _arguments(await _digits_call(d))
        assert len(str(arguments["days"])) <= 18, arguments
