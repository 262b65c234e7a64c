"""Tool calls constrained once the model opens one (``tool_choice: auto``).

A scripted model (``tests/fakes.ScriptedModel``) means to write free text and then a
malformed call: a wrong parameter name, a string where the schema wants an integer, or
a call that never closes. Under the lazy grammar (``actors/lazy_calls.py``) the text
before the opener is left as written and the call comes back valid for its schema, in
every format that has an opener; without it the call is written as scripted. Then the
same through the whole daemon in every API, whole and streamed, with the setting off
and ``strict: false`` leaving the call alone.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import jsonschema
import pytest
from mlxd.actors.families import forced, formats
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.lazy_calls import LazyCalls
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.protocol.messages import Tool

from tests import templates
from tests.conftest import running_graph, settings_with
from tests.fakes import GrammarRunner, ScriptedModel, grammar_factory
from tests.test_forced_calls import HIDDEN, SAMPLES, _hf_tokenizer
from tests.test_http import sse_events
from tests.test_openai_features import post_json, read_stream

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "nights": {"type": "integer"},
        "prefs": {"type": "object"},
    },
    "required": ["city", "nights", "prefs"],
}
BOOK = Tool(name="book", parameters=PARAMS)
PREFACE = "Sure, booking now. "


def _write(compiler: GrammarCompiler, hf, fmt: str, script: str, lazy: bool = True, **kw) -> str:
    """What the scripted model writes, with the lazy grammar of ``fmt`` or without."""
    grammar = compiler.compile_lazy((BOOK,), fmt, **kw) if lazy else None
    constraint = LazyCalls(grammar) if grammar is not None else None
    tokens = hf.encode(script, add_special_tokens=False) + [hf.eos_token_id]
    model = ScriptedModel(tokens, constraint, hf, len(hf))
    out: list[int] = []
    while len(out) < 600 and (not out or out[-1] != hf.eos_token_id):
        out.append(model.next())
    return hf.decode(out[:-1])


def _calls(fmt: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls) as the family's parser reads the text."""
    parser = formats.make_tool_parser(fmt, tools=(BOOK,))
    out = parser.feed(text.replace(HIDDEN.get(fmt, "\0"), ""))
    out.extend(parser.flush())
    calls: list[list[str]] = []
    for piece in out.calls:
        if piece.name is not None:
            calls.append([piece.name, ""])
        calls[-1][1] += piece.arguments
    return out.content, [(n, json.loads(a)) for n, a in calls]


def _malformed(fmt: str) -> str:
    """The family's sample call with a wrong key and a string for the integer."""
    sample = SAMPLES[fmt]
    bad = sample.replace("city", "cty").replace('"nights":3', '"nights":"3"')
    return bad.replace(">3<", ">three<").replace("\n3\n", "\nthree\n").replace("nights=3", "nights='3'")


LAZY = sorted(forced.OPENERS)


def test_every_format_with_a_builder_has_an_opener_but_functionary_v3_2():
    assert set(forced.BUILDERS) - set(forced.OPENERS) == {"functionary_v3_2"}
    for fmt, openers in forced.OPENERS.items():
        assert any(SAMPLES[fmt].startswith(o) for o in openers), fmt


@pytest.mark.parametrize("fmt", LAZY)
def test_a_malformed_call_comes_back_valid_after_free_text(fmt):
    """Markers as the vocabulary's special tokens where the format shows them."""
    hf = _hf_tokenizer([m for m in formats.named(fmt).show if m in SAMPLES[fmt]])
    compiler = GrammarCompiler(hf)
    preface = "" if fmt in forced.LEADING else PREFACE
    script = preface + _malformed(fmt)
    free = _write(compiler, hf, fmt, script, lazy=False)
    assert free == script  # as scripted without the grammar
    text = _write(compiler, hf, fmt, script)
    assert text.startswith(preface) and text != script
    content, calls = _calls(fmt, text)
    assert content.strip() == preface.strip()
    assert [name for name, _ in calls] == ["book"]
    jsonschema.validate(calls[0][1], PARAMS)
    assert calls[0][1]["city"] == "Le Mans"


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "mistral", "kimi_k2", "deepseek_v3"])
def test_a_call_that_never_closes_is_closed(fmt):
    hf = _hf_tokenizer([m for m in formats.named(fmt).show if m in SAMPLES[fmt]])
    sample = SAMPLES[fmt]
    cut = sample[: sample.index("3") + 1]  # the model stops after the integer
    text = _write(GrammarCompiler(hf), hf, fmt, PREFACE + cut)
    content, calls = _calls(fmt, text)
    assert content.strip() == PREFACE.strip()
    jsonschema.validate(calls[0][1], PARAMS)


def test_the_opener_inside_the_reasoning_block_is_not_a_call():
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    compiler = GrammarCompiler(hf)
    think = '<think>Maybe <tool_call>\n{"name": "nope"} or not.</think>\n'
    script = think + PREFACE + _malformed("hermes")
    text = _write(compiler, hf, "hermes", script, reasoning=("<think>", "</think>"))
    assert text.startswith(think + PREFACE)
    _, calls = _calls("hermes", text.split("</think>", 1)[1])
    jsonschema.validate(calls[0][1], PARAMS)
    # a block the prompt opened: the answer starts inside it
    opened = script.removeprefix("<think>")
    text = _write(
        compiler, hf, "hermes", opened, reasoning=("<think>", "</think>"), in_reasoning=True
    )
    assert text.startswith(opened.split("</think>")[0] + "</think>\n" + PREFACE)
    assert _calls("hermes", text.split("</think>", 1)[1])[1][0][0] == "book"


def test_a_text_opener_split_over_tokens_and_ending_inside_one():
    """No special tokens: ``<tool_call>`` is text; here its last token goes on past it."""
    hf = _hf_tokenizer([])
    hf.add_tokens(["ing <tool_", "call>\n{"])  # plain (non-special) merged pieces
    compiler = GrammarCompiler(hf)
    script = "Book" + "ing <tool_call>\n{" + _malformed("hermes").split("{", 1)[1]
    tokens = hf.encode(script, add_special_tokens=False)
    assert hf.convert_tokens_to_ids("call>\n{") in tokens
    text = _write(compiler, hf, "hermes", script)
    content, calls = _calls("hermes", text)
    assert content.strip() == "Booking"
    jsonschema.validate(calls[0][1], PARAMS)


def test_after_a_call_another_may_follow_or_the_answer_ends():
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    bad = _malformed("hermes")
    text = _write(GrammarCompiler(hf), hf, "hermes", PREFACE + bad + "\n" + bad)
    _, calls = _calls("hermes", text)
    assert len(calls) == 2
    for _, args in calls:
        jsonschema.validate(args, PARAMS)


def test_a_leading_format_takes_a_call_only_at_the_answers_start():
    hf = _hf_tokenizer([])
    compiler = GrammarCompiler(hf)
    prose = 'Here is JSON: {"name": "x"}'
    assert _write(compiler, hf, "json", prose) == prose
    text = _write(compiler, hf, "json", "  " + _malformed("json"))
    jsonschema.validate(_calls("json", text)[1][0][1], PARAMS)


def test_formats_without_a_grammar_stay_free():
    hf = _hf_tokenizer([])
    compiler = GrammarCompiler(hf)
    for fmt in ("minimax_m3", "functionary_v3_2", "kimi_k3", "function_gemma", "muse_spark"):
        assert compiler.compile_lazy((BOOK,), fmt) is None
