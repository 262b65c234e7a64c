"""Streaming around a tool-call markup whose calls sit between a start and an end marker.

Text outside the markers is content and streams as it comes, less any tail
that could still start the start marker. From a start marker to its end
marker (or to the end of the output, where the end marker is a stop token the
model's generation ends on, or there is none) the text is held and parsed whole
by the family's body parser; a body that does not parse is given back as
content, never dropped. Whitespace between and after calls is dropped.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxd.actors.parsers import Parsed, partial_suffix, whole
from mlxd.protocol.messages import ToolCall

# The body between the markers → its calls, or None (then the markup is content).
BodyParser = Callable[[str], list[ToolCall] | None]


class DelimitedToolParser:
    """Calls between ``start`` and ``end`` (``end`` "": to the end of the output)."""

    def __init__(self, start: str, end: str, parse_body: BodyParser):
        self._start, self._end = start, end
        self._parse_body = parse_body
        self._inside = False
        self._held = ""
        self._space = ""  # whitespace after a call, shown only if content follows
        self._called = False

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._in_call(buffer, out) if self._inside else self._in_text(buffer, out)
        return out

    def _in_text(self, buffer: str, out: Parsed) -> str:
        at = buffer.find(self._start)
        cut = at if at >= 0 else len(buffer) - partial_suffix(buffer, (self._start,))
        self._emit(buffer[:cut], out)
        if at >= 0:
            self._inside = True
            return buffer[at + len(self._start) :]
        self._held = buffer[cut:]
        return ""

    def _in_call(self, buffer: str, out: Parsed) -> str:
        at = buffer.find(self._end) if self._end else -1
        if at < 0:
            self._held = buffer
            return ""
        self._inside = False
        self._finish(buffer[:at], out, closed=True)
        return buffer[at + len(self._end) :]

    def _emit(self, text: str, out: Parsed) -> None:
        if self._called and not text.strip():
            self._space += text
            return
        out.content += self._space + text
        self._space = ""

    def _finish(self, body: str, out: Parsed, *, closed: bool) -> None:
        calls = self._parse_body(body)
        if not calls:
            self._emit(self._start + body + (self._end if closed else ""), out)
            return
        out.calls.extend(whole(c) for c in calls)
        self._called, self._space = True, ""

    def flush(self) -> Parsed:
        out = Parsed()
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            self._finish(held, out, closed=False)
        elif held:
            self._emit(held, out)
        return out
