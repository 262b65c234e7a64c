"""Kimi K3's tool calls, in its XTML markup of ``<|open|>`` / ``<|close|>`` / ``<|sep|>`` tags.

After the answer's ``response`` section the template writes one ``tools`` section
holding every call of the turn, each argument typed::

    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|>

(without the line breaks). A ``string`` value is text as written, any other JSON
(type ``number``, ``boolean``, ``object``, ``array`` or ``null``); attributes
escape ``&`` and ``"``. mlx-lm's ``kimi_k3`` parser reads it back. ``grammar``
writes one call in its own section (a forced call, or one the model opened in
auto mode). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

from mlxd.actors.families.forced import Call, Field, Grammar, calls_of, each, value

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
START, END = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
# The template's ``xtml_type``: a JSON schema type → the argument's type attribute.
_TYPES = {
    "integer": "number",
    "number": "number",
    "boolean": "boolean",
    "object": "object",
    "array": "array",
    "null": "null",
}


def _attr(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;")


def grammar(g: Grammar, schema: dict) -> str:
    """One call to one of the tools of ``schema``, its arguments in schema order."""

    def argument(f: Field) -> str:
        kind = f.schema.get("type")
        kind = kind if isinstance(kind, str) else None
        names = ["string"] if kind == "string" else [_TYPES[kind]] if kind in _TYPES else []
        # a value of several types (or of none named) is JSON, typed as any of its JSON types
        heads = [
            g.mark(f'{OPEN}argument key="{_attr(f.key)}" type="{t}"{SEP}')
            for t in names or sorted(set(_TYPES.values()))
        ]
        text = value(g, f.schema, f"{CLOSE}argument{SEP}", (OPEN, CLOSE))
        return f"({' | '.join(heads)}) {text}"

    def call(c: Call) -> str:
        head = g.mark(f'{START}{OPEN}call tool="{_attr(c.name)}" index="1"{SEP}')
        return f"{head} {each(g, c.params, argument)} {g.mark(f'{CLOSE}call{SEP}{END}')}"

    return g.alternatives(calls_of(schema), call)
