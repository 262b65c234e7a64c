"""Call grammars for MiniMax-M3, FunctionGemma, Kimi K3 and Muse (each family module's
``grammar``).

For each: the call as the family's chat template renders it (checked against the real
template where ``.cache/templates`` has it) is accepted byte by byte, and as the model's
own tokens where the markers are special tokens; a wrong parameter name, a string for an
integer, a value off its enum, a closing tag inside a string and text before the opener
are refused; and text the grammar writes (its forced bytes, the values filled in) reads
back through the format's parser as the same call.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlxd.actors.families import forced, formats, function_gemma, kimi_k3, minimax_m3, muse
from mlxd.actors.grammar import GrammarCompiler, _byte_tokenizer, tool_call_schema
from mlxd.protocol.messages import Tool

from tests import templates
from tests.test_forced_calls import _hf_tokenizer, _spelled

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "nights": {"type": "integer"},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "nights", "unit"],
}
BOOK = Tool(name="book", parameters=PARAMS)
NOTE = {"type": "object", "properties": {"loud": {"type": "boolean"}}}
OTHER = Tool(name="other", parameters=NOTE)
TOOLS = (BOOK, OTHER)
ARGS = {"city": "Le Mans", "nights": 3, "unit": "C"}

BUILDERS = {
    "minimax_m3": minimax_m3.grammar,
    "function_gemma": function_gemma.grammar,
    "kimi_k3": kimi_k3.grammar,
    "muse_spark": muse.grammar,
}
NS = minimax_m3.NS


def _text(value) -> str:
    """A value as the templates print a non-string: booleans lower case, the rest JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def render(fmt: str, name: str, args: dict) -> str:
    """One call as the family's template writes it (``test_the_samples_are_the_templates``)."""
    if fmt == "minimax_m3":
        params = "".join(f"{NS}<{k}>{_text(v)}{NS}</{k}>" for k, v in args.items())
        return f'{NS}<tool_call>\n{NS}<invoke name="{name}">{params}{NS}</invoke>\n{NS}</tool_call>'
    if fmt == "function_gemma":
        params = ",".join(
            f"{k}:<escape>{v}<escape>" if isinstance(v, str) else f"{k}:{_text(v)}"
            for k, v in sorted(args.items())
        )
        return f"<start_function_call>call:{name}{{{params}}}<end_function_call>"
    if fmt == "kimi_k3":
        kinds = {str: "string", bool: "boolean", int: "number", float: "number"}
        params = "".join(
            f'<|open|>argument key="{k}" type="{kinds[type(v)]}"<|sep|>{_text(v)}'
            "<|close|>argument<|sep|>"
            for k, v in args.items()
        )
        return (
            f'<|open|>tools<|sep|><|open|>call tool="{name}" index="1"<|sep|>{params}'
            "<|close|>call<|sep|><|close|>tools<|sep|>"
        )
    params = "".join(
        f'<atem:parameter name="{k}">{_text(v)}</atem:parameter>\n' for k, v in args.items()
    )
    return (
        f' to={name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{params}'
        "</atem:invoke>\n</atem:function_calls>"
    )


def lark(fmt: str, split: forced.Split = forced.as_text, names=("book", "other")) -> str:
    g = forced.Grammar(split)
    return g.lark(BUILDERS[fmt](g, tool_call_schema(TOOLS, names)))


def matcher(fmt: str, names=("book", "other")):
    grammar = llguidance.LLMatcher.grammar_from_lark(lark(fmt, names=names))
    assert not llguidance.LLMatcher.validate_grammar(grammar, _byte_tokenizer())
    found = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    assert not found.is_error(), found.get_error()
    return found


def accepts(fmt: str, text: str, names=("book", "other")) -> bool:
    m = matcher(fmt, names)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def parsed(fmt: str, text: str) -> list[tuple[str, dict]]:
    parser = formats.make_tool_parser(fmt, tools=TOOLS)
    out = parser.feed(text)
    out.extend(parser.flush())
    assert not out.content.strip(), out.content
    calls: list[list[str]] = []  # [name, arguments]; a call's first piece has its name
    for piece in out.calls:
        if piece.name is not None:
            calls.append([piece.name, ""])
        calls[-1][1] += piece.arguments
    return [(name, json.loads(arguments)) for name, arguments in calls]


def walk(fmt: str, intended: str) -> str:
    """The text the grammar writes where ``intended`` fills its free choices: every byte the
    grammar forces is taken from the grammar (and must be the intended one)."""
    m, out = matcher(fmt), b""
    want = intended.encode()
    while len(out) < len(want):
        forced_bytes = m.compute_ff_bytes()
        if forced_bytes:
            assert want[len(out) :].startswith(forced_bytes), (out, forced_bytes)
            assert all(m.consume_token(b) for b in forced_bytes)
            out += forced_bytes
            continue
        assert m.consume_token(want[len(out)]), (out, m.get_error())
        out += want[len(out) : len(out) + 1]
    assert m.is_accepting() and not m.compute_ff_bytes()
    return out.decode()


# ---- the template's markup is the grammar's -------------------------------------------------

TEMPLATES = {
    "minimax_m3": ("MiniMax-M3", {}),
    "kimi_k3": ("Kimi-K3", {"thinking": False}),
    "muse_spark": ("muse-glimmer", {}),
}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_the_samples_are_the_templates(fmt):
    """What the real template writes for the call holds ``render``'s text (Kimi K3 closes its
    response section before it, MiniMax-M3 writes a bare ``</mm:think>``)."""
    name, extra = TEMPLATES[fmt]
    tools = [
        {"type": "function", "function": {"name": "book", "description": "", "parameters": PARAMS}}
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "book", "arguments": ARGS}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    _, text = templates.written(templates.source(name), "Book it.", turn, tools, **extra)
    assert render(fmt, "book", ARGS) in text
    assert formats.detect(templates.source(name)).format.name == fmt


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_the_template_markup_is_accepted_and_parsed_back(fmt):
    for name, args in (("book", ARGS), ("other", {}), ("other", {"loud": True})):
        text = render(fmt, name, args)
        assert accepts(fmt, text), text
        assert parsed(fmt, text) == [(name, args)]


# Where a call opens: the grammar's first marker (Muse: after the optional recipient header).
OPENERS = {
    "minimax_m3": f"{NS}<tool_call>",
    "function_gemma": "<start_function_call>",
    "kimi_k3": "<|open|>tools<|sep|>",
    "muse_spark": "<atem:function_calls>",
}


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_the_grammar_starts_at_the_opener(fmt):
    """The grammar forces the opener from the first byte; Muse's recipient header before it
    may be left out (auto mode catches the call at ``<atem:function_calls>``, after a header
    the model wrote itself) but names the called tool where it is written."""
    sample, opener = render(fmt, "book", ARGS), OPENERS[fmt]
    ahead = matcher(fmt).compute_ff_bytes().decode()
    assert sample.startswith(ahead)
    if fmt == "muse_spark":
        assert ahead == ""  # " to=" or the opener
        body = sample.removeprefix(" to=book<|message|>")
        assert body.startswith(opener) and accepts(fmt, body)
        assert not accepts(fmt, " to=other<|message|>" + body)
        assert not accepts(fmt, " to=self<|message|>" + body)
    else:
        assert ahead.startswith(opener)


def _by_vocabulary(hf) -> forced.Split:
    """A marker's text → its pieces, each added special token of ``hf`` found by its text."""
    specials = {t: i for t, i in hf.get_added_vocab().items() if t != "</s>"}

    def split(text: str) -> list[str | int]:
        for name, token in specials.items():
            if name in text:
                head, _, tail = text.partition(name)
                return [*split(head), token, *split(tail)]
        return [text] if text else []

    return split


# MiniMax-M3's separator is one special token that llguidance's tokenize_str misses (it
# tries the ``<]minimax[>`` inside it): ``GrammarCompiler._split`` finds special tokens by text.


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_each_marker_that_is_a_special_token_is_named_by_id(fmt):
    """With the format's markers as special tokens, the call in the model's own tokens is
    accepted and the same text spelled in byte tokens is not."""
    hf = _hf_tokenizer([m for m in formats.named(fmt).show if m in render(fmt, "book", ARGS)])
    assert_named_by_id(fmt, hf, GrammarCompiler(hf)._split)


def test_minimax_m3_names_its_separator_by_id_where_the_split_finds_it():
    hf = _hf_tokenizer([NS])
    assert_named_by_id("minimax_m3", hf, _by_vocabulary(hf))


def assert_named_by_id(fmt: str, hf, split: forced.Split) -> None:
    text = render(fmt, "book", ARGS)
    compiler = GrammarCompiler(hf)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark(fmt, split))
    compiler.validate(grammar)
    shown = [t for t in hf.get_added_vocab() if t != "</s>"]
    for marker in shown:
        assert f"<[{hf.convert_tokens_to_ids(marker)}]>" in lark(fmt, split), marker
    tokens = hf.encode(text, add_special_tokens=False)
    assert sum(t > 256 for t in tokens) >= len(shown)
    m = llguidance.LLMatcher(compiler._llt, grammar, log_level=0)
    assert m.consume_tokens(tokens) and m.is_accepting()
    spelled = llguidance.LLMatcher(compiler._llt, grammar, log_level=0)
    assert not (spelled.consume_tokens(_spelled(hf, text)) and spelled.is_accepting())
    assert parsed(fmt, hf.decode(tokens)) == [("book", ARGS)]


# ---- off the schema or the markup: refused ----------------------------------------------------

# A string value with its closing tag (or a marker the parser would end it at) inside.
CLOSERS = {
    "minimax_m3": (f"{NS}</city>", NS),
    "function_gemma": ("<escape>", "}", "<end_function_call>"),
    "kimi_k3": ("<|close|>argument<|sep|>", "<|close|>", "<|open|>"),
    "muse_spark": ("</atem:parameter>", "<|eot|>", "<|eom|>", "<|start|>"),
}


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_calls_off_the_schema_are_refused(fmt):
    sample = render(fmt, "book", ARGS)
    wrong = [
        render(fmt, "book", {"cty": "Le Mans", "nights": 3, "unit": "C"}),  # no such parameter
        render(fmt, "book", {"city": "Le Mans", "nights": "three", "unit": "C"}),  # a string
        render(fmt, "book", {"city": "Le Mans", "nights": 3.5, "unit": "C"}),
        render(fmt, "book", {"city": "Le Mans", "nights": 3, "unit": "K"}),  # off the enum
        render(fmt, "book", {"city": "Le Mans", "nights": 3}),  # a required one left out
        render(fmt, "bake", ARGS),  # no such tool
        render(fmt, "other", {"loud": "yes"}),
        "Sure! " + sample,
        sample[:-1],
        *(sample.replace("Le Mans", f"Le{closer}Mans") for closer in CLOSERS[fmt]),
    ]
    quoted = render(fmt, "book", {"city": "Le Mans", "nights": "3", "unit": "C"})
    if quoted != sample:  # a string "3" is written apart from the number (not in M3 or Muse)
        wrong.append(quoted)
    assert accepts(fmt, sample)
    for text in wrong:
        assert not accepts(fmt, text), text
    assert not accepts(fmt, sample, names=("other",))  # a call to a tool not offered


@pytest.mark.parametrize("fmt", ["minimax_m3", "muse_spark", "kimi_k3"])
def test_parameters_come_in_schema_order(fmt):
    shuffled = {"nights": 3, "city": "Le Mans", "unit": "C"}
    assert not accepts(fmt, render(fmt, "book", shuffled))


def test_function_gemma_writes_its_parameters_sorted():
    """The template sorts the keys (``dictsort``), whatever the schema's order."""
    params = {**PARAMS, "properties": dict(reversed(PARAMS["properties"].items()))}
    g = forced.Grammar()
    tools = (Tool(name="book", parameters=params),)
    grammar = llguidance.LLMatcher.grammar_from_lark(
        g.lark(function_gemma.grammar(g, tool_call_schema(tools, ("book",))))
    )
    in_schema_order = (
        "<start_function_call>call:book{unit:<escape>C<escape>,nights:3,"
        "city:<escape>Le Mans<escape>}<end_function_call>"
    )
    for text, ok in ((render("function_gemma", "book", ARGS), True), (in_schema_order, False)):
        m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        assert (all(m.consume_token(b) for b in text.encode()) and m.is_accepting()) is ok


# ---- what the grammar writes, the parser reads ------------------------------------------------

# Text the parsers read back as written: no closing markup, no ``}`` (FunctionGemma's
# parser ends the call there), not JSON and no blank at either end (Muse's parser reads a
# JSON-looking value as JSON and strips the rest).
WORDS = st.from_regex(r"[A-Za-zé][A-Za-zé <>&,.:'\"\n{\[]{0,14}[A-Za-zé.!]", fullmatch=True).filter(
    lambda text: not _json(text) and not any(c in text for cs in CLOSERS.values() for c in cs)
)


def _json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    city=WORDS,
    nights=st.integers(-(10**9), 10**9),
    unit=st.sampled_from(["C", "F"]),
    loud=st.none() | st.booleans(),
)
def test_what_the_grammar_writes_reads_back_as_the_same_call(fmt, city, nights, unit, loud):
    book = {"city": city, "nights": nights, "unit": unit}
    other = {} if loud is None else {"loud": loud}
    for name, args in (("book", book), ("other", other)):
        text = walk(fmt, render(fmt, name, args))
        assert parsed(fmt, text) == [(name, args)]


def test_minimax_m3_nests_objects_and_lists_as_elements():
    """An object with properties is one element per property, a list one ``<item>`` per
    entry; an object of free keys is its JSON text, which the parser reads as an object."""
    params = {
        "type": "object",
        "properties": {
            "stay": {
                "type": "object",
                "properties": {
                    "nights": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                    "note": {"type": "string"},
                },
                "required": ["nights"],
            },
            "extra": {"type": "object"},
        },
        "required": ["stay", "extra"],
    }
    tools = (Tool(name="plan", parameters=params),)
    g = forced.Grammar()
    grammar = llguidance.LLMatcher.grammar_from_lark(
        g.lark(minimax_m3.grammar(g, tool_call_schema(tools, ("plan",))))
    )

    def el(key: str, inner: str) -> str:
        return f"{NS}<{key}>{inner}{NS}</{key}>"

    def call(args: str) -> str:
        return f'{NS}<tool_call>\n{NS}<invoke name="plan">{args}{NS}</invoke>\n{NS}</tool_call>'

    nights = el("item", "2") + el("item", "-1")
    good = call(el("stay", el("nights", nights) + el("note", "a <b>")) + el("extra", '{"k":[1]}'))
    for text, ok in (
        (good, True),
        (call(el("stay", el("nights", "")) + el("extra", "{}")), True),
        (call(el("stay", el("nights", nights * 2)) + el("extra", "{}")), False),  # maxItems
        (call(el("stay", el("nights", el("item", "x"))) + el("extra", "{}")), False),
        (call(el("stay", el("note", "a")) + el("extra", "{}")), False),  # nights required
        (call(el("stay", el("nights", "")) + el("extra", el("k", "1"))), False),
    ):
        m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        assert (all(m.consume_token(b) for b in text.encode()) and m.is_accepting()) is ok, text
    parser = formats.make_tool_parser("minimax_m3", tools=tools)
    out = parser.feed(good)
    out.extend(parser.flush())
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("plan", {"stay": {"nights": [2, -1], "note": "a <b>"}, "extra": {"k": [1]}})
    ]


def _one_tool(fmt: str, params: dict):
    g = forced.Grammar()
    tools = (Tool(name="f", parameters=params),)
    grammar = llguidance.LLMatcher.grammar_from_lark(
        g.lark(BUILDERS[fmt](g, tool_call_schema(tools, ("f",))))
    )

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()

    return accepts, tools


def test_kimi_k3_types_each_argument_as_its_template_does():
    """``type`` is the template's ``xtml_type``: ``number`` for integers, JSON for objects; a
    value of several types is JSON under any type but ``string``."""
    params = {
        "type": "object",
        "properties": {"opts": {"type": "object"}, "n": {"type": ["integer", "null"]}},
        "required": ["opts", "n"],
    }
    accepts, tools = _one_tool("kimi_k3", params)

    def call(opts: str, n: str) -> str:
        return (
            '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            f'<|open|>argument key="opts" type={opts}<|close|>argument<|sep|>'
            f'<|open|>argument key="n" type={n}<|close|>argument<|sep|>'
            "<|close|>call<|sep|><|close|>tools<|sep|>"
        )

    good = call('"object"<|sep|>{"a": [1, "x"]}', '"null"<|sep|>null')
    assert accepts(good)
    assert accepts(call('"object"<|sep|>{}', '"number"<|sep|>7'))
    assert not accepts(call('"string"<|sep|>{}', '"number"<|sep|>7'))
    assert not accepts(call('"object"<|sep|>{}', '"string"<|sep|>7'))
    assert not accepts(call('"object"<|sep|>[1]', '"number"<|sep|>7'))
    parser = formats.make_tool_parser("kimi_k3", tools=tools)
    out = parser.feed(good)
    out.extend(parser.flush())
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("f", {"opts": {"a": [1, "x"]}, "n": None})
    ]


def test_function_gemma_writes_objects_and_lists_in_the_templates_syntax():
    """``format_argument``: bare keys, strings in ``<escape>``, no spaces. (mlx-lm's parser
    ends the call at the first ``}``: such a call is written as trained, not read back.)"""
    params = {
        "type": "object",
        "properties": {"prefs": {"type": "object"}, "tags": {"type": "array"}},
        "required": ["prefs", "tags"],
    }
    accepts, _ = _one_tool("function_gemma", params)
    head, tail = "<start_function_call>call:f{", "}<end_function_call>"
    assert accepts(head + "prefs:{view:<escape>sea<escape>,n:2},tags:[1,<escape>a<escape>]" + tail)
    assert accepts(head + "prefs:{},tags:[]" + tail)
    assert not accepts(head + 'prefs:{"view":"sea"},tags:[]' + tail)
