"""The tool-call formats mlxd parses, and the one registry that picks one for a model.

Each entry names the markup a family of models writes, what in the chat
template (or, where the template does not say, the vocabulary) identifies it,
the special tokens its parser must see, and how its parser is built. The
entries are tried in order and the first match wins; ``detect`` also says why,
for ``mlxd parse`` and the log. Where mlx-lm ships the family's parser
(``mlx_lm.tool_parsers``) the entry wraps it (``mlx_lm_parsers.py``); mlxd's
own parsers cover what no library has: Hermes JSON with arguments streamed as
generated, Mistral, Llama 3 JSON, gpt-oss's harmony channels and Muse's messages
of the same shape, DeepSeek's markups, MiniMax-M3's nested XML, Functionary
v3.2's ``>>>`` messages, and the JSON-in-markers families (``json_markup.py``).
Callers never branch on a family's name: they ask this module.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from mlxd.actors.families import cut, forced, json_markup, tool_prompts
from mlxd.actors.families.delimited import HermesToolParser, one_section
from mlxd.actors.families.mlx_lm_parsers import library_parser
from mlxd.actors.parsers import (
    IdFactory,
    LeadingToolParser,
    MarkerToolParser,
    Parsed,
    _arguments_text,
    _json_values,
    _utf8,
    calls_from_values,
    new_call_id,
    parse_mistral,
)
from mlxd.protocol.messages import Tool, ToolCall


class ToolStream(Protocol):
    """An incremental parser: text in, content / reasoning / call pieces out."""

    def feed(self, text: str) -> Parsed: ...

    def flush(self, cut: bool = False) -> Parsed:
        """The rest of the output; ``cut``: the token limit ended it (``cut.py``)."""
        ...


# (make_id, the request's tools) → a parser for one request's output
Build = Callable[[IdFactory, tuple[Tool, ...]], ToolStream]


@dataclass(frozen=True, kw_only=True)
class CallMarkup:
    """How a format's calls are written: everything but its parser, in one record, so that
    a format cannot lose a feature by missing from a table (``_check`` runs at import).

    ``grammar`` writes one call from its opener to its closing markup (forced calls, and
    auto mode from the opener on: ``actors/lazy_calls.py``); ``openers`` are the texts that
    start a call in the answer (each the grammar's first marker); ``leading``: a call
    counts only as the answer's first bytes (a bare JSON object). ``between``: what may
    stand between two calls of one answer (``"\\n"``: an optional newline, ``""``:
    nothing), None where an answer holds one call (its markup has no second one, or the
    call ends the turn). After the last call the turn ends: no format has a place for text
    there. ``cut`` reads a call the token limit cut (None: its markup is dropped);
    ``prompt`` is mlxd's tool prompt in this markup for templates that render no tools
    (None: Hermes'). ``free`` says why calls stay free in auto mode, where they do.
    """

    grammar: forced.Builder | None
    openers: tuple[str, ...]
    leading: bool
    between: str | None
    cut: cut.CutRule | None
    prompt: tool_prompts.ToolPrompt | None
    free: str = ""

    @property
    def held(self) -> bool:
        """Whether a call the model opens in auto mode is held to its grammar."""
        return self.grammar is not None and bool(self.openers)


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call markup: how to recognise it and how to parse it."""

    name: str
    why: str  # what identifies it, for ``mlxd parse`` and the log
    build: Build
    calls: CallMarkup  # how its calls are written, held to their schema and cut
    template: tuple[str, ...] = ()  # all of these occur in the chat template
    alt: tuple[str, ...] = ()  # or any one of these does
    vocab: tuple[str, ...] = ()  # or all of these are tokens of the vocabulary
    show: tuple[str, ...] = ()  # marker tokens the detokenizer must not hide
    reasoning: bool = False  # its parser reads the reasoning too: it runs on every request
    # How the template wants call ids in the history (None: as the client sent them).
    history_id: Callable[[str], str] | None = None


def tool_dicts(tools: tuple[Tool, ...]) -> list[dict]:
    """Tools in the OpenAI shape mlx-lm's parsers read the parameter types from."""
    return [
        {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
        for t in tools
    ]


def _tool_call(found: dict, make_id: IdFactory) -> ToolCall | None:
    name, args = found.get("name"), found.get("arguments", {})
    text = _arguments_text(args if args is not None else {})
    if not isinstance(name, str) or not name or not _utf8(name) or text is None:
        return None
    return ToolCall(id=make_id(), name=name, arguments=text)


def library_body(name: str, make_id: IdFactory, tools: tuple[Tool, ...], rewrite=None):
    """A body parser over mlx-lm's parser ``name`` (``rewrite`` maps the body first)."""
    parser = library_parser(name)
    schemas = tool_dicts(tools) or None

    def parse(body: str) -> list[ToolCall] | None:
        text = rewrite(body) if rewrite else body
        try:
            found = parser.parse(text, schemas)  # type: ignore[union-attr]
        except (ValueError, SyntaxError, KeyError, IndexError, TypeError, RecursionError):
            return None  # the library's own "no call here": the text stays content
        calls = [_tool_call(f, make_id) for f in found]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    return parse if parser is not None else None


def library(name: str, start: str | None = None, end: str | None = None, rewrite=None) -> Build:
    """A format whose calls mlx-lm's parser ``name`` reads, between its markers (or these)."""

    def build(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
        parser = library_parser(name)
        body = library_body(name, make_id, tools, rewrite)
        if parser is None or body is None:  # the library broke its contract: plain JSON
            return _json(make_id, tools)
        return one_section(
            start if start is not None else parser.start,
            end if end is not None else parser.end,
            body,
        )

    return build


def markup(start: str, end: str, body: Callable[[str, IdFactory], list[ToolCall] | None]) -> Build:
    """A format whose calls ``body`` reads between ``start`` and ``end``."""
    return lambda make_id, tools: one_section(start, end, lambda t: body(t, make_id))


def mistral_id(call_id: str) -> str:
    """Mistral's templates refuse call ids that are not 9 letters or digits: a stable
    9-character digest of the client's id (a call and its result keep one id)."""
    import hashlib

    digest = hashlib.sha256(call_id.encode()).digest()
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(alphabet[b % len(alphabet)] for b in digest[:9])


def _hermes(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
    return HermesToolParser(make_id)


def _mistral(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
    return MarkerToolParser("[TOOL_CALLS]", lambda t: parse_mistral(t, make_id))


def _llama3(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
    def parse(text: str) -> list[ToolCall] | None:
        body = text.strip().removeprefix("<|python_tag|>")
        return calls_from_values(_json_values(body, ";"), make_id)

    return LeadingToolParser(("<|python_tag|>", "{"), parse)


def _json(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
    return LeadingToolParser(("{", "["), lambda t: json_markup.json_calls(t, make_id))


_HY3_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hy3_rewrite(body: str) -> str:
    """Tencent Hy3 writes GLM's markup with ``:opensource`` tags and a ``<tool_sep>``."""
    return body.replace(":opensource>", ">").replace("<tool_sep>", "")


def _hy3_body(make_id: IdFactory, tools: tuple[Tool, ...]):
    glm = library_body("glm47", make_id, tools)

    def parse(body: str) -> list[ToolCall] | None:
        parts = _HY3_CALL.findall(_hy3_rewrite(body))
        calls = [glm(p) if glm else None for p in parts]
        if not calls or any(not c for c in calls):
            return None
        return [c for found in calls for c in found]  # type: ignore[union-attr]

    return parse


def _hy3(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
    return one_section(
        "<tool_calls:opensource>", "</tool_calls:opensource>", _hy3_body(make_id, tools)
    )


_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _fenced_calls(body: str, make_id: IdFactory) -> list[ToolCall] | None:
    """Command R+: the calls after ``Action:`` are a JSON list in a ```json fence."""
    fenced = _FENCE.match(body)
    return json_markup.json_calls(fenced.group(1), make_id) if fenced else None


def _plugin(module: str) -> Build:
    """A format whose parser lives in its own module of this package (imported when used)."""

    def build(make_id: IdFactory, tools: tuple[Tool, ...]) -> ToolStream:
        import importlib

        return importlib.import_module(f"mlxd.actors.families.{module}").make_parser(make_id, tools)

    return build


def _grammar_of(module: str) -> forced.Builder:
    """A format whose call grammar lives in its own module of this package (imported when
    used: those modules import this one)."""

    def build(g: forced.Grammar, schema: dict) -> str:
        import importlib

        return importlib.import_module(f"mlxd.actors.families.{module}").grammar(g, schema)

    return build


# Tried in order: more specific markup before markup it contains (``<tool_call>`` last).
FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat(
        "harmony",
        "the template writes calls on the commentary channel to=functions.NAME (gpt-oss harmony)",
        _plugin("harmony"),
        template=("<|channel|>commentary", "<|start|>assistant"),
        vocab=("<|channel|>", "<|constrain|>", "<|call|>"),
        show=(
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|constrain|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
        ),
        reasoning=True,
        calls=CallMarkup(
            grammar=forced.harmony,
            openers=("<|channel|>commentary to=functions.",),
            leading=False,
            between=None,
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "deepseek_v3",
        "the template writes <｜tool▁calls▁begin｜> … <｜tool▁sep｜> (DeepSeek V3 / R1)",
        _plugin("deepseek"),
        template=("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"),
        show=(
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ),
        calls=CallMarkup(
            grammar=forced.deepseek_v3,
            openers=("<｜tool▁calls▁begin｜>",),
            leading=False,
            between="",
            cut=cut.DEEPSEEK_V3,
            prompt=tool_prompts.DEEPSEEK,
        ),
    ),
    ToolFormat(
        "deepseek_dsml",
        "the template writes <｜DSML｜invoke> markup (DeepSeek V3.2 / V4)",
        _plugin("deepseek"),
        template=("｜DSML｜",),
        show=("｜DSML｜",),
        calls=CallMarkup(
            grammar=forced.dsml,
            openers=("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"),
            leading=False,
            between="\n",
            cut=cut.DEEPSEEK_DSML,
            prompt=None,
        ),
    ),
    ToolFormat(
        "minimax_m2",
        "the template writes <minimax:tool_call> (MiniMax-M2; mlx-lm's minimax_m2 parser)",
        library("minimax_m2"),
        template=("<minimax:tool_call>",),
        show=("<minimax:tool_call>", "</minimax:tool_call>"),
        calls=CallMarkup(
            grammar=forced.MINIMAX_M2,
            openers=("<minimax:tool_call>",),
            leading=False,
            between="\n",
            cut=cut.MINIMAX_M2,
            prompt=None,
        ),
    ),
    ToolFormat(
        "minimax_m3",
        "the template writes ]<]minimax[>[<invoke name=…> with nested XML arguments (MiniMax-M3)",
        _plugin("minimax_m3"),
        template=("]<]minimax[>[",),
        show=("]<]minimax[>[",),
        calls=CallMarkup(
            grammar=_grammar_of("minimax_m3"),
            openers=("]<]minimax[>[<tool_call>",),
            leading=False,
            between=None,
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "gemma4",
        "the template writes <|tool_call>call:NAME{…}<tool_call|> (Gemma 4; mlx-lm's gemma4)",
        library("gemma4"),
        template=("<|tool_call>", "<tool_call|>"),
        show=("<|tool_call>", "<tool_call|>", '<|"|>'),
        calls=CallMarkup(
            grammar=forced.gemma4,
            openers=("<|tool_call>",),
            leading=False,
            between="",
            cut=cut.GEMMA4,
            prompt=None,
        ),
    ),
    ToolFormat(
        "function_gemma",
        "the template writes <start_function_call> (FunctionGemma; mlx-lm's function_gemma)",
        library("function_gemma"),
        template=("<start_function_call>",),
        show=("<start_function_call>", "<end_function_call>", "<escape>"),
        calls=CallMarkup(
            grammar=_grammar_of("function_gemma"),
            openers=("<start_function_call>",),
            leading=False,
            between="",
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "hy3",
        "the template writes <tool_calls:opensource> (Tencent Hy3: GLM's argument markup)",
        _hy3,
        template=(":opensource", "<tool_calls"),
        show=("<tool_calls:opensource>", "</tool_calls:opensource>"),
        calls=CallMarkup(
            grammar=forced.HY3,
            openers=("<tool_calls:opensource>",),
            leading=False,
            between="\n",
            cut=cut.HY3,
            prompt=None,
        ),
    ),
    ToolFormat(
        "glm47",
        "the template writes <arg_key>/<arg_value> pairs (GLM-4.5+; mlx-lm's glm47 parser)",
        library("glm47"),
        template=("<arg_key>",),
        show=(
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        calls=CallMarkup(
            grammar=forced.GLM47,
            openers=("<tool_call>",),
            leading=False,
            between="\n",
            cut=cut.GLM47,
            prompt=None,
        ),
    ),
    ToolFormat(
        "pythonic",
        "the template writes <|tool_call_start|>[name(arg=…)] (LFM2; mlx-lm's pythonic parser)",
        library("pythonic"),
        template=("<|tool_call_start|>",),
        vocab=("<|tool_call_start|>", "<|tool_call_end|>"),
        show=("<|tool_call_start|>", "<|tool_call_end|>"),
        calls=CallMarkup(
            grammar=forced.pythonic,
            openers=("<|tool_call_start|>",),
            leading=False,
            between="",
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "seed_oss",
        "the template writes <seed:tool_call><function=…> (Seed-OSS; mlx-lm's qwen3_coder body)",
        library("qwen3_coder", "<seed:tool_call>", "</seed:tool_call>"),
        template=("<seed:tool_call>",),
        show=("<seed:tool_call>", "</seed:tool_call>"),
        calls=CallMarkup(
            grammar=forced.SEED_OSS,
            openers=("<seed:tool_call>",),
            leading=False,
            between="\n",
            cut=cut.SEED_OSS,
            prompt=None,
        ),
    ),
    ToolFormat(
        "qwen3_coder",
        "the template writes <tool_call><function=NAME><parameter=…> (Qwen3-Coder, Qwen3.5; "
        "mlx-lm's qwen3_coder parser)",
        library("qwen3_coder"),
        template=("<tool_call>\n<function=",),
        show=("<tool_call>", "</tool_call>"),
        calls=CallMarkup(
            grammar=forced.QWEN3_CODER,
            openers=("<tool_call>",),
            leading=False,
            between="\n",
            cut=cut.QWEN3_CODER,
            prompt=None,
        ),
    ),
    ToolFormat(
        "kimi_k2",
        "the template writes <|tool_calls_section_begin|> (Kimi K2; mlx-lm's kimi_k2 parser)",
        library("kimi_k2"),
        template=("<|tool_calls_section_begin|>",),
        vocab=("<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>"),
        show=(
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        calls=CallMarkup(
            grammar=forced.kimi_k2,
            openers=("<|tool_calls_section_begin|>",),
            leading=False,
            between="",
            cut=cut.KIMI_K2,
            prompt=None,
        ),
    ),
    ToolFormat(
        "minicpm5",
        "the template writes <function name=…><param name=…> (MiniCPM 5; mlx-lm's minicpm5)",
        library("minicpm5"),
        template=('<function name="', '<param name="'),
        calls=CallMarkup(
            grammar=forced.MINICPM5,
            openers=('<function name="',),
            leading=False,
            between="\n",
            cut=cut.MINICPM5,
            prompt=None,
        ),
    ),
    ToolFormat(
        "muse_spark",
        "the template writes messages to=self (reasoning), to=user and to=NAME holding "
        "<atem:function_calls> (Muse; harmony's message shape, mlx-lm's muse_spark parser)",
        _plugin("muse"),
        template=("<atem:function_calls>",),
        show=("<|start|>", "<|message|>", "<|eom|>", "<|eot|>"),
        reasoning=True,
        calls=CallMarkup(
            grammar=_grammar_of("muse"),
            openers=("<atem:function_calls>",),
            leading=False,
            between=None,
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "kimi_k3",
        "the vocabulary has Kimi K3's <|open|>/<|close|>/<|sep|> markup tokens (mlx-lm's kimi_k3)",
        library("kimi_k3"),
        vocab=("<|open|>", "<|close|>", "<|sep|>"),
        template=("<|open|>", "<|close|>", "<|sep|>"),
        show=("<|open|>", "<|close|>", "<|sep|>"),
        calls=CallMarkup(
            grammar=_grammar_of("kimi_k3"),
            openers=("<|open|>tools<|sep|>",),
            leading=False,
            between=None,
            cut=None,
            prompt=None,
        ),
    ),
    ToolFormat(
        "mistral",
        "the template writes [TOOL_CALLS] (Mistral, Devstral, Ministral)",
        _mistral,
        template=("[TOOL_CALLS]",),
        vocab=("[TOOL_CALLS]", "[ARGS]"),
        show=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
        history_id=mistral_id,
        calls=CallMarkup(
            grammar=forced.mistral,
            openers=("[TOOL_CALLS]",),
            leading=False,
            between="",
            cut=cut.MISTRAL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "apertus",
        "the template writes <|tools_prefix|>[{NAME: {…}}]<|tools_suffix|> (Apertus)",
        markup("<|tools_prefix|>", "<|tools_suffix|>", json_markup.json_calls),
        template=("<|tools_prefix|>",),
        show=("<|tools_prefix|>", "<|tools_suffix|>"),
        calls=CallMarkup(
            grammar=forced.apertus,
            openers=("<|tools_prefix|>",),
            leading=False,
            between="",
            cut=cut.APERTUS,
            prompt=None,
        ),
    ),
    ToolFormat(
        "apriel",
        "the template writes <tool_calls>[…]</tool_calls> (Apriel, MiniMax-M1)",
        markup("<tool_calls>", "</tool_calls>", json_markup.json_calls),
        template=("<tool_calls>",),
        show=("<tool_calls>", "</tool_calls>"),
        calls=CallMarkup(
            grammar=forced.apriel,
            openers=("<tool_calls>",),
            leading=False,
            between="\n",
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "nemotron_v2",
        "the template writes <TOOLCALL>[…]</TOOLCALL> (Nemotron Nano v2)",
        markup("<TOOLCALL>", "</TOOLCALL>", json_markup.json_calls),
        template=("<TOOLCALL>",),
        show=("<TOOLCALL>", "</TOOLCALL>"),
        calls=CallMarkup(
            grammar=forced.NEMOTRON_V2,
            openers=("<TOOLCALL>",),
            leading=False,
            between="\n",
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "command_r",
        "the template writes <|START_ACTION|>[…]<|END_ACTION|> (Cohere Command)",
        markup("<|START_ACTION|>", "<|END_ACTION|>", json_markup.json_calls),
        template=("<|START_ACTION|>",),
        # and the answer's markup, which the reasoning stage drops (reasoning.Tags.drop)
        show=(
            "<|START_ACTION|>",
            "<|END_ACTION|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_TEXT|>",
            "<|END_TEXT|>",
        ),
        calls=CallMarkup(
            grammar=forced.command_r,
            openers=("<|START_ACTION|>",),
            leading=False,
            between="\n",
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "gigachat",
        "the template writes <|function_call|>{…} (GigaChat 3.1)",
        markup("<|function_call|>", "", json_markup.json_calls),
        template=("<|function_call|>",),
        show=("<|function_call|>",),
        calls=CallMarkup(
            grammar=forced.GIGACHAT,
            openers=("<|function_call|>",),
            leading=False,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "solar",
        "the template writes <|tool_calls|><|tool_call:begin|>… (Solar Open)",
        markup("<|tool_calls|>", "<|calls|>", json_markup.solar_calls),
        template=("<|tool_call:name|>",),
        show=(
            "<|tool_calls|>",
            "<|calls|>",
            "<|tool_call:begin|>",
            "<|tool_call:name|>",
            "<|tool_call:args|>",
            "<|tool_call:end|>",
            "<|begin|>",  # the answer's message header, which the reasoning stage drops
            "<|content|>",
        ),
        calls=CallMarkup(
            grammar=forced.solar,
            openers=("<|tool_calls|>",),
            leading=False,
            between="",
            cut=cut.SOLAR,
            prompt=None,
        ),
    ),
    ToolFormat(
        "functionary",
        "the template writes <function=NAME>{…}</function> (Functionary v3.1)",
        markup("<function=", "</function>", json_markup.functionary_call),
        template=("<function=", "</function>"),
        calls=CallMarkup(
            grammar=forced.functionary,
            openers=("<function=",),
            leading=False,
            between="\n",
            cut=cut.FUNCTIONARY,
            prompt=None,
        ),
    ),
    ToolFormat(
        "functionary_v3_2",
        "the template writes >>>NAME messages, {…} on the next line, >>>all for text "
        "(Functionary v3.2)",
        _plugin("functionary_v3_2"),
        template=(">>>all",),
        calls=CallMarkup(
            grammar=forced.functionary_v3_2,
            openers=(),
            leading=False,
            between=None,
            cut=None,
            prompt=None,
            free="the prompt's >>> opens every message, text or call: there is no opener in the answer",
        ),
    ),
    ToolFormat(
        "command_r_plus",
        'the template writes Action: ```json [{"tool_name": …, "parameters": …}]``` (Command R+)',
        markup("Action:", "", _fenced_calls),
        template=("Action:\n```json",),
        calls=CallMarkup(
            grammar=forced.command_r_plus,
            openers=("Action:",),
            leading=False,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "granite",
        "the template writes <|tool_call|>[…] (Granite 3.x)",
        markup("<|tool_call|>", "", json_markup.json_calls),
        template=("<|tool_call|>",),
        show=("<|tool_call|>",),
        calls=CallMarkup(
            grammar=forced.GRANITE,
            openers=("<|tool_call|>",),
            leading=False,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "firefunction",
        "the template writes functools[…] (FireFunction v2)",
        markup("functools", "", json_markup.json_calls),
        template=("functools[",),
        calls=CallMarkup(
            grammar=forced.FIREFUNCTION,
            openers=("functools[",),
            leading=False,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "gigachat3",
        "the template gives calls a `function call` role (GigaChat 3)",
        markup("function call<|role_sep|>", "", json_markup.json_calls),
        template=("'function call'", "<|role_sep|>"),
        show=("<|role_sep|>",),
        calls=CallMarkup(
            grammar=forced.GIGACHAT3,
            openers=("<|message_sep|>\n\nfunction call<|role_sep|>",),
            leading=False,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "hermes",
        'the template writes <tool_call>{"name": …, "arguments": …}</tool_call> (Hermes, '
        "Qwen 2.5 / 3, Granite 4)",
        _hermes,
        template=("<tool_call>",),
        show=("<tool_call>", "</tool_call>"),
        calls=CallMarkup(
            grammar=forced.hermes,
            openers=("<tool_call>",),
            leading=False,
            between="\n",
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
    ToolFormat(
        "llama3",
        'the template writes calls as bare JSON {"name", "parameters"} (Llama 3.1+)',
        _llama3,
        template=("<|python_tag|>",),
        alt=("<|start_header_id|>ipython",),
        show=("<|python_tag|>",),
        calls=CallMarkup(
            grammar=forced.llama3,
            openers=("{",),
            leading=True,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
)

# Formats chosen only by the settings or as fallbacks.
FALLBACKS: tuple[ToolFormat, ...] = (
    ToolFormat(
        "json",
        "the template renders tools but names no call markup: a leading JSON call object",
        _json,
        calls=CallMarkup(
            grammar=forced.json_call,
            openers=("{",),
            leading=True,
            between=None,
            cut=cut.JSON_CALL,
            prompt=None,
        ),
    ),
)
BY_NAME = {f.name: f for f in FORMATS + FALLBACKS}
TOOL_FORMATS = tuple(BY_NAME)


def _check(table: tuple[ToolFormat, ...]) -> None:
    """Every format's record is whole: a format whose calls stay free says why, and one that
    is held has an opener (a leading one: exactly one)."""
    for fmt in table:
        c = fmt.calls
        if c.held == bool(c.free):
            raise TypeError(
                f"tool format {fmt.name}: held calls give no reason to stay free, "
                "free calls give one"
            )
        if c.leading and len(c.openers) != 1:
            raise TypeError(f"tool format {fmt.name}: a leading call has one opener")
        if c.between is not None and not c.held:
            raise TypeError(f"tool format {fmt.name}: several calls need a grammar and an opener")


_check(FORMATS + FALLBACKS)


def markup_table() -> str:
    """The tool-call page's table of every format's call markup (``docs/tools.md``; a test
    keeps the page equal to this)."""

    def code(text: str) -> str:
        return "`" + text.replace("\n", "\\n").replace("|", "\\|") + "`"

    rows = [
        "| format | opens a call | several calls in one answer | held in auto mode |",
        "|---|---|---|---|",
    ]
    for fmt in FORMATS + FALLBACKS:
        c = fmt.calls
        opens = ", ".join(code(o) for o in c.openers) or "—"
        if c.leading:
            opens += " as the answer's first non-blank character"
        several = (
            "one call per answer"
            if c.between is None
            else ("back to back" if not c.between else f"{code(c.between)} between them")
        )
        held = "yes" if c.held else f"no: {c.free}"
        rows.append(f"| `{fmt.name}` | {opens} | {several} | {held} |")
    return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class Detected:
    """The format chosen for a model, and why."""

    format: ToolFormat
    why: str


def detect(template: str, vocab: Collection[str] = ()) -> Detected:
    """The tool-call format of a chat template, else of the vocabulary, else a fallback."""
    plain = template.replace("\\n", "\n")  # markup written with escaped newlines in Jinja strings
    for fmt in FORMATS:
        if (fmt.template and all(m in plain for m in fmt.template)) or any(
            m in plain for m in fmt.alt
        ):
            return Detected(fmt, f"template: {fmt.why}")
    for fmt in FORMATS:
        if fmt.vocab and all(m in vocab for m in fmt.vocab):
            return Detected(fmt, f"vocabulary: {fmt.why}")
    if "tools" in template:
        return Detected(BY_NAME["json"], f"template: {BY_NAME['json'].why}")
    return Detected(
        BY_NAME["hermes"],
        "the template does not render tools: mlxd describes them in a system prompt and "
        "asks for Hermes <tool_call> markup",
    )


def named(name: str) -> ToolFormat:
    """A format the settings name (``tokenizer.tool_format``)."""
    if name not in BY_NAME:
        raise ValueError(f"unknown tool format {name!r}; known: auto, {', '.join(TOOL_FORMATS)}")
    return BY_NAME[name]


def make_tool_parser(
    name: str, make_id: IdFactory = new_call_id, tools: tuple[Tool, ...] = ()
) -> ToolStream:
    """The incremental parser for the format ``name``; it reads a call the token limit cut
    by the format's ``calls.cut`` rule (none: the cut call's markup is dropped)."""
    fmt = named(name)
    parser = fmt.build(make_id, tools)
    rule = fmt.calls.cut
    if rule is not None and hasattr(parser, "read_cut"):
        parser.read_cut = functools.partial(cut.cut_calls, rule=rule, make_id=make_id)  # type: ignore[attr-defined]
    return parser
