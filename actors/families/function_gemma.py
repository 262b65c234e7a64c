"""FunctionGemma's tool calls: ``<start_function_call>call:NAME{k:<escape>v<escape>,n:5}<end_function_call>``.

Its template writes a call's arguments sorted by key, with no spaces: a string
between ``<escape>`` tokens, a number or a boolean as written, a mapping as
``{key:value,…}`` with bare keys, a list as ``[value,…]`` (``format_argument``,
as Gemma 4's with ``<|"|>`` for the quote). Several calls are whole blocks one
after another, and the turn ends after them (``<start_function_response>``).
mlx-lm's ``function_gemma`` parser reads it back: the call ends at its first
``}`` and a value that is not a string at its first ``,``, so a string here holds
no ``}`` (else the call would be lost) and only flat arguments read back (an
object or a list of several entries is written as the template does, but the
parser cannot read it). ``grammar`` writes one call (a forced call, or one the
model opened in auto mode). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

from mlxd.actors.families.forced import Call, Field, Grammar, calls_of, fields, joined, value

START, END, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
_AVOID = ("}", END)  # what a string value cannot hold besides its closing <escape>


def grammar(g: Grammar, schema: dict) -> str:
    """One call to one of the tools of ``schema``, its parameters sorted by key."""
    nested = _nested(g)

    def arg(f: Field) -> str:
        kind = f.schema.get("type")
        if kind == "string":
            text = f"{g.mark(ESCAPE)} {value(g, f.schema, ESCAPE, _AVOID)}"
        elif kind in ("integer", "number", "boolean"):
            text = g.json(f.schema)
        else:
            text = nested
        return g.rule(f"{g.mark(f.key + ':')} {text}")

    def call(c: Call) -> str:
        items = [(arg(f), f.required) for f in sorted(fields(c.params), key=lambda f: f.key)]
        head = g.mark(f"{START}call:{c.name}{{")
        return f"{head} {joined(g, items, ',')} {g.mark('}' + END)}"

    return g.alternatives(calls_of(schema), call)


def _nested(g: Grammar) -> str:
    """Any value in the template's syntax (objects and lists nest; their schema is not
    held, as for Gemma 4)."""
    quote = g.mark(ESCAPE)
    string = g.rule(f"{quote} {g.text(ESCAPE, _AVOID)}")
    any_value = g.rule('"true"')  # defined below: values nest
    pair = g.rule(f'{g.terminal("/[A-Za-z_][A-Za-z0-9_]*/")} ":" {any_value}')
    body = (
        f'{string} | {g.json({"type": "number"})} | "true" | "false" '
        f'| "{{" ({pair} ("," {pair})*)? "}}" | "[" ({any_value} ("," {any_value})*)? "]"'
    )
    g.define(any_value, body)
    return any_value
