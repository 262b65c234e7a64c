"""Output parsers: every case fed whole, one character at a time, and split at every position."""

from __future__ import annotations

import itertools
import json

import pytest
from mlxd.actors.families.output import OutputParser
from mlxd.actors.parsers import Parsed
from mlxd.protocol.messages import OutputSpec

THINK = ("<think>", "</think>")


def run(spec: OutputSpec, chunks: list[str]) -> tuple[str, str, list[tuple[str, dict]], list[str]]:
    """Feed the chunks; return (content, reasoning, calls, content deltas)."""
    counter = itertools.count()
    parser = OutputParser(spec, make_id=lambda: f"call_{next(counter)}")
    total, deltas = Parsed(), []
    for chunk in chunks:
        part = parser.feed(chunk)
        deltas.append(part.content)
        total.extend(part)
    last = parser.flush()
    deltas.append(last.content)
    total.extend(last)
    calls: list[list] = []
    for piece in total.calls:  # first pieces carry id and name, the rest continue the arguments
        if piece.id is not None:
            assert piece.id == f"call_{len(calls)}"
            calls.append([piece.name, ""])
        assert piece.index == len(calls) - 1
        calls[-1][1] += piece.arguments
    return total.content, total.reasoning, [(n, json.loads(a)) for n, a in calls], deltas


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def check(spec, text, content, reasoning="", calls=(), never_shown=()):
    for chunks in splits(text):
        got_content, got_reasoning, got_calls, deltas = run(spec, chunks)
        assert (got_content, got_reasoning, got_calls) == (content, reasoning, list(calls)), chunks
        for marker in never_shown:  # not even a piece of it, in any delta
            assert all(marker not in d for d in deltas), chunks


HERMES = OutputSpec(tool_format="hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        (CALL, "", [("get_weather", {"city": "Paris"})]),
        ("Let me check. " + CALL, "Let me check. ", [("get_weather", {"city": "Paris"})]),
        (CALL + "\n" + CALL + "\n", "", [("get_weather", {"city": "Paris"})] * 2),
        # No closing tag before the end: still a call if the JSON is whole.
        ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),
        # Broken JSON is given back as content, never dropped.
        ("<tool_call>{oops</tool_call>", "<tool_call>{oops</tool_call>", []),
        ("a < b <tool", "a < b <tool", []),
        (
            '<tool_call>{"name":"f","arguments":{"a":{"b":[1]}}}\n</tool_call>',
            "",
            [("f", {"a": {"b": [1]}})],
        ),
        # Arguments as a JSON string holding an object are accepted.
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            "",
            [("f", {"x": 1})],
        ),
    ],
)
def test_hermes(text, content, calls):
    check(HERMES, text, content, calls=calls, never_shown=("<tool_call>",) if calls else ())


@pytest.mark.parametrize(
    ("text", "content", "reasoning"),
    [
        ("<think>hmm, 2+2</think>\n\nIt is 4.", "It is 4.", "hmm, 2+2"),
        ("  <think>x</think>y", "y", "x"),
        ("No thinking here", "No thinking here", ""),
        ("<think>cut off by max_tokens", "", "cut off by max_tokens"),
        ("I like <think> tags", "I like <think> tags", ""),  # only a leading block counts
        ("<thi", "<thi", ""),
    ],
)
def test_reasoning(text, content, reasoning):
    check(OutputSpec(reasoning=THINK), text, content, reasoning, never_shown=("</think>",))


def test_reasoning_opened_by_the_prompt():
    spec = OutputSpec(reasoning=THINK, in_reasoning=True)
    check(spec, "step one</think>answer", "answer", "step one")


def test_reasoning_then_tool_call():
    spec = OutputSpec(reasoning=THINK, tool_format="hermes")
    text = "<think>need weather</think>\n" + CALL
    check(spec, text, "", "need weather", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", {"a": 1}), ("g", {})]),
        ("Sure. No tools.", "Sure. No tools.", []),
        ('Let me see. [TOOL_CALLS][{"name": "f", "arguments": {}}]', "Let me see. ", [("f", {})]),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ("a [TOOL", "a [TOOL", []),
    ],
)
def test_mistral(text, content, calls):
    never = ("[TOOL_CALLS]",) if calls else ()
    check(OutputSpec(tool_format="mistral"), text, content, calls=calls, never_shown=never)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "f", "parameters": {"q": "x"}}', "", [("f", {"q": "x"})]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
            "",
            [("f", {}), ("g", {})],
        ),
        ('{"not": "a call"}', '{"not": "a call"}', []),
        ("The answer is 4.", "The answer is 4.", []),
    ],
)
def test_llama3(text, content, calls):
    check(OutputSpec(tool_format="llama3"), text, content, calls=calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [1]}}]',
            "",
            [("f", {}), ("g", {"b": [1]})],
        ),
        ('  {"name": "f", "arguments": {}}', "", [("f", {})]),
        ("[1, 2]", "[1, 2]", []),
        ("hello", "hello", []),
    ],
)
def test_json_fallback(text, content, calls):
    check(OutputSpec(tool_format="json"), text, content, calls=calls)


def test_hermes_arguments_stream_before_the_call_closes():
    counter = itertools.count()
    parser = OutputParser(HERMES, make_id=lambda: f"call_{next(counter)}")
    text = '<tool_call>{"name": "f", "arguments": {"q": "a long query"}}</tool_call>'
    cut = text.index("long")
    early = parser.feed(text[:cut]).calls
    assert early[0].name == "f" and early[0].id == "call_0"
    assert "".join(p.arguments for p in early) == '{"q": "a'  # a space may precede the end
    late = parser.feed(text[cut:]).calls + parser.flush().calls
    assert "".join(p.arguments for p in early + late) == '{"q": "a long query"}'


def test_single_tool_call_keeps_the_first():
    spec = OutputSpec(tool_format="hermes", single_tool_call=True)
    check(
        spec, CALL + CALL.replace("Paris", "Rome"), "", calls=[("get_weather", {"city": "Paris"})]
    )


def test_no_parsing_is_pass_through():
    parser = OutputParser(OutputSpec())
    assert not parser.active
    assert parser.feed("<tool_call>x").content == "<tool_call>x"
