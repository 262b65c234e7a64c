"""OpenAI gpt-oss's harmony format: reasoning, answers and tool calls as channel messages.

After the generation prompt ``<|start|>assistant`` the model writes one or more
messages, each a header, ``<|message|>``, a body and an end token::

    <|channel|>analysis<|message|>…thinking…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The recipient ``to=functions.NAME`` may also come before the channel, and
the content type may be ``<|constrain|>json``, `` json`` or absent.
``<|call|>`` and ``<|return|>`` end generation, so the text may simply stop.
The ``analysis`` channel is reasoning (streamed as it comes); a message to
``functions.NAME`` is a call, its body the arguments; everything else
(``final``, a ``commentary`` preamble, a message with no header at all) is
content. A call whose body is not a JSON object is given back, header and
all, as content. Recipients outside ``functions.`` (the built-in ``python``
and ``browser`` tools, which mlxd never offers) are not calls: their message
goes by its channel.

Why mlxd's own parser: mlx-lm 0.32.2 has no harmony parser. OpenAI's
``openai-harmony`` (0.0.8: a Rust extension, and pydantic) has one,
``StreamableParser``, but it parses token ids, not text, and needs the
``o200k_base`` vocabulary:
``load_harmony_encoding`` downloads it from openaipublic.blob.core.windows.net
on first use (``TIKTOKEN_RS_CACHE_DIR`` caches it; offline with an empty cache
it raises ``HarmonyError: error downloading or loading vocab file``). A
server that must start without the network cannot depend on that, and the
parsers here see detokenized text, so the format is parsed from the text.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re

from mlxd.actors.parsers import (
    IdFactory,
    Parsed,
    StateParser,
    _arguments_text,
    _json_values,
    _utf8,
    partial_suffix,
    whole,
)
from mlxd.protocol.messages import Tool, ToolCall

_START, _MESSAGE = "<|start|>", "<|message|>"
# Where a header ends: at <|message|>, or (malformed) at a token a header never holds.
_HEADER_STOP = re.compile(r"<\|(?:message|end|call|return|start)\|>")
# Where a body ends: its end token, or the next message's opening (the model skipped <|end|>).
_BODY_STOP = re.compile(r"<\|(?:end|call|return|start|channel)\|>")
_BODY_MARKERS = ("<|end|>", "<|call|>", "<|return|>", _START, "<|channel|>")
_NEXT = (_START, "<|channel|>")  # left in the text: the next message reads them
# A header opens with one of these; any other text is a message with no header.
_OPENERS = (_START, "<|channel|>", _MESSAGE, "<|constrain|>", "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_FUNCTIONS = "functions."


def make_parser(make_id: IdFactory, tools: tuple[Tool, ...] = ()) -> HarmonyParser:
    """The request's tools are not needed: a call names its function in its header."""
    return HarmonyParser(make_id)


def _call(name: str, body: str, make_id: IdFactory) -> ToolCall | None:
    values = _json_values(body.strip())
    if not name or not _utf8(name) or not values or len(values) != 1:
        return None
    text = _arguments_text(values[0])
    return ToolCall(id=make_id(), name=name, arguments=text) if text is not None else None


class HarmonyParser(StateParser):
    """Splits harmony messages into reasoning, content and calls (see the module docstring).

    A family writing messages of the same shape with other tokens (Muse) subclasses it with
    its own markers, ``route`` and ``calls``."""

    HEADER_STOP = _HEADER_STOP
    BODY_STOP = _BODY_STOP
    BODY_MARKERS = _BODY_MARKERS
    NEXT = _NEXT
    OPENERS = _OPENERS
    JSON_BODY = True  # a call's body is its JSON arguments (a cut one is read as far as written)

    def __init__(self, make_id: IdFactory):
        self._make_id = make_id
        self._state = "between"  # between | header | body
        self._held = ""
        self._written = ""  # the current message's header as written, given back if its call fails
        self._route = "content"  # where the body goes: content | reasoning | call
        self._name = ""  # the function a call body is for

    def _between(self, buffer: str, out: Parsed) -> str:
        """Before a message: whitespace is dropped, then a header or a headerless body."""
        stripped = buffer.lstrip()
        if any(stripped.startswith(o) for o in self.OPENERS):
            self._state = "header"
            return stripped
        if not stripped or any(o.startswith(stripped) for o in self.OPENERS):
            self._held = buffer  # could still open a header
            return ""
        self._open_body("")
        return stripped

    def _header(self, buffer: str, out: Parsed) -> str:
        skip = len(_START) if buffer.startswith(_START) else 0
        stop = self.HEADER_STOP.search(buffer, skip)
        if stop is None:
            self._held = buffer
            return ""
        if stop.group() != _MESSAGE:  # not a header after all: give it back as content
            end = stop.start() if stop.group() == _START else stop.end()
            out.content += buffer[:end]
            self._state = "between"
            return buffer[end:]
        self._open_body(buffer[: stop.end()])
        return buffer[stop.end() :]

    def _open_body(self, header: str) -> None:
        self._written, self._state = header, "body"
        self._route, self._name = self.route(header)

    def route(self, header: str) -> tuple[str, str]:
        """Where a message's body goes (content | reasoning | call), and the function called."""
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if recipient is not None and recipient.group(1).startswith(_FUNCTIONS):
            return "call", recipient.group(1)[len(_FUNCTIONS) :]
        if channel is not None and channel.group(1) == "analysis":
            return "reasoning", ""
        return "content", ""

    def calls(self, name: str, body: str) -> list[ToolCall] | None:
        """A call message's body read as its calls; None: it is content after all."""
        call = _call(name, body, self._make_id)
        return [call] if call is not None else None

    def _body(self, buffer: str, out: Parsed) -> str:
        stop = self.BODY_STOP.search(buffer)
        if stop is None:
            keep = (
                len(buffer) if self._route == "call" else partial_suffix(buffer, self.BODY_MARKERS)
            )
            self._put(buffer[: len(buffer) - keep], out)
            self._held = buffer[len(buffer) - keep :]
            return ""
        end = stop.start() if stop.group() in self.NEXT else stop.end()
        self._close(buffer[: stop.start()], buffer[stop.start() : end], out)
        return buffer[end:]

    def _cut(self, body: str, out: Parsed) -> None:
        """The token limit cut a call's body: the call as far as written (``cut.py``)."""
        from mlxd.actors.families.cut import incomplete, json_arguments

        self._state = "between"
        if self.JSON_BODY and self._name:
            out.calls.append(incomplete(self._name, json_arguments(body), self._make_id))

    def _put(self, text: str, out: Parsed) -> None:
        if self._route == "reasoning":
            out.reasoning += text
        elif self._route == "content":
            out.content += text

    def _close(self, body: str, end_token: str, out: Parsed) -> None:
        """The message's last text: a call is parsed now, whole."""
        self._state = "between"
        if self._route != "call":
            self._put(body, out)
            return
        calls = self.calls(self._name, body)
        if calls is None:
            out.content += self._written + body + end_token
        else:
            out.calls.extend(whole(c) for c in calls)

    def flush(self, cut: bool = False) -> Parsed:
        out = Parsed()
        held, self._held = self._held, ""
        if cut and self._state == "body" and self._route == "call":
            self._cut(held, out)
        elif self._state == "body":
            self._close(held, "", out)
        elif self._state == "header":  # cut, a header is dropped: it is markup
            out.content += "" if cut else held
        else:
            out.content += held.lstrip()
        self._state = "between"
        return out
