"""Streaming around a tool-call markup whose calls sit between a start and an end marker.

Text outside the markers is content and streams as it comes, less any tail
that could still start a start marker. From a start marker to its end marker
(or to the end of the output, where the end marker is a stop token the model's
generation ends on, or there is none) the text is held and parsed whole by the
section's body parser; a body that does not parse is given back as content,
never dropped. A family may write several kinds of section (DeepSeek's three
markups); each start marker names its own end and body parser. Whitespace
between and after calls is dropped; with ``trim_before``, so is whitespace right
before a call section (it waits until content follows it).
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from mlxd.actors.parsers import (
    CallPiece,
    CutReader,
    IdFactory,
    Parsed,
    _json_string,
    _json_values,
    calls_from_values,
    cut_pieces,
    partial_suffix,
    whole,
)
from mlxd.protocol.messages import ToolCall

# The body between the markers → its calls, or None (then the markup is content).
BodyParser = Callable[[str], list[ToolCall] | None]


class DelimitedToolParser:
    """Calls in sections: ``sections`` maps each start marker to (end marker, body parser);
    an end marker "" runs to the end of the output."""

    read_cut: CutReader | None = None

    def __init__(self, sections: Mapping[str, tuple[str, BodyParser]], *, trim_before=False):
        self._sections = dict(sections)
        self._starts = tuple(self._sections)
        self._trim_before = trim_before
        self._open: str | None = None  # the start marker of the section being read
        self._held = ""
        self._space = ""  # whitespace held back until content follows it
        self._called = False

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._in_call(buffer, out) if self._open else self._in_text(buffer, out)
        return out

    def _in_text(self, buffer: str, out: Parsed) -> str:
        found = [(at, s) for s in self._starts if (at := buffer.find(s)) >= 0]
        if found:
            at, self._open = min(found)
            self._emit(buffer[:at], out)
            return buffer[at + len(self._open) :]
        cut = len(buffer) - partial_suffix(buffer, self._starts)
        self._emit(buffer[:cut], out)
        self._held = buffer[cut:]
        return ""

    def _in_call(self, buffer: str, out: Parsed) -> str:
        end = self._sections[self._open][0]  # type: ignore[index]
        at = buffer.find(end) if end else -1
        if at < 0:
            self._held = buffer
            return ""
        self._finish(buffer[:at], end, out)
        return buffer[at + len(end) :]

    def _emit(self, text: str, out: Parsed) -> None:
        if self._trim_before:
            shown = text.rstrip()
            if shown:
                out.content += self._space + shown
                self._space = ""
            self._space += text[len(shown) :]
        elif self._called and not text.strip():
            self._space += text
        else:
            out.content += self._space + text
            self._space = ""

    def _finish(self, body: str, end: str, out: Parsed) -> None:
        start, self._open = self._open or "", None
        calls = self._sections[start][1](body)
        if not calls:
            self._emit(start + body + end, out)
            return
        out.calls.extend(whole(c) for c in calls)
        self._called, self._space = True, ""

    def flush(self, cut: bool = False) -> Parsed:
        out = Parsed()
        held, self._held = self._held, ""
        if self._open and cut:
            self._cut_call(held, out)
        elif self._open:
            self._flush_call(held, out)
        elif held and not cut:  # cut, a held tail was the start of a call marker: dropped
            self._emit(held, out)
        if self._trim_before and not self._called:
            out.content += self._space  # no call followed it: it was content after all
        self._space = ""
        return out

    def _flush_call(self, held: str, out: Parsed) -> None:
        """The output ended inside a section: what it holds is parsed as it is."""
        self._finish(held, "", out)

    def _cut_call(self, held: str, out: Parsed) -> None:
        """The token limit ended the output inside a section: a section that runs to the
        end of the output may be whole; else its calls so far, the last one incomplete."""
        start, self._open = self._open or "", None
        end, parse = self._sections[start]
        calls = None if end else parse(held)
        found = (
            Parsed(calls=[whole(c) for c in calls])
            if calls
            else cut_pieces(self.read_cut, held, parse)
        )
        out.extend(found)
        self._called = self._called or bool(found.calls)


def one_section(start: str, end: str, parse_body: BodyParser) -> DelimitedToolParser:
    """The parser of a markup with one kind of section."""
    return DelimitedToolParser({start: (end, parse_body)})


_HERMES_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)'
)
_ARGS_TAIL = re.compile(r"\s*\}?\s*$")  # what may still close the call object


class HermesToolParser(DelimitedToolParser):
    """Hermes / Qwen: each call is a JSON object between ``<tool_call>`` and ``</tool_call>``,
    and once a call's header ``{"name": …, "arguments": {`` is out, its arguments stream as
    they are generated (holding back what may be the call object's closing brace); a call
    written another way is parsed whole at its closing tag."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_id: IdFactory):
        whole_calls = lambda body: calls_from_values(_json_values(body), make_id)  # noqa: E731
        super().__init__({self.START: (self.END, whole_calls)})
        self._make_id = make_id
        self._streaming = False  # inside a call whose arguments are streaming
        self._streamed = ""  # the arguments streamed so far (for a cut call)

    def _in_call(self, buffer: str, out: Parsed) -> str:
        if self._streaming:
            return self._in_args(buffer, out)
        end = buffer.find(self.END)
        header = _HERMES_HEADER.match(buffer)
        if header is None or 0 <= end < header.end():
            return super()._in_call(buffer, out)
        name = _json_string(header.group(1))
        out.calls.append(CallPiece(arguments="", id=self._make_id(), name=name))
        self._streaming, self._called, self._space = True, True, ""
        self._streamed = ""
        return buffer[header.end() :]

    def _in_args(self, buffer: str, out: Parsed) -> str:
        end = buffer.find(self.END)
        if end >= 0:
            self._end_args(buffer[:end], out)
            return buffer[end + len(self.END) :]
        body = buffer[: len(buffer) - partial_suffix(buffer, (self.END,))]
        cut = _ARGS_TAIL.search(body).start()  # type: ignore[union-attr]
        if cut:
            out.calls.append(CallPiece(arguments=body[:cut]))
            self._streamed += body[:cut]
        self._held = buffer[cut:]
        return ""

    def _end_args(self, rest: str, out: Parsed) -> None:
        """The last of the arguments: ``rest`` less the call object's closing brace."""
        rest = rest.rstrip()
        rest = rest[:-1].rstrip() if rest.endswith("}") else rest
        if rest:
            out.calls.append(CallPiece(arguments=rest))
        self._open, self._streaming = None, False

    def _flush_call(self, held: str, out: Parsed) -> None:
        if self._streaming:
            self._end_args(held, out)
        else:
            super()._flush_call(held, out)

    def _cut_call(self, held: str, out: Parsed) -> None:
        """Cut while its arguments streamed: the rest as written, the call incomplete."""
        if not self._streaming:
            return super()._cut_call(held, out)
        from mlxd.actors.families.cut import json_arguments

        written = json_arguments(self._streamed + held)  # a whole object ends there
        rest = written[len(self._streamed) :] if written.startswith(self._streamed) else held
        out.calls.append(CallPiece(arguments=rest, incomplete=True))
        self._open, self._streaming = None, False
