"""Where a call opens, what may follow it, how long its numbers run (``tool_choice: auto``).

Driven by hand: ``LazyCalls`` fed token ids, or a scripted model (``tests/fakes``) that
means to write a fixed text and is masked as a real model would be.

- A special-token opener opens a call only as that id: Qwen3.5's real ``<tool_call>``
  (one special token) written as the ordinary tokens `` <``, ``tool``, ``_call``, ``>`` is
  prose; a text opener only at the start of the answer or of a line, never in a code
  fence. For every held format: prose and fenced code that mention the opener stay free,
  and a real call still opens.
- After a call: with ``parallel_tool_calls: false`` only the end of the turn; with it,
  another call or the end; never text.
- Numbers: a model that means to write ``1000…`` ends the number within the bound.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from mlxd.actors.families import forced, formats
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.lazy_calls import LazyCalls
from mlxd.protocol.messages import Constraint, Tool

from tests.fakes import ScriptedModel
from tests.test_forced_calls import HIDDEN, SAMPLES, _hf_tokenizer
from tests.test_lazy_calls import BOOK, PARAMS, _calls


def _write(compiler, hf, fmt: str, script: str, **kw) -> str:
    grammar = compiler.compile_lazy((BOOK,), fmt, **kw)
    assert grammar is not None
    tokens = hf.encode(script, add_special_tokens=False) + [hf.eos_token_id]
    model = ScriptedModel(tokens, LazyCalls(grammar), hf, len(hf))
    out: list[int] = []
    while len(out) < 4000 and (not out or out[-1] != hf.eos_token_id):
        out.append(model.next())
    return hf.decode(out[:-1])


def _vocab(fmt: str, special: bool):
    markers = [m for m in formats.named(fmt).show if m in SAMPLES[fmt]] if special else []
    return _hf_tokenizer(markers)


HELD = [f for f in sorted(SAMPLES) if formats.named(f).calls.held]
TEXT = [f for f in HELD if not formats.named(f).calls.leading]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import AutoTokenizer

    from scripts import real_tokenizers

    return AutoTokenizer.from_pretrained(
        real_tokenizers.qwen35_tokenizer(tmp_path_factory.mktemp("qwen35"))
    )


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from transformers import AutoTokenizer

    from scripts import real_tokenizers

    return AutoTokenizer.from_pretrained(
        real_tokenizers.deepseek_v4_tokenizer(tmp_path_factory.mktemp("deepseek"))
    )


@pytest.mark.parametrize(
    ("vocab", "fmt", "opener"),
    [
        ("qwen", "qwen3_coder", "<tool_call>"),
        ("qwen", "hermes", "<tool_call>"),
        ("deepseek", "deepseek_v3", "<｜tool▁calls▁begin｜>"),
    ],
)
def test_real_vocabularies_prose_spelling_the_opener_is_prose(request, vocab, fmt, opener):
    """Qwen3.5's and DeepSeek V4's real tokenizers: the opener is one special token; the
    same text in ordinary tokens, in prose or a code fence, opens nothing; the token opens a
    call even mid-line."""
    hf = request.getfixturevalue(vocab)
    grammar = GrammarCompiler(hf).compile_lazy((BOOK,), fmt)
    special = hf.convert_tokens_to_ids(opener)
    assert grammar.special == {special: b""} and grammar.text_openers == ()
    spelled = [t for ch in opener for t in hf.encode(ch, add_special_tokens=False)]
    assert special not in spelled and len(spelled) >= 3
    for lead in ("The tag ", "", "```\n"):
        calls = LazyCalls(grammar)
        calls.consume([*hf.encode(lead, add_special_tokens=False), *spelled])
        calls.consume(hf.encode(" opens a call.", add_special_tokens=False))
        assert not calls.active and calls.words() is None, lead
    calls = LazyCalls(grammar)
    calls.consume([*hf.encode("Sure.", add_special_tokens=False), special])
    assert calls.active


def test_smollm2_prose_and_code_mentioning_the_tag_stay_free(smollm_tokenizer):
    """SmolLM2's real vocabulary has no ``<tool_call>`` token: mid-line and fenced mentions
    are prose, one at the start of a line is a call."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm_tokenizer)
    compiler = GrammarCompiler(hf)
    for prose in (
        "Wrap it as <tool_call>{...}</tool_call> and send it.",
        "Like this:\n```\n<tool_call>\n{}\n</tool_call>\n```\nDone.",
    ):
        assert _write(compiler, hf, "hermes", prose) == prose
    text = _write(compiler, hf, "hermes", "Booking.\n" + _bad("hermes"))
    jsonschema.validate(_calls("hermes", text)[1][0][1], PARAMS)


@pytest.mark.parametrize("fmt", TEXT)
def test_prose_and_fenced_code_mentioning_the_opener_stay_free(fmt):
    """Openers as text (no special tokens): mentioned mid-line or inside a fence, they
    are prose; at the start of a line, a call."""
    hf = _vocab(fmt, special=False)
    compiler = GrammarCompiler(hf)
    sample = SAMPLES[fmt].replace(HIDDEN.get(fmt, "\0"), "")
    for prose in (
        f"The markup {sample} is how calls look.",
        f"An example:\n```\n{sample}\n```\nThat is all.",
    ):
        assert _write(compiler, hf, fmt, prose) == prose, prose
    text = _write(compiler, hf, fmt, "Booking now.\n" + _bad(fmt))
    content, calls = _calls(fmt, text)
    assert content.strip() == "Booking now."
    jsonschema.validate(calls[0][1], PARAMS)


@pytest.mark.parametrize("fmt", HELD)
def test_a_special_opener_opens_only_as_its_token(fmt):
    """Markers as special tokens where the format shows them: the same text spelled in
    ordinary tokens is prose, wherever it stands; the token itself opens a call."""
    hf = _vocab(fmt, special=True)
    compiler = GrammarCompiler(hf)
    grammar = compiler.compile_lazy((BOOK,), fmt)
    if not grammar.special:
        pytest.skip("no opener of this format is a special token here")
    opener = next(iter(grammar.special))
    name = hf.convert_ids_to_tokens(opener)
    spelled = hf.encode(name, add_special_tokens=False, split_special_tokens=True)
    assert opener not in spelled
    for lead in ("", "Text.\n", "Text "):
        calls = LazyCalls(grammar)
        calls.consume(hf.encode(lead, add_special_tokens=False) + spelled)
        assert not calls.active, (lead, name)
    calls = LazyCalls(grammar)
    rest = grammar.special[opener]
    calls.consume([*hf.encode("Text ", add_special_tokens=False), opener])
    calls.consume(hf.encode(rest.decode(), add_special_tokens=False) if rest else [])
    assert calls.active


def _bad(fmt: str) -> str:
    sample = SAMPLES[fmt]
    return sample.replace("city", "cty").replace('"nights":3', '"nights":"3"')


def _eos_only(calls: LazyCalls, eos: int, width: int) -> bool:
    words = calls.words()
    assert words is not None
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:width])
    return allowed.tolist() == [eos]


@pytest.mark.parametrize("fmt", HELD)
def test_after_a_call_the_turn_ends_or_another_call_follows(fmt):
    """No text after a call: with ``parallel_tool_calls: false`` the model that means to
    write " Done." after its call can only end the turn; with it, the call's opener (where
    the markup takes another) or the end."""
    hf = _vocab(fmt, special=True)
    compiler = GrammarCompiler(hf)
    sample = SAMPLES[fmt]
    lead = "" if formats.named(fmt).calls.leading else "Booking.\n"
    text = _write(compiler, hf, fmt, lead + sample + " Done.", parallel=False)
    assert "Done" not in text
    grammar = compiler.compile_lazy((BOOK,), fmt, parallel=False)
    calls = LazyCalls(grammar)
    calls.consume(hf.encode(lead + sample, add_special_tokens=False))
    assert calls.active and _eos_only(calls, hf.eos_token_id, len(hf))
    between = formats.named(fmt).calls.between
    grammar = compiler.compile_lazy((BOOK,), fmt, parallel=True)
    calls = LazyCalls(grammar)
    calls.consume(hf.encode(lead + sample, add_special_tokens=False))
    if between is None:
        assert _eos_only(calls, hf.eos_token_id, len(hf))
        return
    twice = _write(compiler, hf, fmt, lead + sample + between + sample + " Done.")
    assert "Done" not in twice
    content, found = _calls(fmt, twice)
    assert content.strip() == lead.strip()
    assert [n for n, _ in found] == ["book", "book"], twice


SIZES = Tool(
    name="book",
    parameters={
        "type": "object",
        "properties": {"nights": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["nights", "price"],
    },
)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "gemma4", "pythonic", "minicpm5"])
def test_numbers_end_within_the_bound(fmt):
    """A model that means to write ``1`` then ``0`` forever ends the number within the
    bound and closes the call."""
    hf = _vocab(fmt, special=True)
    bounds = forced.Bounds(integer_digits=6, fraction_digits=3)
    compiler = GrammarCompiler(hf, bounds)
    grammar = compiler.compile_lazy((SIZES,), fmt, parallel=False)
    endless = "1" + "0" * 300
    script = {
        "hermes": '<tool_call>\n{"name": "book", "arguments": {"nights": %s, "price": 2.%s',
        "qwen3_coder": "<tool_call>\n<function=book>\n<parameter=nights>\n%s",
        "gemma4": "<|tool_call>call:book{nights:%s",
        "pythonic": "<|tool_call_start|>[book(nights=%s",
        "minicpm5": '<function name="book"><param name="nights">%s',
    }[fmt]
    script = script % ((endless, endless) if script.count("%s") == 2 else (endless,))
    tokens = hf.encode(script, add_special_tokens=False)
    model = ScriptedModel(tokens, LazyCalls(grammar), hf, len(hf))
    out: list[int] = []
    while len(out) < 200 and (not out or out[-1] != hf.eos_token_id):
        out.append(model.next())
    assert out[-1] == hf.eos_token_id, hf.decode(out)
    parser = formats.make_tool_parser(fmt, tools=(SIZES,))
    parsed = parser.feed(hf.decode(out[:-1]))
    parsed.extend(parser.flush())
    name = next(p.name for p in parsed.calls if p.name)
    args = json.loads("".join(p.arguments for p in parsed.calls))
    assert name == "book" and 0 < args["nights"] < 10**6
    assert isinstance(args["price"], int | float) and abs(args["price"]) < 10**6


def test_json_schema_answers_are_bounded_too():
    hf = _hf_tokenizer([])
    compiler = GrammarCompiler(hf, forced.Bounds(integer_digits=4, fraction_digits=2))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = compiler.compile(Constraint(kind="json_schema", schema=schema))
    matcher = grammar.matcher
    assert matcher.consume_tokens(hf.encode('{"n": 9999', add_special_tokens=False))
    assert not matcher.deep_copy().consume_tokens(hf.encode("9", add_special_tokens=False))


def test_a_schemas_own_bounds_win():
    bounded = forced.bound_numbers(
        {"type": "integer", "minimum": 0, "maximum": 10**30}, forced.Bounds(integer_digits=3)
    )
    assert bounded == {"type": "integer", "minimum": 0, "maximum": 10**30}
    nested = forced.bound_numbers(
        {"type": "object", "properties": {"x": {"type": ["number", "null"]}}, "enum": [5]},
        forced.Bounds(integer_digits=2, fraction_digits=1),
    )
    assert nested["properties"]["x"] == {
        "type": ["number", "null"],
        "minimum": -99.0,
        "maximum": 99.0,
        "multipleOf": 0.1,
    }
    assert nested["enum"] == [5]  # data, not a schema


def test_the_same_tools_compile_once():
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    compiler = GrammarCompiler(hf, cache_size=4)
    tools = tuple(
        Tool(name=f"t{i}", parameters={"type": "object", "properties": {"x": {"type": "integer"}}})
        for i in range(40)
    )
    first = compiler.compile_lazy(tools, "hermes")
    assert compiler.compiled == 1
    second = compiler.compile_lazy(tools, "hermes")
    assert compiler.compiled == 1 and second.matcher is not first.matcher  # a copy each
    compiler.compile_lazy(tools, "hermes", parallel=False)  # another grammar
    assert compiler.compiled == 2
    off = GrammarCompiler(hf, cache_size=0)
    off.compile_lazy(tools, "hermes")
    off.compile_lazy(tools, "hermes")
    assert off.compiled == 2


def test_the_tool_call_page_lists_every_format_as_the_registry_has_it():
    """``docs/tools.md``'s table is ``formats.markup_table()``: regenerate it with
    ``python -c "from mlxd.actors.families import formats; print(formats.markup_table())"``."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "tools.md").read_text()
    start = page.index("<!-- generated: formats.markup_table() -->\n")
    body = page[start:].split("\n", 1)[1]
    assert body[: body.index("<!-- end generated -->")] == formats.markup_table()


@pytest.mark.parametrize("width", [1000, 1024, 1100])
def test_packed_words_expand_on_the_device_as_numpy_unpacks_them(width):
    """The mask travels as packed words and is expanded and applied in one fused pass: the
    same tokens as llguidance's bitmask, tokens past the words not allowed."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.logits import _masked
    from mlxd.actors.lazy_calls import unpack

    rng = np.random.default_rng(width)
    words = rng.integers(-(2**31), 2**31 - 1, size=32, dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.standard_normal((1, width)).astype(np.float32))
    masked = np.array(_masked(logits, words))[0]
    want = unpack(words, width)
    assert (np.isfinite(masked) == want).all()
    assert (masked[want] == np.array(logits)[0][want]).all()


def test_the_mask_after_a_special_opener_is_chosen_on_the_device():
    """A free row whose newest token is the opener gets the grammar's first mask without
    reading that token on the host; any other token leaves its logits alone."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.logits import LazyCallProcessor

    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    grammar = GrammarCompiler(hf).compile_lazy((BOOK,), "hermes")
    opener = hf.convert_tokens_to_ids("<tool_call>")
    assert set(grammar.first_words) == {opener}
    prompt = hf.encode("Q", add_special_tokens=False)
    logits = mx.zeros((1, len(hf)))
    processor = LazyCallProcessor(grammar)
    processor(mx.array(prompt), logits)
    text = hf.encode("Hi", add_special_tokens=False)
    for t in text:
        processor.readback(t)
    free = processor(mx.array([*prompt, *text]), logits)
    assert mx.array_equal(free, logits)
    held = processor(mx.array([*prompt, *text, opener]), logits)
    allowed = {hf.decode([i]) for i, v in enumerate(np.array(held)[0]) if v > -1e30}
    assert allowed and allowed <= {"\n", "{"}


def test_bounds_read_property_names_as_names():
    """A property named ``type`` or ``properties`` (BFCL has them) is a name, not a keyword;
    a malformed ``type`` is left to the schema compiler, not a crash."""
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "integer"},
            "properties": {"type": "object", "properties": {"n": {"type": "number"}}},
        },
        "$defs": {"type": {"type": "integer"}},
    }
    out = forced.bound_numbers(schema, forced.Bounds(integer_digits=2, fraction_digits=1))
    assert out["properties"]["type"]["maximum"] == 99
    assert out["properties"]["properties"]["properties"]["n"]["multipleOf"] == 0.1
    assert out["$defs"]["type"]["minimum"] == -99
    assert forced.bound_numbers({"type": {"weird": 1}}, forced.Bounds()) == {"type": {"weird": 1}}


def test_an_opener_token_inside_the_reasoning_block_is_not_masked_on_the_device():
    """The device-side mask after a special opener applies only in the answer: inside the
    reasoning block the opener is reasoning text, and the next token stays free."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.logits import LazyCallProcessor

    hf = _hf_tokenizer(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tags = ("<think>", "</think>")
    grammar = GrammarCompiler(hf).compile_lazy((BOOK,), "hermes", tags, True)
    opener = hf.convert_tokens_to_ids("<tool_call>")
    prompt = hf.encode("Q<think>", add_special_tokens=False)
    logits = mx.zeros((1, len(hf)))
    processor = LazyCallProcessor(grammar)
    processor(mx.array(prompt), logits)
    text = hf.encode("Maybe", add_special_tokens=False)
    for t in text:
        processor.readback(t)
    assert mx.array_equal(processor(mx.array([*prompt, *text, opener]), logits), logits)
    processor.readback(opener)
    after = hf.encode(" no.</think>\nOK", add_special_tokens=False)
    for t in after:
        processor.readback(t)
    held = processor(mx.array([*prompt, *text, opener, *after, opener]), logits)
    assert not mx.array_equal(held, logits)  # in the answer, the opener's mask applies


def test_on_the_cpu_a_free_row_reads_its_newest_token_instead():
    """``opener_mask_on_device = false`` (the CPU's row of the backend table): no select over
    the vocabulary on free steps; the row reads its newest token, and the opener's mask
    comes from the grammar on the host, the same tokens as the device's choice."""
    import mlx.core as mx
    from mlxd.actors.engine import backend_policy
    from mlxd.actors.engine.runner.logits import LazyCallProcessor

    assert not backend_policy.for_backend("cpu").opener_mask_on_device
    assert backend_policy.for_backend("cuda").opener_mask_on_device
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    opener = hf.convert_tokens_to_ids("<tool_call>")
    prompt = hf.encode("Q", add_special_tokens=False)
    text = hf.encode("Hi", add_special_tokens=False)
    logits = mx.zeros((1, len(hf)))
    masks = []
    for on_device in (True, False):
        grammar = GrammarCompiler(hf).compile_lazy((BOOK,), "hermes")
        processor = LazyCallProcessor(grammar, on_device=on_device)
        processor(mx.array(prompt), logits)
        free = processor(mx.array([*prompt, *text]), logits)
        if not on_device:
            assert free is logits  # no op at all on a free step
        masks.append(np.array(processor(mx.array([*prompt, *text, opener]), logits)))
    assert (np.isfinite(masks[0]) == np.isfinite(masks[1])).all()
    assert np.isfinite(masks[1]).sum() < len(hf)


@pytest.mark.parametrize(("kind", "digits"), [("integer", 18), ("number", 15)])
def test_the_digit_bound_is_exact_in_llguidance(kind, digits):
    """llguidance compares bounds as doubles: no value with one digit more passes (an
    integer at 18 digits; a number's integer part at 15, where its ranges are exact)."""
    import llguidance
    from mlxd.actors.grammar import _byte_tokenizer

    schema = forced.bound_numbers({"type": kind}, forced.Bounds(integer_digits=18))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        return matcher.consume_tokens(list(text.encode())) and not matcher.is_error()

    assert accepts("1" + "0" * (digits - 1)) and accepts("-" + "1" * digits)
    assert not accepts("1" + "0" * digits) and not accepts("-1" + "0" * digits)
