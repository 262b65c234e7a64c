"""Incremental output parsers: the machinery that splits reasoning and tool calls out of
streamed text.

The streamer feeds each request's text deltas (after stop strings) through one
``OutputParser`` (``actors/families/output.py``), which yields content,
reasoning text and complete tool calls. Like the stop matcher, every parser
holds back any tail that could still start its markup, so raw markup never
leaks out as content whatever the chunk boundaries. Here:

- ``StateParser``: the loop of a parser whose state names the method that reads next;
- reasoning: ``<think>…</think>`` (or another tag pair) at the start of the output;
- ``MarkerToolParser`` + ``parse_mistral``: ``[TOOL_CALLS]`` then a JSON list of calls, or
  ``name[ARGS]{…}`` items (text before the marker is content);
- ``LeadingToolParser``: output that starts with a call (Llama 3 JSON, generic JSON).

Which format a model writes, and the parsers of the other families (markup between
start and end markers, Hermes JSON with streamed arguments: ``families/delimited.py``),
are in ``actors/families/``. Calls come out as ``CallPiece``s: a call's first
piece has its id and name, later pieces continue its arguments. A call whose
JSON does not parse is given back as content, never dropped (except arguments
already streamed). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxd.protocol.messages import ToolCall

IdFactory = Callable[[], str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(buffer: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buffer)), best, -1):
            if buffer.endswith(marker[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class CallPiece:
    """A tool call or a piece of one: ``id`` and ``name`` are set on a call's first piece.

    ``index`` numbers the calls of a request (set by ``OutputParser``). ``incomplete``: the
    token limit cut this call (``families/cut.py``); set on its last piece.
    """

    arguments: str
    id: str | None = None
    name: str | None = None
    index: int = -1
    incomplete: bool = False


def whole(call: ToolCall) -> CallPiece:
    return CallPiece(arguments=call.arguments, id=call.id, name=call.name)


# The calls of a call section the token limit cut (``families/cut.py``): (the section's text
# so far, its body parser or None) → whole calls, then the cut one. Unset: no call is read
# from a cut section and its markup is dropped.
CutReader = Callable[[str, Callable[[str], list[ToolCall] | None] | None], list[CallPiece]]


def cut_pieces(reader: CutReader | None, held: str, parse=None) -> Parsed:
    """A cut call section's calls: never its markup as content."""
    return Parsed(calls=reader(held, parse)) if reader is not None else Parsed()


@dataclass
class Parsed:
    """What one chunk of output text turned out to be."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)


# ---- reasoning ------------------------------------------------------------------------


class StateParser:
    """A parser that reads its buffer with the method its state names (``_<state>``): each
    takes what is left and the output, and returns what it did not read (a tail that may
    start a marker goes to ``_held``, for the next chunk)."""

    _state: str
    _held: str

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = getattr(self, f"_{self._state}")(buffer, out)
        return out


class ReasoningParser(StateParser):
    """Splits a leading ``open…close`` block off as reasoning.

    The block counts only at the start of the output (after whitespace), or from
    the first character when the prompt already opened it. Whitespace right
    after the closing tag is dropped.
    """

    def __init__(self, open_tag: str, close_tag: str, *, inside: bool = False):
        self._open, self._close = open_tag, close_tag
        self._state = "inside" if inside else "start"  # start | inside | content
        self._held = ""
        self._strip = False

    def _start(self, buffer: str, out: Parsed) -> str:
        stripped = buffer.lstrip()
        if stripped.startswith(self._open):
            self._state = "inside"
            return stripped[len(self._open) :]
        if not stripped or self._open.startswith(stripped):
            self._held = buffer  # could still become the opening tag
            return ""
        self._state = "content"
        return buffer

    def _inside(self, buffer: str, out: Parsed) -> str:
        end = buffer.find(self._close)
        if end >= 0:
            out.reasoning += buffer[:end]
            self._state, self._strip = "content", True
            return buffer[end + len(self._close) :]
        keep = partial_suffix(buffer, (self._close,))
        out.reasoning += buffer[: len(buffer) - keep]
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _content(self, buffer: str, out: Parsed) -> str:
        if self._strip:
            buffer = buffer.lstrip()
            self._strip = not buffer
        out.content += buffer
        return ""

    def flush(self) -> Parsed:
        held, self._held = self._held, ""
        if self._state == "inside":
            return Parsed(reasoning=held)
        return Parsed(content=held)


# ---- tool calls -----------------------------------------------------------------------


def _utf8(text: str) -> bool:
    """False for text with lone surrogates: JSON escapes (``\\ud800``) can make them, UTF-8
    cannot carry them, so no answer holding them could be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arguments_text(args: object) -> str | None:
    """Arguments as JSON object text; a JSON string holding an object is accepted too."""
    try:
        if isinstance(args, str):
            args = json.loads(args)
        text = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to be arguments
        return None
    return text if text is not None and _utf8(text) else None


def call_from_json(obj: object, make_id: IdFactory) -> ToolCall | None:
    """``{"name": …, "arguments"|"parameters": {…}}`` → a ToolCall, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _utf8(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = _arguments_text(args)
    if text is None:
        return None
    return ToolCall(id=make_id(), name=obj["name"], arguments=text)


def _json_string(body: str) -> str:
    """A JSON string's body unescaped; as written when its escapes are not JSON's."""
    try:
        text = json.loads(f'"{body}"')
    except ValueError:
        return body
    return text if _utf8(text) else body


def _json_values(text: str, separators: str = "") -> list[object] | None:
    """Consecutive JSON values separated by whitespace (and ``separators``); None if not."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # a model can emit any nesting
            return None
        values.append(value)


def calls_from_values(values: list[object] | None, make_id: IdFactory) -> list[ToolCall] | None:
    """Calls from JSON values (objects, or lists of objects); None unless all are calls."""
    if not values:
        return None
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [call_from_json(v, make_id) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class LeadingToolParser:
    """Output that *starts* with tool-call markup is buffered to the end and parsed whole.

    ``prefixes``: the openings that mark a call (a marker token, ``{``, ``[``).
    ``parse`` turns the whole output into calls, or None (then it is content).
    Output that starts with anything else streams through as content.
    """

    read_cut: CutReader | None = None

    def __init__(self, prefixes: tuple[str, ...], parse: Callable[[str], list[ToolCall] | None]):
        self._prefixes = prefixes
        self._parse = parse
        self._state = "start"  # start | call | content
        self._held = ""

    def feed(self, text: str) -> Parsed:
        if self._state == "content":
            return Parsed(content=text)
        buffer = self._held + text
        if self._state == "call":
            self._held = buffer
            return Parsed()
        stripped = buffer.lstrip()
        if any(stripped.startswith(p) for p in self._prefixes):
            self._state, self._held = "call", buffer
            return Parsed()
        if not stripped or any(p.startswith(stripped) for p in self._prefixes):
            self._held = buffer
            return Parsed()
        self._state, self._held = "content", ""
        return Parsed(content=buffer)

    def flush(self, cut: bool = False) -> Parsed:
        held, self._held = self._held, ""
        if self._state == "call":
            calls = self._parse(held)
            if calls is not None:
                return Parsed(calls=[whole(c) for c in calls])
            # no marker here: output that only looks like a call stays content
            cut_calls = cut_pieces(self.read_cut, held) if cut else Parsed()
            if cut_calls.calls:
                return cut_calls
        return Parsed(content=held)


class MarkerToolParser:
    """Content until a marker (Mistral's ``[TOOL_CALLS]``); from the marker on, calls to the end.

    The calls are parsed whole when the output ends; if they do not parse, the
    text from the marker on is content after all.
    """

    read_cut: CutReader | None = None

    def __init__(self, marker: str, parse: Callable[[str], list[ToolCall] | None]):
        self._marker = marker
        self._parse = parse
        self._calls = False
        self._held = ""

    def feed(self, text: str) -> Parsed:
        buffer, self._held = self._held + text, ""
        if self._calls:
            self._held = buffer
            return Parsed()
        at = buffer.find(self._marker)
        if at >= 0:
            self._calls, self._held = True, buffer[at:]
            return Parsed(content=buffer[:at])
        keep = partial_suffix(buffer, (self._marker,))
        self._held = buffer[len(buffer) - keep :]
        return Parsed(content=buffer[: len(buffer) - keep])

    def flush(self, cut: bool = False) -> Parsed:
        held, self._held = self._held, ""
        calls = self._parse(held) if self._calls else None
        if calls is None and cut and self._calls:
            return cut_pieces(self.read_cut, held)
        if calls is None:
            return Parsed(content=held)
        return Parsed(calls=[whole(c) for c in calls])


_MISTRAL_ITEM = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?\[ARGS\]")


def parse_mistral(text: str, make_id: IdFactory) -> list[ToolCall] | None:
    """``[TOOL_CALLS] [{…}, …]`` (v3) or ``[TOOL_CALLS]name[ARGS]{…}`` items (v11)."""
    parts = [p for p in text.split("[TOOL_CALLS]") if p.strip()]
    if not parts:
        return None
    calls: list[ToolCall] = []
    for part in parts:
        item = _MISTRAL_ITEM.match(part)
        if item is None:
            found = calls_from_values(_json_values(part), make_id)
        else:
            args = _json_values(part[item.end() :])
            found = None
            if args and len(args) == 1 and isinstance(args[0], dict):
                found = [call_from_json({"name": item.group(1), "arguments": args[0]}, make_id)]
        if not found or None in found:
            return None
        calls.extend(found)  # type: ignore[arg-type]
    return calls
