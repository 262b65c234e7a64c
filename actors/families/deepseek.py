"""DeepSeek's tool-call markups, whichever one a model writes.

- V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…
  <｜tool▁calls▁end｜>``;
- V3 / R1 / R1-distill: the same section, each call
  ``function<｜tool▁sep｜>NAME\\n```json\\n{…}\\n```<｜tool▁call▁end｜>``;
- V3.2 / V4 "DSML": ``<｜DSML｜function_calls>`` (V3.2) or ``<｜DSML｜tool_calls>`` (V4)
  around ``<｜DSML｜invoke name="NAME">`` elements, each holding
  ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>``:
  ``string="true"``: the value is the string as written; ``"false"``: it is JSON
  (the templates write ``val | tojson``).

Text outside a section streams as content; a section is parsed whole at its
end marker (or at the end of the output) and given back as content if any of
its calls does not parse. Whitespace right before a section is dropped (the
V3.2 / V4 templates write ``content + "\\n\\n"`` before it, so the answer
renders back as written) and so is whitespace after the last one. mlx-lm
0.32.2 has no parser for these (its ``chat_templates/deepseek_v32.py`` only
renders prompts). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mlxd.actors.families.delimited import DelimitedToolParser
from mlxd.actors.parsers import IdFactory, _arguments_text, _json_values, _utf8
from mlxd.protocol.messages import Tool, ToolCall

# A call read from the markup, before it is given an id: (name, arguments object).
Found = tuple[str, object]

_CALL_BEGIN, _CALL_END, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# R1's call body after the separator: NAME, a newline, the arguments in a ```json fence.
_FENCED = re.compile(r"\s*([^\s{}\[\]\"`]+)[ \t]*\n\s*```(?:json)?\s*\n?(.*?)\s*```\s*$", re.DOTALL)
_INVOKE = re.compile(r'\s*<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)</｜DSML｜invoke>', re.DOTALL)
_PARAMETER = re.compile(
    r'\s*<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>'
    r"(.*?)</｜DSML｜parameter>",
    re.DOTALL,
)


def _json_value(text: str) -> tuple[bool, object]:
    values = _json_values(text.strip())
    return (True, values[0]) if values and len(values) == 1 else (False, None)


def _v3_call(part: str) -> Found | None:
    """One call after ``<｜tool▁call▁begin｜>``: V3.1's ``NAME<sep>{…}`` or R1's fenced form."""
    head, sep, rest = part.strip().removesuffix(_CALL_END).partition(_SEP)
    if not sep:
        return None
    fenced = _FENCED.match(rest)
    name, args = (fenced.group(1), fenced.group(2)) if fenced else (head.strip(), rest)
    ok, value = _json_value(args)
    return (name, value) if ok else None


def v3_calls(body: str) -> list[Found] | None:
    """The calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""
    first, *parts = body.split(_CALL_BEGIN)
    if first.strip() or not parts:
        return None
    found = [_v3_call(p) for p in parts]
    return None if None in found else found  # type: ignore[return-value]


def _all(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Consecutive matches of ``pattern`` making up all of ``text`` but whitespace; else None."""
    found, pos = [], 0
    while text[pos:].strip():
        match = pattern.match(text, pos)
        if match is None:
            return None
        found.append(match)
        pos = match.end()
    return found


def _dsml_value(raw: str, string: str | None) -> object:
    if string == "true":
        return raw  # as written: the template does not escape or quote it
    ok, value = _json_value(raw)
    # Not JSON though marked so: the model's slip; the value it wrote is kept as a string.
    return value if ok else raw


def _invoke(match: re.Match[str]) -> Found | None:
    params = _all(_PARAMETER, match.group(2))
    if params is None:
        return None
    return match.group(1), {p.group(1): _dsml_value(p.group(3), p.group(2)) for p in params}


def dsml_calls(body: str) -> list[Found] | None:
    """The ``<｜DSML｜invoke>`` elements of a DSML section."""
    invokes = _all(_INVOKE, body)
    if not invokes:
        return None
    found = [_invoke(m) for m in invokes]
    return None if None in found else found  # type: ignore[return-value]


# Each section's start marker → its end marker and the reader of what lies between.
_SECTIONS: dict[str, tuple[str, Callable[[str], list[Found] | None]]] = {
    "<｜tool▁calls▁begin｜>": ("<｜tool▁calls▁end｜>", v3_calls),
    "<｜DSML｜function_calls>": ("</｜DSML｜function_calls>", dsml_calls),
    "<｜DSML｜tool_calls>": ("</｜DSML｜tool_calls>", dsml_calls),
}


def _tool_calls(found: list[Found], make_id: IdFactory) -> list[ToolCall] | None:
    """Ids are made only once every call of the section is known to be good."""
    named = [(name, _arguments_text(args)) for name, args in found]
    if not all(name and _utf8(name) and text is not None for name, text in named):
        return None
    return [ToolCall(id=make_id(), name=name, arguments=text) for name, text in named]  # type: ignore[arg-type]


def make_parser(make_id: IdFactory, tools: tuple[Tool, ...] = ()) -> DelimitedToolParser:
    """The request's tools are not needed: DSML says which values are strings. Whitespace
    before a call section is dropped: the V3.2 / V4 templates write the answer, then a blank
    line, then the section, so the answer renders back the same."""

    def body(read: Callable[[str], list[Found] | None]) -> Callable[[str], list[ToolCall] | None]:
        def parse(text: str) -> list[ToolCall] | None:
            found = read(text)
            return _tool_calls(found, make_id) if found else None

        return parse

    sections = {start: (end, body(read)) for start, (end, read) in _SECTIONS.items()}
    return DelimitedToolParser(sections, trim_before=True)
