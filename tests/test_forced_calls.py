"""Forced tool calls stay in the family's own markup (``actors/families/forced.py``).

For each format: the grammar of a forced call to a tool with a string, an integer and
an object parameter accepts the call as the family's chat template writes it (whitespace
and all; JSON in the compact layout forced calls use) and rejects it off the markup, and
the family's parser reads the accepted text back as that one call. Samples are checked on
a byte-level vocabulary; special-token markers on a small HF tokenizer with added tokens.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from mlxd.actors.families import formats
from mlxd.actors.grammar import GrammarCompiler, _byte_tokenizer, tool_call_lark, tool_call_schema
from mlxd.protocol.messages import Constraint, Tool

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
OTHER = Tool(name="other", parameters={"type": "object", "properties": {}})
ARGS = {"city": "Le Mans", "nights": 3, "prefs": {"view": "sea"}}
A = '{"city":"Le Mans","nights":3,"prefs":{"view":"sea"}}'  # the compact layout
CALL = '{"name":"book","arguments":' + A + "}"

# One call as each family's template renders it (.cache/templates, rendered with
# transformers' render_jinja_template), JSON made compact.
SAMPLES = {
    "hermes": f"<tool_call>\n{CALL}\n</tool_call>",
    "mistral": f"[TOOL_CALLS][{CALL}]",
    "llama3": CALL,
    "json": CALL,
    "qwen3_coder": "<tool_call>\n<function=book>\n<parameter=city>\nLe Mans\n</parameter>\n"
    '<parameter=nights>\n3\n</parameter>\n<parameter=prefs>\n{"view":"sea"}\n</parameter>\n'
    "</function>\n</tool_call>",
    "seed_oss": "<seed:tool_call>\n<function=book>\n<parameter=city>Le Mans</parameter>\n"
    '<parameter=nights>3</parameter>\n<parameter=prefs>{"view":"sea"}</parameter>\n'
    "</function>\n</seed:tool_call>",
    "glm47": "<tool_call>book<arg_key>city</arg_key><arg_value>Le Mans</arg_value>"
    "<arg_key>nights</arg_key><arg_value>3</arg_value>"
    '<arg_key>prefs</arg_key><arg_value>{"view":"sea"}</arg_value></tool_call>',
    "hy3": "<tool_calls:opensource>\n<tool_call:opensource>book<tool_sep:opensource>\n"
    "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Le Mans"
    "</arg_value:opensource>\n<arg_key:opensource>nights</arg_key:opensource>\n"
    "<arg_value:opensource>3</arg_value:opensource>\n<arg_key:opensource>prefs"
    '</arg_key:opensource>\n<arg_value:opensource>{"view":"sea"}</arg_value:opensource>\n'
    "</tool_call:opensource>\n</tool_calls:opensource>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="book">\n<parameter name="city">Le Mans'
    '</parameter>\n<parameter name="nights">3</parameter>\n<parameter name="prefs">'
    '{"view":"sea"}</parameter>\n</invoke>\n</minimax:tool_call>',
    "minicpm5": '<function name="book"><param name="city">Le Mans</param>'
    '<param name="nights">3</param><param name="prefs">{"view":"sea"}</param></function>',
    "deepseek_dsml": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="book">\n'
    '<｜DSML｜parameter name="city" string="true">Le Mans</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="nights" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="prefs" string="false">{"view":"sea"}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    "gemma4": '<|tool_call>call:book{city:<|"|>Le Mans<|"|>,nights:3,'
    'prefs:{view:<|"|>sea<|"|>}}<tool_call|>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.book:0"
    f"<|tool_call_argument_begin|>{A}<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>book<｜tool▁sep｜>"
    f"{A}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": f"<|channel|>commentary to=functions.book <|constrain|>json<|message|>{A}<|call|>",
    "pythonic": '<|tool_call_start|>[book(city=\'Le Mans\', nights=3, prefs={"view":"sea"})]'
    "<|tool_call_end|>",
    "apriel": f"<tool_calls>[{CALL}]</tool_calls>",
    "nemotron_v2": f"<TOOLCALL>[{CALL}]</TOOLCALL>",
    "command_r": '<|START_ACTION|>[\n    {"tool_call_id":"0","tool_name":"book","parameters":'
    f"{A}}}\n]<|END_ACTION|>",
    "apertus": f'<|tools_prefix|>[{{"book":{A}}}]<|tools_suffix|>',
    "gigachat": f"<|function_call|>{CALL}",
    "solar": "<|tool_calls|><|tool_call:begin|>call_1<|tool_call:name|>book<|tool_call:args|>"
    f"{A}<|tool_call:end|><|calls|>",
    "functionary": f"<function=book>{A}</function>",
    "functionary_v3_2": f"book\n{A}",
    "command_r_plus": 'Action:\n```json\n[\n    {"tool_name":"book","parameters":' + A + "}\n]```",
    "gigachat3": f"<|message_sep|>\n\nfunction call<|role_sep|>\n{CALL}",
    "granite": f"<|tool_call|>[{CALL}]",
    "firefunction": f"functools[{CALL}]",
}

# Special tokens of the markup that the detokenizer hides from the parser (not in ``show``).
HIDDEN = {"gigachat3": "<|message_sep|>"}

# The same call in a sibling model's layout of the same format.
VARIANTS = {
    "glm47": "<tool_call>book\n<arg_key>city</arg_key>\n<arg_value>Le Mans</arg_value>\n"
    "<arg_key>nights</arg_key>\n<arg_value>3</arg_value>\n<arg_key>prefs</arg_key>\n"
    '<arg_value>{"view":"sea"}</arg_value>\n</tool_call>',  # GLM 4.5 / 4.6
    "deepseek_dsml": SAMPLES["deepseek_dsml"].replace("function_calls", "tool_calls"),  # V4
    "apriel": f"<tool_calls>\n{CALL}\n</tool_calls>",  # MiniMax-M1
}

# Formats whose grammar and samples live in tests/test_more_grammars.py (their markup
# nests: the samples here are one-level JSON-like calls).
ELSEWHERE = {"function_gemma", "muse_spark", "kimi_k3", "minimax_m3"}


def grammar(fmt: str, tools: tuple[Tool, ...] = (BOOK,), names: tuple[str, ...] = ("book",)):
    return llguidance.LLMatcher.grammar_from_lark(
        tool_call_lark(tool_call_schema(tools, names), fmt)
    )


def accepts(fmt: str, text: str, tools: tuple[Tool, ...] = (BOOK,), names=("book",)) -> bool:
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar(fmt, tools, names), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def parsed(fmt: str, text: str, tools: tuple[Tool, ...] = (BOOK,)) -> list[tuple[str, dict]]:
    parser = formats.make_tool_parser(fmt, tools=tools)
    out = parser.feed(text.replace(HIDDEN.get(fmt, "\0"), ""))
    out.extend(parser.flush())
    assert not out.content.strip(), out.content
    calls: list[list[str]] = []  # [name, arguments] each; a call's first piece has its name
    for piece in out.calls:
        if piece.name is not None:
            calls.append([piece.name, ""])
        calls[-1][1] += piece.arguments
    return [(name, json.loads(arguments)) for name, arguments in calls]


def test_every_format_has_a_grammar_and_a_sample():
    built = {f.name for f in formats.BY_NAME.values() if f.calls.grammar is not None}
    assert built == set(formats.TOOL_FORMATS)
    assert set(formats.TOOL_FORMATS) - ELSEWHERE == set(SAMPLES)


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_the_template_markup_is_accepted_and_parsed_back(fmt):
    for text in (SAMPLES[fmt], VARIANTS.get(fmt, SAMPLES[fmt])):
        assert accepts(fmt, text), text
        assert parsed(fmt, text) == [("book", ARGS)]


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_the_markup_is_forced_from_the_first_byte(fmt):
    """The grammar's forced prefix is the sample's start: the model cannot open otherwise."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar(fmt), log_level=0)
    prefix = matcher.compute_ff_bytes().decode()
    assert prefix and SAMPLES[fmt].startswith(prefix)


@pytest.mark.parametrize("fmt", sorted(set(SAMPLES) - {"json", "llama3"}))
def test_off_markup_text_is_rejected(fmt):
    sample = SAMPLES[fmt]
    assert not accepts(fmt, CALL)  # the bare JSON object
    assert not accepts(fmt, "Sure! " + sample)
    assert not accepts(fmt, sample.replace("book", "bake"))
    assert not accepts(fmt, sample.replace("3", "3.5"))  # nights is an integer
    assert not accepts(fmt, sample[:-1])


@pytest.mark.parametrize("fmt", ["json", "llama3"])
def test_the_bare_object_formats_reject_other_calls(fmt):
    assert not accepts(fmt, CALL.replace("book", "bake"))
    assert not accepts(fmt, CALL.replace("3", "3.5"))
    assert not accepts(fmt, "<tool_call>\n" + CALL)


# The text that closes a string parameter, and the call's own end marker.
CLOSERS = {
    "qwen3_coder": ("\n</parameter>", "</tool_call>"),
    "seed_oss": ("</parameter>", "</seed:tool_call>"),
    "glm47": ("</arg_value>", "</tool_call>"),
    "minimax_m2": ("</parameter>", "</minimax:tool_call>"),
    "minicpm5": ("</param>", "</function>"),
    "deepseek_dsml": ("</｜DSML｜parameter>", "</｜DSML｜function_calls>"),
    "gemma4": ('<|"|>', "<tool_call|>"),
}


@pytest.mark.parametrize("fmt", sorted(CLOSERS))
def test_a_string_value_cannot_hold_its_closing_tag_or_the_end_marker(fmt):
    for marker in CLOSERS[fmt]:
        assert not accepts(fmt, SAMPLES[fmt].replace("Le Mans", f"Le{marker}Mans"))
    free = "Le <b>Mans</b>\n& more, {x}"  # other markup is just text
    assert accepts(fmt, SAMPLES[fmt].replace("Le Mans", free))
    assert parsed(fmt, SAMPLES[fmt].replace("Le Mans", free))[0][1]["city"] == free


def test_optional_parameters_may_be_left_out_in_order():
    params = {**PARAMS, "required": ["nights"]}
    tools = (Tool(name="book", parameters=params),)
    nights = "<parameter=nights>\n3\n</parameter>\n"
    qwen = f"<tool_call>\n<function=book>\n{nights}</function>\n</tool_call>"
    assert accepts("qwen3_coder", qwen, tools)
    assert parsed("qwen3_coder", qwen, tools) == [("book", {"nights": 3})]
    assert not accepts("qwen3_coder", qwen.replace(nights, ""), tools)
    gemma = SAMPLES["gemma4"]
    for text in (
        gemma,
        "<|tool_call>call:book{nights:3}<tool_call|>",
        '<|tool_call>call:book{city:<|"|>x<|"|>,nights:3}<tool_call|>',
    ):
        assert accepts("gemma4", text, tools), text
    assert not accepts("gemma4", "<|tool_call>call:book{,nights:3}<tool_call|>", tools)
    assert not accepts(
        "gemma4", '<|tool_call>call:book{nights:3,city:<|"|>x<|"|>}<tool_call|>', tools
    )
    python = "<|tool_call_start|>[book(nights=3)]<|tool_call_end|>"
    assert accepts("pythonic", python, tools)
    assert parsed("pythonic", python, tools) == [("book", {"nights": 3})]


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm47", "gemma4", "kimi_k2", "harmony", "mistral"])
def test_required_allows_any_offered_tool(fmt):
    tools, names = (BOOK, OTHER), ("book", "other")
    assert accepts(fmt, SAMPLES[fmt], tools, names)
    assert not accepts(fmt, SAMPLES[fmt], tools, ("other",))


def test_string_enums_are_enforced_in_element_values():
    params = {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["unit"],
    }
    tools = (Tool(name="book", parameters=params),)
    text = "<tool_call>book<arg_key>unit</arg_key><arg_value>{}</arg_value></tool_call>"
    assert accepts("glm47", text.format("C"), tools)
    assert not accepts("glm47", text.format("K"), tools)


# ---- markers that are special tokens -------------------------------------------------------


def _hf_tokenizer(specials: list[str]):
    """A byte-level BPE vocabulary (no merges) with these special tokens and ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["</s>", *specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


KIMI = [
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
]


def _spelled(hf, text: str) -> list[int]:
    """``text`` in byte tokens only, special-token markers spelled out."""
    return [t for ch in text for t in hf.encode(ch, add_special_tokens=False)]


def test_special_token_markers_are_named_by_id_and_cannot_be_spelled():
    hf = _hf_tokenizer(KIMI)
    compiler = GrammarCompiler(hf)
    constraint = Constraint(kind="tool_call", tool_names=("book",))
    lark_text = tool_call_lark(tool_call_schema((BOOK,), ("book",)), "kimi_k2", compiler._split)
    for marker in KIMI:
        assert f"<[{hf.convert_tokens_to_ids(marker)}]>" in lark_text

    def accepts_tokens(tokens: list[int]) -> bool:
        matcher = compiler.compile(constraint, (BOOK,), "kimi_k2").matcher
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    tokens = hf.encode(SAMPLES["kimi_k2"], add_special_tokens=False)
    assert sum(t >= 256 for t in tokens) == len(KIMI)
    assert accepts_tokens(tokens)
    assert not accepts_tokens(_spelled(hf, SAMPLES["kimi_k2"]))
    text = hf.decode(tokens)
    assert parsed("kimi_k2", text) == [("book", ARGS)]


def test_a_marker_with_a_special_token_inside_is_split_around_it():
    """DeepSeek DSML: where ``｜DSML｜`` is one special token, the tags around it stay text."""
    hf = _hf_tokenizer(["｜DSML｜"])
    split = GrammarCompiler(hf)._split
    dsml = hf.convert_tokens_to_ids("｜DSML｜")
    assert split('<｜DSML｜invoke name="book">') == ["<", dsml, 'invoke name="book">']
    assert split("plain text") == ["plain text"]
    compiler = GrammarCompiler(hf)
    matcher = compiler.compile(
        Constraint(kind="tool_call", tool_names=("book",)), (BOOK,), "deepseek_dsml"
    ).matcher
    assert matcher.consume_tokens(hf.encode(SAMPLES["deepseek_dsml"], add_special_tokens=False))
    assert matcher.is_accepting()


def test_mistral_writes_name_and_args_where_the_vocabulary_has_args():
    hf = _hf_tokenizer(["[TOOL_CALLS]", "[ARGS]"])
    compiler = GrammarCompiler(hf)
    matcher = compiler.compile(
        Constraint(kind="tool_call", tool_names=("book",)), (BOOK,), "mistral"
    ).matcher
    text = f"[TOOL_CALLS]book[ARGS]{A}"
    assert matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
    assert matcher.is_accepting()
    assert parsed("mistral", text) == [("book", ARGS)]


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_each_format_with_its_markers_as_special_tokens(fmt):
    """The markers the format shows are special tokens of the vocabulary: the grammar names
    them by id, so the sample in the model's own tokens is accepted."""
    shown = [m for m in formats.named(fmt).show if m in SAMPLES[fmt]]
    hf = _hf_tokenizer(shown)
    compiler = GrammarCompiler(hf)
    constraint = Constraint(kind="tool_call", tool_names=("book",))
    matcher = compiler.compile(constraint, (BOOK,), fmt).matcher
    tokens = hf.encode(SAMPLES[fmt], add_special_tokens=False)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    if shown:
        spelled = compiler.compile(constraint, (BOOK,), fmt).matcher
        assert not (spelled.consume_tokens(_spelled(hf, SAMPLES[fmt])) and spelled.is_accepting())


@pytest.mark.parametrize(
    "fmt",
    [
        "qwen3_coder",
        "seed_oss",
        "hy3",
        "minimax_m2",
        "minicpm5",
        "gemma4",
        "pythonic",
    ],
)
def test_a_call_without_parameters_is_forced_whole(fmt):
    """No parameters: the grammar forces every byte of the call (GLM's optional newlines and
    DSML's two block names leave a choice); the parser reads it back."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar(fmt, (OTHER,), ("other",)))
    text = matcher.compute_ff_bytes().decode()
    assert all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()
    assert parsed(fmt, text, (OTHER,)) == [("other", {})]
