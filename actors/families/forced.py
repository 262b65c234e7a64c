"""Forced tool calls in each family's own markup: one Lark grammar builder per format.

With ``tool_choice`` ``required`` or a named function, llguidance holds the answer
to one call; the grammar is written here in the markup the model was trained on
(as its chat template renders a call), so that the family's parser
(``formats.py``) reads it back. Markers are written as the vocabulary has them:
a special token (``<[id]>``, which no run of text bytes can produce) where it is
one, quoted text otherwise (``Grammar.mark``; the grammar compiler passes
``split``, which asks the tokenizer).

Arguments: where a call's arguments are one JSON object, that object is
``%json`` of the strict schema, with at most one space between tokens (``CALL_LAYOUT``). Where each parameter is an element of
its own (XML-like markups, Gemma 4, pythonic), the parameters come in schema
order (Gemma 4: sorted, as its template writes them), required ones always,
optional ones maybe; a typed non-string value is ``%json`` of its property
schema; a string is free text that cannot hold its closing tag or the call's
end marker, with its ``enum`` enforced but not ``pattern``, ``format`` or
lengths. Gemma 4's nested objects and arrays follow Gemma's syntax, not their
schema. Numbers are bounded (``Bounds``). The call starts at
the answer's first token: no reasoning comes before it. In ``tool_choice: auto`` the
same grammar holds the rest of the answer from the call's opener on (``formats.CallMarkup``,
``actors/lazy_calls.py``): the call, then only another call or the end.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A call's JSON takes at most one space wherever JSON allows whitespace: the compact layout
# and json.dumps's (", " and ": ", as chat templates render calls) both fit, and a small model
# cannot spend its tokens on a run of blanks (see ``grammar.JSON_LAYOUT``).
CALL_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": " ?"}

# A marker's text → its pieces: plain text, or the id of a special token.
Split = Callable[[str], list[str | int]]


def as_text(text: str) -> list[str | int]:
    """No vocabulary to ask (a byte-level check): every marker is text."""
    return [text]


def strict(params: dict) -> dict:
    """Object parameters take no properties beyond those named, as in OpenAI's strict mode."""
    if params.get("type") == "object" and "additionalProperties" not in params:
        return {**params, "additionalProperties": not params.get("properties")}
    return params


@dataclass(frozen=True)
class Call:
    """One function the answer may call, with the strict schema of its arguments."""

    name: str
    params: dict


def calls_of(schema: dict) -> list[Call]:
    """The calls of ``grammar.tool_call_schema``'s ``{"name": const, "arguments": …}`` options."""
    options = schema.get("anyOf") or [schema]
    return [Call(o["properties"]["name"]["const"], o["properties"]["arguments"]) for o in options]


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's; non-ASCII stays as written)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Bounds:
    """How long a number in a call may be (``tokenizer.max_integer_digits`` and
    ``tokenizer.max_fraction_digits``): without a bound, greedy decoding can write
    ``1000000…`` until ``max_tokens`` cuts the call. No exponent is written."""

    integer_digits: int = 18  # an int64 holds every 18-digit integer (a number: at most 15)
    fraction_digits: int = 10  # llguidance's ``multipleOf`` takes at most 10 (1e-12 is inexact)


def bound_numbers(schema: Any, bounds: Bounds) -> Any:
    """``schema`` with every integer and number bounded (where the schema sets no bound of
    its own): integers to ``integer_digits`` digits (``minimum`` / ``maximum``), numbers to
    as many before the point and ``fraction_digits`` after it (``multipleOf``)."""
    if isinstance(schema, list):
        return [bound_numbers(s, bounds) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, sub in schema.items():
        if key in _LITERAL_KEYS:
            out[key] = sub
        elif key in _SCHEMA_MAPS and isinstance(sub, dict):  # names → schemas
            out[key] = {name: bound_numbers(s, bounds) for name, s in sub.items()}
        else:
            out[key] = bound_numbers(sub, bounds)
    named = out.get("type")
    kinds = {k for k in (named if isinstance(named, list) else [named]) if isinstance(k, str)}
    if "number" in kinds or "integer" in kinds:
        # llguidance reads bounds as doubles, where 10**18 - 1 is 10**18 (19 digits): the
        # largest double below 10**N is exact, an integer, and has N digits. A number's
        # range is exact in llguidance only to 15 digits (1e18 passed a 9.99e17 maximum).
        digits = bounds.integer_digits if "number" not in kinds else min(bounds.integer_digits, 15)
        whole = int(math.nextafter(float(10**digits), 0.0))
        limit = whole if "number" not in kinds else float(whole)
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -limit
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = limit
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{bounds.fraction_digits}")
    return out


# Keys whose values are data, not subschemas (``const``, ``enum``, defaults, examples), and
# keys whose values map names to subschemas (a property may be named ``type``).
_LITERAL_KEYS = frozenset({"const", "enum", "default", "examples", "required", "x-guidance"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


class Grammar:
    """A Lark grammar under construction: numbered rules, markers as the vocabulary has them."""

    def __init__(self, split: Split = as_text, bounds: Bounds | None = None):
        self._split = split
        self._rules: dict[str, str] = {}
        self.bounds = bounds or Bounds()

    def mark(self, text: str) -> str:
        """``text`` as a sequence: its special tokens by id, the rest quoted."""
        return _sequence(self._split(text) if text else [])

    def special(self, text: str) -> bool:
        """Whether ``text`` is one special token of the vocabulary."""
        pieces = self._split(text)
        return len(pieces) == 1 and isinstance(pieces[0], int)

    def rule(self, body: str, options: str = "") -> str:
        name = f"r{len(self._rules)}"
        self._rules[name] = f"{name}{options}: {body}"
        return name

    def define(self, name: str, body: str) -> None:
        """Give rule ``name`` its body: a rule that refers to itself is made, then defined."""
        self._rules[name] = f"{name}: {body}"

    def terminal(self, body: str) -> str:
        """A lexeme (``&`` and ``~`` work only in terminals; ``lazy`` takes one)."""
        name = f"T{len(self._rules)}"
        self._rules[name] = f"{name}: {body}"
        return name

    def json(self, schema: dict) -> str:
        """A JSON value of ``schema`` in the compact layout (a schema's own layout wins)."""
        return self.rule("%json " + json.dumps({"x-guidance": CALL_LAYOUT, **schema}))

    def text(self, close: str, avoid: tuple[str, ...] = ()) -> str:
        """Free text, then ``close``: the text holds neither ``close`` nor any of ``avoid``."""
        body = "/(?s:.*)/"
        banned = [a for a in avoid if a and not self.special(a)]
        if banned:
            any_of = " | ".join(_lit(a) for a in banned)
            body = f"({body} & ~(/(?s:.*)/ ({any_of}) /(?s:.*)/))"
        pieces = self._split(close)
        if isinstance(pieces[0], int):  # a special token ends the text: no text can be it
            return f"{self.terminal(body)} {_sequence(pieces)}"
        # the shortest text ending in the closing text: so it cannot occur inside the value
        lazy = self.rule(self.terminal(f"{body} {_lit(pieces[0])}"), "[lazy]")
        return f"{lazy} {_sequence(pieces[1:])}".strip()

    def alternatives(self, calls: list[Call], one: Callable[[Call], str]) -> str:
        """One of the calls, each written by ``one``."""
        return "(" + " | ".join(self.rule(one(c)) for c in calls) + ")"

    def lark(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self._rules.values()]) + "\n"


def _sequence(pieces: list[str | int]) -> str:
    return " ".join(f"<[{p}]>" if isinstance(p, int) else _lit(p) for p in pieces if p != "")


# ---- parameters, one element each ----------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One parameter: its name, its schema (with the parameters' ``$defs``), whether required."""

    key: str
    schema: dict
    required: bool


def fields(params: dict) -> list[Field]:
    """The parameters in schema order (required ones the schema does not describe last)."""
    props = params.get("properties") or {}
    required = params.get("required") or []
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    keys = [*props, *(k for k in required if k not in props)]
    schemas = {k: props.get(k) if isinstance(props.get(k), dict) else {} for k in keys}
    return [Field(k, {**strict(schemas[k]), **defs}, k in required) for k in keys]


def _string_options(schema: dict) -> list[str]:
    options = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    return options if options and all(isinstance(o, str) for o in options) else []


def value(g: Grammar, schema: dict, close: str, avoid: tuple[str, ...] = ()) -> str:
    """A parameter's value as plain text, then ``close``: a string as written, else JSON."""
    if schema.get("type") != "string":
        return f"{g.json(schema)} {g.mark(close)}"
    options = _string_options(schema)
    if options:
        return "(" + " | ".join(_lit(o) for o in options) + f") {g.mark(close)}"
    return g.text(close, avoid)


def each(g: Grammar, params: dict, one: Callable[[Field], str]) -> str:
    """Every parameter's element in order, the optional ones maybe."""
    return " ".join(g.rule(one(f)) + ("" if f.required else "?") for f in fields(params))


def joined(g: Grammar, items: list[tuple[str, bool]], sep: str) -> str:
    """Items in order with ``sep`` between those present: required ones always, others maybe.

    Built from the end: ``rest`` is what follows an item (each next item after ``sep``),
    ``seq`` the whole remainder (its first present item without ``sep``)."""
    rest, seq = "", ""
    for item, required in reversed(items):
        head = f"{item} {rest}".strip()
        if required:
            seq, rest = g.rule(head), g.rule(f"{_lit(sep)} {head}")
        else:
            seq = g.rule(f"{head} | {seq}") if seq else f"{g.rule(head)}?"
            rest = g.rule(f"({_lit(sep)} {item})? {rest}".strip())
    return seq


# ---- the formats ---------------------------------------------------------------------------

Builder = Callable[[Grammar, dict], str]  # (grammar, tool_call_schema's schema) → start


def json_call(g: Grammar, schema: dict) -> str:
    """Llama 3, plain JSON: the bare ``{"name": …, "arguments": {…}}`` object."""
    return g.rule("%json " + json.dumps(schema))


def llama3(g: Grammar, schema: dict) -> str:
    """Llama 3.1+: the bare object, its arguments under ``parameters`` (as the template
    writes calls) or ``arguments``."""
    options = schema.get("anyOf") or [schema]
    renamed = [
        {
            **o,
            "properties": {
                "name": o["properties"]["name"],
                "parameters": o["properties"]["arguments"],
            },
            "required": ["name", "parameters"],
        }
        for o in options
    ]
    layout = {k: v for k, v in schema.items() if k == "x-guidance"}
    return g.rule("%json " + json.dumps({"anyOf": [*renamed, *options], **layout}))


def hermes(g: Grammar, schema: dict) -> str:
    """The newlines around the object as the prompts show them, or none (a model may write
    ``<tool_call>{``, and a vocabulary where ``<tool_call>`` is text may merge ``>{``)."""
    return f'{g.mark("<tool_call>")} "\\n"? {json_call(g, schema)} "\\n"? {g.mark("</tool_call>")}'


def mistral(g: Grammar, schema: dict) -> str:
    """``[TOOL_CALLS]NAME[ARGS]{…}`` where ``[ARGS]`` is a special token of the vocabulary
    (v11 tokenizers: Devstral, Mistral Small 3.2, Ministral 3), else v3's ``[TOOL_CALLS][{…}]``."""
    if g.special("[ARGS]"):
        return g.alternatives(
            calls_of(schema),
            lambda c: f"{g.mark('[TOOL_CALLS]' + c.name + '[ARGS]')} {g.json(c.params)}",
        )
    return f'{g.mark("[TOOL_CALLS]")} "[" {json_call(g, schema)} "]"'


def qwen3_coder(start: str, end: str, nl: str) -> Builder:
    """``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n…</function>\\n
    </tool_call>`` (Qwen3-Coder, Qwen3.5; Seed-OSS: ``<seed:tool_call>``, no newlines
    around a value)."""

    def param(g: Grammar, f: Field) -> str:
        close = value(g, f.schema, f"{nl}</parameter>", ("</parameter>", end))
        return f'{g.mark(f"<parameter={f.key}>{nl}")} {close} "\\n"'

    def build(g: Grammar, schema: dict) -> str:
        def call(c: Call) -> str:
            params = each(g, c.params, lambda f: param(g, f))
            head, tail = g.mark(f"{start}\n<function={c.name}>\n"), g.mark(f"</function>\n{end}")
            return f"{head} {params} {tail}"

        return g.alternatives(calls_of(schema), call)

    return build


def glm(tag: Callable[[str], str], sep: str, nl: str, block: tuple[str, str]) -> Builder:
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>``: GLM 4.7
    writes no newlines, GLM 4.5 / 4.6 one after the name and after each tag pair (either is
    allowed); Tencent Hy3 writes the same with ``:opensource`` tags, a separator and a block."""

    def param(g: Grammar, f: Field) -> str:
        key = g.mark(tag("arg_key") + f.key + tag("/arg_key"))
        text = value(g, f.schema, tag("/arg_value"), (tag("/tool_call"),))
        return f"{key} {nl} {g.mark(tag('arg_value'))} {text} {nl}"

    def build(g: Grammar, schema: dict) -> str:
        def call(c: Call) -> str:
            params = each(g, c.params, lambda f: param(g, f))
            head, tail = g.mark(tag("tool_call") + c.name + sep), g.mark(tag("/tool_call"))
            return f"{head} {nl} {params} {tail}"

        return f"{g.mark(block[0])} {g.alternatives(calls_of(schema), call)} {g.mark(block[1])}"

    return build


@dataclass(frozen=True)
class Invoke:
    """An ``<invoke name="NAME"><parameter name="K">V</parameter>…</invoke>`` markup."""

    block: tuple[str, str]  # around the calls
    invoke: str  # the call's tag
    param: str  # a parameter's tag
    nl: str  # after each opening and closing tag but the parameter's
    typed: bool = False  # DeepSeek DSML: string="true" on text values, "false" on JSON


def invoke(shape: Invoke) -> Builder:
    """MiniMax-M2, DeepSeek V3.2 / V4 DSML, MiniCPM 5."""

    def param(g: Grammar, f: Field) -> str:
        text = f.schema.get("type") == "string"
        typed = f' string="{str(text).lower()}"' if shape.typed else ""
        head = g.mark(f'<{shape.param} name="{f.key}"{typed}>')
        end = shape.block[1] or f"</{shape.invoke}>"  # the call's end marker
        return f"{head} {value(g, f.schema, f'</{shape.param}>', (end,))} {g.mark(shape.nl)}"

    def build(g: Grammar, schema: dict) -> str:
        def call(c: Call) -> str:
            params = each(g, c.params, lambda f: param(g, f))
            head = g.mark(f'{shape.block[0]}{shape.nl}<{shape.invoke} name="{c.name}">{shape.nl}')
            return f"{head} {params} {g.mark(f'</{shape.invoke}>{shape.nl}{shape.block[1]}')}"

        return g.alternatives(calls_of(schema), call)

    return build


def dsml(g: Grammar, schema: dict) -> str:
    """DeepSeek V3.2 writes ``function_calls`` blocks, V4 ``tool_calls``: either is allowed."""
    shapes = [
        Invoke(
            (f"<｜DSML｜{b}>", f"</｜DSML｜{b}>"), "｜DSML｜invoke", "｜DSML｜parameter", "\n", True
        )
        for b in ("function_calls", "tool_calls")
    ]
    return "(" + " | ".join(g.rule(invoke(s)(g, schema)) for s in shapes) + ")"


def _gemma_value(g: Grammar) -> tuple[str, str]:
    """Gemma 4's values: strings in ``<|"|>``, bare keys, no spaces (its template's
    ``format_argument``); the rule of any value, and of a string."""
    quote_text = '<|"|>'
    quote = g.mark(quote_text)
    string = g.rule(f"{quote} {g.text(quote_text, ('<tool_call|>',))}")
    any_value = g.rule('"null"')  # defined below: values nest
    b = g.bounds
    number = g.terminal(
        rf"/-?(0|[1-9][0-9]{{0,{b.integer_digits - 1}}})(\.[0-9]{{1,{b.fraction_digits}}})?/"
    )
    pair = g.rule(f'{g.terminal("/[A-Za-z_][A-Za-z0-9_]*/")} ":" {any_value}')
    body = (
        f'{string} | {number} | "true" | "false" | "null" '
        f'| "{{" ({pair} ("," {pair})*)? "}}" | "[" ({any_value} ("," {any_value})*)? "]"'
    )
    g.define(any_value, body)
    return any_value, string


def gemma4(g: Grammar, schema: dict) -> str:
    """``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>``, keys sorted."""
    any_value, string = _gemma_value(g)

    def arg(f: Field) -> str:
        kind = f.schema.get("type")
        if kind == "string":
            options = _string_options(f.schema)
            quote = g.mark('<|"|>')
            text = f"{quote} ({' | '.join(map(_lit, options))}) {quote}" if options else string
        else:
            text = g.json(f.schema) if kind in ("integer", "number", "boolean") else any_value
        return g.rule(f"{_lit(f.key + ':')} {text}")

    def call(c: Call) -> str:
        items = [(arg(f), f.required) for f in sorted(fields(c.params), key=lambda f: f.key)]
        args = joined(g, items, ",")
        return f"{g.mark('<|tool_call>call:' + c.name + '{')} {args} {g.mark('}<tool_call|>')}"

    return g.alternatives(calls_of(schema), call)


def kimi_k2(g: Grammar, schema: dict) -> str:
    return g.alternatives(
        calls_of(schema),
        lambda c: (
            g.mark(f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{c.name}:0")
            + f" {g.mark('<|tool_call_argument_begin|>')} {g.json(c.params)} "
            + g.mark("<|tool_call_end|><|tool_calls_section_end|>")
        ),
    )


def deepseek_v3(g: Grammar, schema: dict) -> str:
    """V3.1's ``NAME<｜tool▁sep｜>{…}`` (V3-0324 / R1 were trained on ``function<｜tool▁sep｜>
    NAME`` and a fenced block: not written here)."""
    return g.alternatives(
        calls_of(schema),
        lambda c: (
            g.mark(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>")
            + f" {g.json(c.params)} "
            + g.mark("<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        ),
    )


def harmony(g: Grammar, schema: dict) -> str:
    """gpt-oss: the call is a commentary-channel message to ``functions.NAME``."""
    return g.alternatives(
        calls_of(schema),
        lambda c: (
            g.mark(f"<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>")
            + f" {g.json(c.params)} {g.mark('<|call|>')}"
        ),
    )


# A Python string literal in single quotes, as LFM2's template writes one.
_PY_STRING = r"/'([^'\\\n\r]|\\[\\'nrt])*'/"


def pythonic(g: Grammar, schema: dict) -> str:
    """LFM2: ``<|tool_call_start|>[NAME(key='text', n=5, obj={"a": 1})]<|tool_call_end|>``;
    non-string values are JSON, which the parser reads as Python literals."""

    def arg(f: Field) -> str:
        if f.schema.get("type") != "string":
            return g.rule(f"{_lit(f.key + '=')} {g.json(f.schema)}")
        options = [o for o in _string_options(f.schema) if "'" not in o and "\\" not in o]
        text = " | ".join(_lit(f"'{o}'") for o in options) or g.terminal(_PY_STRING)
        return g.rule(f"{_lit(f.key + '=')} ({text})")

    def call(c: Call) -> str:
        args = joined(g, [(arg(f), f.required) for f in fields(c.params)], ", ")
        head, tail = g.mark(f"<|tool_call_start|>[{c.name}("), g.mark(")]<|tool_call_end|>")
        return f"{head} {args} {tail}"

    return g.alternatives(calls_of(schema), call)


def around(start: str, end: str) -> Builder:
    """The call object between two markers (``{"name": …, "arguments": …}``)."""
    return lambda g, schema: f"{g.mark(start)} {json_call(g, schema)} {g.mark(end)}".strip()


def apriel(g: Grammar, schema: dict) -> str:
    """Apriel writes a list, MiniMax-M1 one object on its own line: either is allowed."""
    call = json_call(g, schema)
    return (
        f'{g.mark("<tool_calls>")} ("[" {call} "]" | "\\n" {call} "\\n") {g.mark("</tool_calls>")}'
    )


def command_r(g: Grammar, schema: dict) -> str:
    """Cohere: ``[{"tool_call_id": "0", "tool_name": NAME, "parameters": {…}}]``."""

    def call(c: Call) -> str:
        keys = {
            "tool_call_id": {"const": "0"},
            "tool_name": {"const": c.name},
            "parameters": c.params,
        }
        return g.json(_object(keys))

    start, end = g.mark("<|START_ACTION|>[\n    "), g.mark("\n]<|END_ACTION|>")
    return f"{start} {g.alternatives(calls_of(schema), call)} {end}"


def apertus(g: Grammar, schema: dict) -> str:
    """Apertus: ``[{NAME: {…}}]``."""
    body = g.alternatives(calls_of(schema), lambda c: g.json(_object({c.name: c.params})))
    return f"{g.mark('<|tools_prefix|>[')} {body} {g.mark(']<|tools_suffix|>')}"


def solar(g: Grammar, schema: dict) -> str:
    """Solar Open: a call id of the model's own, the name, then the arguments."""
    call_id = g.terminal(r"/[A-Za-z0-9_\-]{1,40}/")

    def call(c: Call) -> str:
        head = f"{g.mark('<|tool_calls|><|tool_call:begin|>')} {call_id} "
        name = g.mark(f"<|tool_call:name|>{c.name}<|tool_call:args|>")
        return f"{head}{name} {g.json(c.params)} {g.mark('<|tool_call:end|><|calls|>')}"

    return g.alternatives(calls_of(schema), call)


def functionary(g: Grammar, schema: dict) -> str:
    """Functionary v3.1: ``<function=NAME>{…}</function>``."""
    return g.alternatives(
        calls_of(schema),
        lambda c: f"{g.mark(f'<function={c.name}>')} {g.json(c.params)} {g.mark('</function>')}",
    )


def command_r_plus(g: Grammar, schema: dict) -> str:
    """Command R+: ``Action:\\n```json\\n[{"tool_name": NAME, "parameters": {…}}]```"."""

    def call(c: Call) -> str:
        return g.json(_object({"tool_name": {"const": c.name}, "parameters": c.params}))

    start, end = g.mark("Action:\n```json\n[\n    "), g.mark("\n]```")
    return f"{start} {g.alternatives(calls_of(schema), call)} {end}"


def functionary_v3_2(g: Grammar, schema: dict) -> str:
    """Functionary v3.2: ``NAME\\n{…}`` (the prompt ends with the ``>>>`` before it)."""

    def call(c: Call) -> str:
        return f'{g.mark(c.name)} "\\n" {g.json(c.params)}'

    return g.alternatives(calls_of(schema), call)


def _object(properties: dict) -> dict:
    """An object of exactly these keys."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def glm_tag(name: str) -> str:
    return f"<{name}>"


def hy3_tag(name: str) -> str:
    return f"<{name}:opensource>"


# The builders that take the shape of their markup, one per format that uses them.
QWEN3_CODER = qwen3_coder("<tool_call>", "</tool_call>", "\n")
SEED_OSS = qwen3_coder("<seed:tool_call>", "</seed:tool_call>", "")
GLM47 = glm(glm_tag, "", '"\\n"?', ("", ""))
HY3 = glm(
    hy3_tag,
    "<tool_sep:opensource>",
    '"\\n"',
    ("<tool_calls:opensource>\n", "\n</tool_calls:opensource>"),
)
MINIMAX_M2 = invoke(
    Invoke(("<minimax:tool_call>", "</minimax:tool_call>"), "invoke", "parameter", "\n")
)
MINICPM5 = invoke(Invoke(("", ""), "function", "param", ""))
NEMOTRON_V2 = around("<TOOLCALL>[", "]</TOOLCALL>")
GIGACHAT = around("<|function_call|>", "")
# GigaChat 3: an empty assistant message, then a message of the ``function call`` role
GIGACHAT3 = around("<|message_sep|>\n\nfunction call<|role_sep|>\n", "")
GRANITE = around("<|tool_call|>[", "]")
FIREFUNCTION = around("functools[", "]")


def lark(
    build: Builder,
    schema: dict,
    split: Split = as_text,
    prefix: str = "",
    between: str | None = None,
    bounds: Bounds | None = None,
) -> str:
    """The Lark grammar of one call written by ``build`` (a format's ``grammar``) to one of
    the calls of ``schema`` (``grammar.tool_call_schema``), after ``prefix`` (the closing tag
    of a reasoning block the prompt opened). ``between``: the answer may hold more calls,
    each after this text (``"\\n"``: an optional newline; ``""``: none); None: one call."""
    g = Grammar(split, bounds)
    body = build(g, schema)
    if between is not None:
        one = g.rule(body)
        body = f"{one} ({_lit(between)}? {one})*" if between else f"{one}+"
    return g.lark(f"{g.mark(prefix)} {body}" if prefix else body)


def json_lark(schema: dict, layout: dict, split: Split = as_text, prefix: str = "") -> str:
    """A JSON answer of ``schema`` after ``prefix``, as Lark (for answers that must first
    close the reasoning block the prompt opened)."""
    g = Grammar(split)
    body = g.rule("%json " + json.dumps({"x-guidance": layout, **schema}))
    return g.lark(f"{g.mark(prefix)} {body}")
