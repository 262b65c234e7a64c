"""Functionary v3.2: messages ``>>>RECIPIENT\\nBODY``, one after another.

The generation prompt ends with ``>>>``, so the model starts with the first
message's recipient. A message to ``all`` is content; a message to any other
recipient is a call to that function, its body the arguments as JSON::

    all\\nLet me check.>>>get_weather\\n{"city": "Paris"}>>>get_time\\n{}

Content streams as it comes (less a tail that could start ``>>>``); a call is
read whole at the next ``>>>`` or the end of the output, and given back as
content, recipient and all, where its body is not one JSON object. mlx-lm
0.32.2 has no parser for it. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re

from mlxd.actors.parsers import (
    IdFactory,
    Parsed,
    StateParser,
    _arguments_text,
    _json_values,
    partial_suffix,
    whole,
)
from mlxd.protocol.messages import Tool, ToolCall

SEP = ">>>"
_NAME = re.compile(r"[\w.\-]+")
_LONGEST_NAME = 256  # a header longer than this without its newline is no header


def make_parser(make_id: IdFactory, tools: tuple[Tool, ...] = ()) -> FunctionaryParser:
    """The request's tools are not needed: a call names its function in its header."""
    return FunctionaryParser(make_id)


class FunctionaryParser(StateParser):
    """Splits ``>>>``-separated messages into content and calls (see the module docstring)."""

    def __init__(self, make_id: IdFactory):
        self._make_id = make_id
        self._state = "header"  # header | content | call
        self._held = ""
        self._name = ""

    def _header(self, buffer: str, out: Parsed) -> str:
        if SEP.startswith(buffer):  # the model may write the prompt's ``>>>`` again
            self._held = buffer
            return ""
        text = buffer.removeprefix(SEP)
        name, newline, rest = text.partition("\n")
        if not newline and _NAME.fullmatch(name) and len(name) < _LONGEST_NAME:
            self._held = buffer  # the recipient may go on
            return ""
        if newline and name.strip() == "all":
            self._state = "content"
            return rest
        if newline and _NAME.fullmatch(name.strip()):
            self._state, self._name = "call", name.strip()
            return rest
        self._state = "content"  # no header: the text is content as written
        return text

    def _content(self, buffer: str, out: Parsed) -> str:
        at = buffer.find(SEP)
        if at >= 0:
            out.content += buffer[:at]
            self._state = "header"
            return buffer[at:]
        keep = partial_suffix(buffer, (SEP,))
        out.content += buffer[: len(buffer) - keep]
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _call(self, buffer: str, out: Parsed) -> str:
        at = buffer.find(SEP)
        if at < 0:
            self._held = buffer
            return ""
        self._finish(buffer[:at], out)
        return buffer[at:]

    def _finish(self, body: str, out: Parsed) -> None:
        self._state = "header"
        values = _json_values(body.strip())
        text = _arguments_text(values[0]) if values and len(values) == 1 else None
        if text is None:
            out.content += f"{self._name}\n{body}"
            return
        out.calls.append(whole(ToolCall(id=self._make_id(), name=self._name, arguments=text)))

    def flush(self, cut: bool = False) -> Parsed:
        out = Parsed()
        held, self._held = self._held, ""
        if self._state == "call" and cut and not _whole(held):
            from mlxd.actors.families.cut import incomplete, json_arguments

            # the call as far as written (``cut.py``)
            out.calls.append(incomplete(self._name, json_arguments(held), self._make_id))
        elif self._state == "call":
            self._finish(held, out)
        else:
            out.content += held
        self._state = "header"
        return out


def _whole(body: str) -> bool:
    """The body is one whole JSON object (a call ends at the next message or the output's end)."""
    values = _json_values(body.strip())
    return bool(values) and len(values) == 1 and isinstance(values[0], dict)
