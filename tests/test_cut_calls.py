"""A call cut by ``max_tokens`` comes back as an incomplete call, never as markup in content
(``actors/families/cut.py``).

Every format's call (as its template writes it: ``test_forced_calls.SAMPLES``) is cut at
every character: what the parser gives back holds no marker as content, and a call cut
after its name is returned incomplete, with arguments that agree with the whole call's.
Then the whole daemon over the scripted fake model, whose ``max_tokens`` cuts the call,
in chat, Responses, Anthropic Messages and Ollama, whole and streamed.
"""

from __future__ import annotations

import json

import pytest
from mlxd.actors.families import cut, formats
from mlxd.actors.families.output import OutputParser
from mlxd.protocol.messages import OutputSpec

from tests import templates
from tests.test_family_apis import family_client
from tests.test_forced_calls import ARGS, BOOK, HIDDEN, SAMPLES
from tests.test_openai_features import post_json, read_stream

# ---- partial JSON ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ('{"a": 1, "b": "x"}', {"a": 1, "b": "x"}),
        ('{"a": 1, "b": "x"', {"a": 1, "b": "x"}),
        ('{"a": 1, "b": "x', {"a": 1}),
        ('{"a": 1, "b": 12', {"a": 1}),  # the number may have been growing
        ('{"a": 1, "b": 12,', {"a": 1, "b": 12}),
        ('{"a": {"c": [1, 2]}, "b": [3', {"a": {"c": [1, 2]}}),
        ('{"a": "1, 2", "b', {"a": "1, 2"}),
        ('{"a": "q\\"", "b": ', {"a": 'q"'}),
        ('{"a": true', {"a": True}),
        ('{"a": tr', {}),
        ("{", {}),
        ("", {}),
        ('{"a": 1}}', {"a": 1}),  # a whole object, then what closed the call
    ],
)
def test_complete_fields_keeps_the_members_written_whole(text, fields):
    assert cut.complete_fields(text) == fields


@pytest.mark.parametrize(
    "text",
    ['{"a": 1, "b": "x', '{"a": 1, "b', '{"a": 1, "b":', '{"a": [1, ', '{"a": {"c": "d', "{", ""],
)
def test_close_json_makes_a_partial_object_parse(text):
    value = json.loads(text + cut.close_json(text))
    assert isinstance(value, dict)


# ---- every format, cut at every character ----------------------------------------------


def _feed(fmt: str, text: str) -> tuple[OutputParser, str, list[list]]:
    spec = OutputSpec(tool_format=fmt, tools=(BOOK,))
    ids = iter(range(1000))
    parser = OutputParser(spec, lambda: f"call_{next(ids)}")
    out = parser.feed(text.replace(HIDDEN.get(fmt, "\0"), ""))
    out.extend(parser.flush(cut=True))
    calls: list[list] = []  # [name, arguments, incomplete]
    for piece in out.calls:
        if piece.name is not None:
            calls.append([piece.name, "", False])
        calls[-1][1] += piece.arguments
        calls[-1][2] |= piece.incomplete
    return parser, out.content, calls


LEADING = {"json", "llama3", "functionary_v3_2"}  # no marker: a cut object may be content


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_a_call_cut_anywhere_leaves_no_markup_in_content(fmt):
    sample = SAMPLES[fmt]
    shown = [m for m in formats.named(fmt).show if m in sample]
    for n in range(1, len(sample)):
        parser, content, calls = _feed(fmt, sample[:n])
        assert not any(m in content for m in shown), (n, content)
        if fmt not in LEADING:
            assert sample[:n].replace(HIDDEN.get(fmt, "\0"), "").startswith(content), (n, content)
        for name, arguments, incomplete in calls:
            assert name == "book" and incomplete, (n, calls)
            fields = cut.complete_fields(arguments)
            assert all(ARGS[k] == v for k, v in fields.items()), (n, arguments)
        assert parser.cut_call == (0 if calls else None)


@pytest.mark.parametrize("fmt", sorted({*(f.name for f in formats.BY_NAME.values() if f.calls.cut), "harmony", "functionary_v3_2"} & set(SAMPLES)))
def test_a_call_cut_after_its_name_comes_back_incomplete(fmt):
    sample = SAMPLES[fmt]
    parser, content, calls = _feed(fmt, sample[:-1])
    assert not content.strip()
    ((name, arguments, incomplete),) = calls
    assert (name, incomplete) == ("book", True)
    fields = cut.complete_fields(arguments)
    assert {"city", "nights"} <= set(fields) and all(ARGS[k] == v for k, v in fields.items())
    # a whole call is not incomplete, cut or not
    parser, content, calls = _feed(fmt, sample)
    assert calls and not calls[0][2] and parser.cut_call is None


def test_a_cut_before_the_name_is_complete_returns_no_call_and_drops_the_markup():
    for text in ('Sure. <tool_call>\n{"name": "bo', "Sure. <tool_call>\n<function=bo"):
        fmt = "hermes" if "{" in text else "qwen3_coder"
        parser, content, calls = _feed(fmt, text)
        assert (content, calls, parser.cut_call) == ("Sure. ", [], None)


def test_whole_calls_before_the_cut_one_stay_whole():
    call = SAMPLES["deepseek_v3"].removesuffix("<｜tool▁calls▁end｜>")
    text = call + call.removeprefix("<｜tool▁calls▁begin｜>")[:-30]  # cut in the second one
    parser, content, calls = _feed("deepseek_v3", text)
    assert content == "" and parser.cut_call == 1
    assert [(n, i) for n, _, i in calls] == [("book", False), ("book", True)]
    assert json.loads(calls[0][1]) == ARGS


def test_without_the_limit_the_unfinished_markup_is_content_as_before():
    spec = OutputSpec(tool_format="hermes", tools=(BOOK,))
    parser = OutputParser(spec)
    out = parser.feed('<tool_call>\n{"name": "bo')
    out.extend(parser.flush())
    assert out.content == '<tool_call>\n{"name": "bo' and not out.calls


# ---- the whole daemon, every API -------------------------------------------------------

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
CUTS = {  # template → (what the model writes, cut where, the call's chat arguments)
    "Qwen3-Coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<parameter=days>\n",
        '{"city": "Paris"}',
    ),
    "deepseek-ai-DeepSeek-V3.1": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '"Paris"',
        '{"city": "Paris"',
    ),
    "Qwen-Qwen3-0.6B": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>',
        '"Paris"',
        '{"city": "Paris"',
    ),
}


def _at(text: str, where: str) -> int:
    """The token (character) count that cuts the output right after ``where``'s last end."""
    return text.rindex(where) + len(where)


async def _all_apis(c, text: str, limit: int) -> dict:
    user = [{"role": "user", "content": "!" + text}]
    chat = {"messages": user, "tools": TOOLS, "max_tokens": limit}
    anthropic = {
        "model": "m",
        "max_tokens": limit,
        "messages": user,
        "tools": [{"name": "get_weather", "input_schema": PARAMS}],
    }
    responses = {
        "input": "!" + text,
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        "max_output_tokens": limit,
    }
    ollama = {"model": "m", "messages": user, "tools": TOOLS, "options": {"num_predict": limit}}
    return {
        "chat": await post_json(c, "/v1/chat/completions", chat),
        "chat_stream": sse_events(await read_stream(c, "/v1/chat/completions", chat)),
        "responses": await post_json(c, "/v1/responses", responses),
        "responses_stream": sse_events(await read_stream(c, "/v1/responses", responses)),
        "anthropic": await post_json(c, "/v1/messages", anthropic),
        "anthropic_stream": sse_events(await read_stream(c, "/v1/messages", anthropic)),
        "ollama": await post_json(c, "/api/chat", {**ollama, "stream": False}),
        "ollama_stream": await _ndjson(c, {**ollama, "stream": True}),
    }


async def _ndjson(c, body: dict) -> list[dict]:
    raw = await read_stream(c, "/api/chat", body)
    return [json.loads(line) for line in raw.decode().splitlines() if line]


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` of each server-sent event (``event:`` lines or not)."""
    lines = raw.decode().splitlines()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def _frames(events: list[str]) -> list[dict]:
    return [json.loads(e) for e in events if e.startswith("{")]


def _check_chat(whole: dict, stream: list[str], arguments: str) -> None:
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].strip() == "Let me check."
    ((call,),) = [choice["message"]["tool_calls"]]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", arguments)
    deltas = [f["choices"][0] for f in _frames(stream) if f.get("choices")]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    args = "".join(
        t["function"].get("arguments") or ""
        for d in deltas
        for t in d["delta"].get("tool_calls") or ()
    )
    assert content.strip() == "Let me check." and args == arguments
    assert deltas[-1]["finish_reason"] == "length"


def _check_responses(whole: dict, stream: list[str], arguments: str) -> None:
    assert whole["status"] == "incomplete"
    message, call = whole["output"]
    assert message["content"][0]["text"].strip() == "Let me check."
    assert message["status"] == "completed"
    assert (call["type"], call["status"], call["arguments"]) == (
        "function_call",
        "incomplete",
        arguments,
    )
    done = [f["item"] for f in _frames(stream) if f.get("type") == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]


def _check_anthropic(whole: dict, stream: list[str]) -> None:
    assert whole["stop_reason"] == "max_tokens"
    text, use = whole["content"]
    assert text["text"].strip() == "Let me check."
    assert (use["type"], use["name"], use["input"]) == (
        "tool_use",
        "get_weather",
        {"city": "Paris"},
    )
    frames = _frames(stream)
    partial = "".join(
        f["delta"]["partial_json"]
        for f in frames
        if f.get("type") == "content_block_delta" and f["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Paris"}  # closed where the limit cut it
    stop = [f for f in frames if f.get("type") == "message_delta"]
    assert stop[-1]["delta"]["stop_reason"] == "max_tokens"


def _check_ollama(whole: dict, stream: list[dict]) -> None:
    assert whole["done_reason"] == "length"
    assert whole["message"]["content"].strip() == "Let me check."
    ((call,),) = [whole["message"]["tool_calls"]]
    assert call["function"]["arguments"] == {"city": "Paris"}
    calls = [t for line in stream for t in line.get("message", {}).get("tool_calls") or ()]
    assert [t["function"]["arguments"] for t in calls] == [{"city": "Paris"}]
    assert "".join(line["message"]["content"] for line in stream).strip() == "Let me check."
    assert stream[-1]["done_reason"] == "length"


@pytest.mark.parametrize("name", list(CUTS))
async def test_every_api_returns_the_cut_call_incomplete(name):
    templates.template_dir()
    text, where, arguments = CUTS[name]
    async with family_client(name) as c:
        got = await _all_apis(c, text, _at(text, where))
    _check_chat(got["chat"], got["chat_stream"], arguments)
    _check_responses(got["responses"], got["responses_stream"], arguments)
    _check_anthropic(got["anthropic"], got["anthropic_stream"])
    _check_ollama(got["ollama"], got["ollama_stream"])
    for key, value in got.items():
        dumped = json.dumps(value, ensure_ascii=False)
        for marker in ("<tool_call>", "<function=", "<｜tool▁call", "get_weather<"):
            assert marker not in dumped, (key, marker)


async def test_a_cut_before_the_name_returns_no_call_in_any_api():
    templates.template_dir()
    text = CUTS["Qwen3-Coder"][0]
    async with family_client("Qwen3-Coder") as c:
        got = await _all_apis(c, text, _at(text, "<function=get_wea"))
    choice = got["chat"]["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "length"
    assert choice["message"]["content"].strip() == "Let me check."
    assert [i["type"] for i in got["responses"]["output"]] == ["message"]
    assert [b["type"] for b in got["anthropic"]["content"]] == ["text"]
    assert not got["ollama"]["message"].get("tool_calls")
    for key, value in got.items():
        assert "<tool_call>" not in json.dumps(value, ensure_ascii=False), key


async def test_a_whole_call_the_limit_reaches_is_not_incomplete():
    """The limit falls right after a whole call: finish_reason length, but the call is
    whole (Responses: a completed item; Anthropic: every argument)."""
    templates.template_dir()
    text = CUTS["Qwen-Qwen3-0.6B"][0]
    async with family_client("Qwen-Qwen3-0.6B") as c:
        got = await _all_apis(c, text, len(text))
    assert got["chat"]["choices"][0]["finish_reason"] == "length"
    (call,) = [i for i in got["responses"]["output"] if i["type"] == "function_call"]
    assert call["status"] == "completed" and got["responses"]["status"] == "incomplete"
    (use,) = [b for b in got["anthropic"]["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"city": "Paris", "days": 3}
