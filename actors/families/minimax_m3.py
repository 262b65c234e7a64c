"""MiniMax-M3's tool calls: XML elements behind a separator token, nested arguments.

Every tag of a call section follows the separator ``]<]minimax[>[`` (``NS``)::

    NS<tool_call>
    NS<invoke name="get_weather">NS<city>Paris NSNS</city>NS<days>3NS</days>NS</invoke>
    NS</tool_call>

As the template's ``to_xml`` macro renders an argument: a mapping is one element
per key, a list one ``<item>`` element per entry, a boolean ``true`` / ``false``,
any other value as Python prints it (a string as written, unescaped), and a
``None`` value is left out. The separator tells tags from value text, so a value
may hold ``<`` and ``>``. Reading it back, a leaf's type comes from the tool's
JSON schema where it has one (a ``string`` stays text, ``integer`` / ``number`` /
``boolean`` are read as JSON); without one a leaf that reads as a JSON number or
boolean is one, any other text a string. An element of ``<item>`` elements is a
list unless its schema says object; an empty element is the empty value of its
schema type (a string where it has none). mlx-lm 0.32.2 has no parser for this
markup (its ``minimax_m2`` reads M2's ``<parameter name=…>`` form). ``grammar``
writes one call in this markup (a forced call, or one the model opened in auto
mode), as the template renders it.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mlxd.actors.families.delimited import DelimitedToolParser, one_section
from mlxd.actors.families.forced import Call, Grammar, calls_of, each, strict, value
from mlxd.actors.parsers import IdFactory, _arguments_text, _utf8
from mlxd.protocol.messages import Tool, ToolCall

NS = "]<]minimax[>["
START, END = NS + "<tool_call>", NS + "</tool_call>"
_TAG = re.compile(r"<(/?)([^<>]*)>")
_INVOKE = re.compile(r'invoke name="([^"]*)"')
_EMPTY = {"array": [], "object": {}}


@dataclass
class _Element:
    tag: str
    text: str = ""
    children: list[_Element] = field(default_factory=list)


def make_parser(make_id: IdFactory, tools: tuple[Tool, ...] = ()) -> DelimitedToolParser:
    schemas = {t.name: t.parameters for t in tools}
    return one_section(START, END, lambda body: calls(body, schemas, make_id))


def _tree(body: str) -> _Element | None:
    """The elements of ``body`` under one root; None where the tags do not nest."""
    first, *segments = body.split(NS)
    if first.strip():
        return None
    stack = [_Element("")]
    for segment in segments:
        tag = _TAG.match(segment)
        if tag is None:
            return None
        if tag.group(1):  # a closing tag: it must close the open element
            opened = stack[-1].tag
            if len(stack) < 2 or not (
                opened == tag.group(2) or opened.startswith(tag.group(2) + " ")
            ):
                return None
            stack.pop()
            text = segment[tag.end() :]
            if text.strip():  # text between elements: not this markup
                return None
            continue
        element = _Element(tag.group(2), segment[tag.end() :])
        stack[-1].children.append(element)
        stack.append(element)
    return stack[0] if len(stack) == 1 else None


def _types(schema: object) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    found = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for choice in ("anyOf", "oneOf"):
        for option in schema.get(choice) or []:
            found |= _types(option)
    return found


_TYPED = {"integer", "number", "boolean", "array", "object"}


def _leaf(text: str, schema: object) -> object:
    types = _types(schema)
    if not text:
        return next((_EMPTY[t] for t in ("array", "object") if types == {t}), "")
    if "string" in types and not types & _TYPED:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, (bool, int, float)):
        return value
    return value if isinstance(value, (list, dict)) and types & {"array", "object"} else text


def _value(element: _Element, schema: object) -> object:
    if not element.children:
        return _leaf(element.text, schema)
    schema = schema if isinstance(schema, dict) else {}
    if all(c.tag == "item" for c in element.children) and "object" not in _types(schema):
        return [_value(c, schema.get("items")) for c in element.children]
    props = schema.get("properties") or {}
    return {c.tag: _value(c, props.get(c.tag)) for c in element.children}


def _call(invoke: _Element, schemas: dict[str, dict], make_id: IdFactory) -> ToolCall | None:
    name = _INVOKE.fullmatch(invoke.tag)
    if name is None or not name.group(1) or not _utf8(name.group(1)) or invoke.text.strip():
        return None
    params = schemas.get(name.group(1), {})
    args = {c.tag: _value(c, (params.get("properties") or {}).get(c.tag)) for c in invoke.children}
    text = _arguments_text(args)
    return ToolCall(id=make_id(), name=name.group(1), arguments=text) if text else None


def calls(body: str, schemas: dict[str, dict], make_id: IdFactory) -> list[ToolCall] | None:
    """The ``<invoke>`` elements of a call section; None unless every one is a call."""
    root = _tree(body)
    if root is None or not root.children:
        return None
    found = [_call(invoke, schemas, make_id) for invoke in root.children]
    return None if None in found else found  # type: ignore[return-value]


# ---- a forced call (the grammar) -------------------------------------------------------------


def grammar(g: Grammar, schema: dict) -> str:
    """One call as the template writes it: ``NS<tool_call>\\nNS<invoke name="NAME">``, each
    parameter an element in schema order, ``NS</invoke>\\nNS</tool_call>``.

    A value is an element's text (a string as written, holding no ``NS``; a number or a
    boolean as JSON), an object with ``properties`` one element per property, a list one
    ``<item>`` element per entry. An object of free keys is its JSON text: no grammar can
    close a tag named by a key it did not list, and the parser reads JSON text as an object
    where the schema says object."""

    tail = g.mark(f"{NS}</invoke>\n{END}")

    def call(c: Call) -> str:
        head = g.mark(f'{START}\n{NS}<invoke name="{c.name}">')
        params = each(g, c.params, lambda f: _element(g, f.key, f.schema))
        return f"{head} {params} {tail}"

    return g.alternatives(calls_of(schema), call)


def _element(g: Grammar, key: str, schema: dict) -> str:
    """``NS<key>`` value ``NS</key>``, the value by its schema (``to_xml`` in the template)."""
    head, close = g.mark(f"{NS}<{key}>"), f"{NS}</{key}>"
    kind, extra = schema.get("type"), schema.get("additionalProperties", False)
    if kind == "object" and schema.get("properties") and extra is False:
        inner = each(g, schema, lambda f: _element(g, f.key, f.schema))
        return f"{head} {inner} {g.mark(close)}"
    if kind == "array":
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        item = g.rule(_element(g, "item", {**strict(items), **defs}))
        low, high = schema.get("minItems", 0), schema.get("maxItems", "")
        return f"{head} {item}{{{low},{high}}} {g.mark(close)}"
    return f"{head} {value(g, schema, close, (NS,))}"
