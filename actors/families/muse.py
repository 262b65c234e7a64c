"""Muse's ATEM messages: reasoning to ``self``, answers to ``user``, calls to a tool.

After the generation prompt ``<|start|>assistant`` the model writes one or more
messages, each a recipient header, ``<|message|>``, a body and an end token
(``<|eom|>`` between messages, ``<|eot|>`` at the end of the turn)::

     to=self<|message|>…thinking…<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eot|>

The shape is harmony's (``harmony.py``) with other tokens, so the parser is
harmony's with Muse's markers. A message to ``self`` is reasoning, one to
``user`` (or to no one) is content, one to any other recipient is a call whose
body mlx-lm's ``muse_spark`` parser reads; a body it cannot read is given back,
header and all, as content. ``grammar`` writes one call message (a forced call, or
one the model opened in auto mode). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re

from mlxd.actors.families.forced import Call, Field, Grammar, calls_of, each, value
from mlxd.actors.families.formats import library_body
from mlxd.actors.families.harmony import _RECIPIENT, HarmonyParser
from mlxd.actors.parsers import IdFactory
from mlxd.protocol.messages import Tool, ToolCall

_START, _MESSAGE = "<|start|>", "<|message|>"
_FUNCTION_CALLS = re.compile(r"\s*<atem:function_calls>(.*?)</atem:function_calls>\s*$", re.DOTALL)


def make_parser(make_id: IdFactory, tools: tuple[Tool, ...] = ()) -> MuseParser:
    return MuseParser(make_id, tools)


class MuseParser(HarmonyParser):
    """Harmony's message parser with Muse's end tokens and recipients."""

    HEADER_STOP = re.compile(r"<\|(?:message|eom|eot|start)\|>")
    BODY_STOP = re.compile(r"<\|(?:eom|eot|start)\|>")
    BODY_MARKERS = ("<|eom|>", "<|eot|>", _START)
    NEXT = (_START,)
    OPENERS = (_START, _MESSAGE, "to=")
    JSON_BODY = False  # ATEM markup: a cut call is dropped

    def __init__(self, make_id: IdFactory, tools: tuple[Tool, ...]):
        super().__init__(make_id)
        self._atem = library_body("muse_spark", make_id, tools)

    def route(self, header: str) -> tuple[str, str]:
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1) if recipient else "user"
        if name == "self":
            return "reasoning", ""
        return ("content", "") if name == "user" else ("call", name)

    def calls(self, name: str, body: str) -> list[ToolCall] | None:
        block = _FUNCTION_CALLS.match(body)
        if block is None or self._atem is None:
            return None
        return self._atem(block.group(1))


# ---- a forced call (the grammar) -------------------------------------------------------------

_PARAM_END = "</atem:parameter>"
# What a string value cannot hold: its closing tag, and the tokens that end a message body.
_AVOID = ("</atem:function_calls>", "<|eom|>", "<|eot|>", _START)


def grammar(g: Grammar, schema: dict) -> str:
    """One call message as the template writes it, from its recipient on (the prompt ends
    with ``<|start|>assistant``): `` to=NAME<|message|><atem:function_calls>\\n<atem:invoke
    name="NAME">\\n``, one ``<atem:parameter name="K">V</atem:parameter>\\n`` per parameter in
    schema order, ``</atem:invoke>\\n</atem:function_calls>``; the message's end token
    (``<|eot|>``, or ``<|eom|>`` before another message) follows it.

    The header is optional: a call the model opened in auto mode is caught at
    ``<atem:function_calls>`` (`` to=`` also opens its reasoning and its answers), after a
    header it wrote itself. A string value is text as written, any other value JSON (mlx-lm's
    parser reads a string that is valid JSON as JSON, and strips blanks at its ends)."""

    tail = g.mark("</atem:invoke>\n</atem:function_calls>")

    def param(f: Field) -> str:
        head = g.mark(f'<atem:parameter name="{f.key}">')
        return f'{head} {value(g, f.schema, _PARAM_END, _AVOID)} "\\n"'

    def call(c: Call) -> str:
        header = g.rule(g.mark(f" to={c.name}{_MESSAGE}"))
        head = g.mark(f'<atem:function_calls>\n<atem:invoke name="{c.name}">\n')
        return f"{header}? {head} {each(g, c.params, param)} {tail}"

    return g.alternatives(calls_of(schema), call)
