"""A call cut by the token limit: the call as far as the model wrote it.

When ``max_tokens`` ends the output inside a call's markup, the parsers do not give
the markup back as content. If the call's name is complete, the call comes back
*incomplete*: a ``CallPiece`` with ``incomplete`` set, its arguments as written so
far (the raw partial JSON where the family writes JSON; the arguments complete so
far, as a JSON object, where it writes them as markup elements). If the cut came
before the name was complete, the markup is dropped and no call is returned.

Each family's markup has a ``CutRule`` (its ``formats.CallMarkup.cut``): where a call starts and its name
ends, and, for markup arguments, what closes one argument and what closes a call, so
that the body parser can read the arguments written so far. ``complete_fields`` and
``close_json`` turn a partial JSON object into what APIs that need an object show
(Anthropic's ``input``, Ollama's ``arguments``). Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from mlxd.actors.parsers import CallPiece, IdFactory, _json_string
from mlxd.protocol.messages import ToolCall

# ---- partial JSON ----------------------------------------------------------------------


def _scan(text: str) -> tuple[list[str], bool, list[int]]:
    """(the open brackets, inside a string?, the offsets of the top-level object's commas)."""
    stack: list[str] = []
    in_string = escaped = False
    commas: list[int] = []
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
        elif ch == "," and len(stack) == 1:
            commas.append(i)
    return stack, in_string, commas


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def complete_fields(text: str) -> dict:
    """The members of a partial JSON object whose values were written whole ({} if none).

    A number at the very end may still have been growing, so it counts only once a comma
    or the closing brace follows it."""
    text = text.strip()
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value
    if not text.startswith("{"):
        return {}
    _, _, commas = _scan(text)
    last = re.search(r"[\w.+-]+$", text)
    growing = last is not None and last.group()[0] in "-0123456789"  # a number at the end
    ends = [] if growing else [len(text)]
    for end in ends + commas[::-1]:
        found = _object(text[:end] + "}")
        if found is not None:
            return found
    return {}


def close_json(text: str) -> str:
    """What to append to a partial JSON object so that it parses (best effort): the open
    string is closed, a key left without a value gets ``null``, brackets are closed."""
    if not text.strip():
        return "{}"
    stack, in_string, _ = _scan(text)
    suffix = '"' if in_string else ""
    tail = (text + suffix).rstrip()
    if tail.endswith(","):
        suffix += '""' if stack and stack[-1] == "]" else '"":null'
    elif tail.endswith(":"):
        suffix += "null"
    elif stack and stack[-1] == "}" and re.search(r'[{,]\s*"(?:[^"\\]|\\.)*"$', tail):
        suffix += ":null"  # a key without its value
    suffix += "".join(reversed(stack))
    return suffix if _object(text + suffix) is not None or not stack else ""


# ---- cut calls -------------------------------------------------------------------------


@dataclass(frozen=True)
class CutRule:
    """Where a call starts in a family's markup, up to where its arguments begin.

    ``call``'s first non-empty group named ``name…`` is the function's name. With no
    ``field_end`` the arguments after the match are JSON; otherwise they are markup
    elements, each closed by ``field_end``, and ``closer`` closes a call after its last
    one (so that the family's body parser reads the call)."""

    call: re.Pattern[str]
    field_end: str = ""
    closer: str = ""
    json_name: bool = False  # the name is a JSON string's body (unescape it)
    before: bool = False  # ``field_end`` separates arguments: cut before it, not after

    def name(self, match: re.Match[str]) -> str:
        found = next(v for k, v in match.groupdict().items() if k.startswith("name") and v)
        return _json_string(found) if self.json_name else found.strip()


BodyParser = Callable[[str], list[ToolCall] | None]


def incomplete(name: str, arguments: str, make_id: IdFactory) -> CallPiece:
    return CallPiece(arguments=arguments, id=make_id(), name=name, incomplete=True)


def json_arguments(raw: str) -> str:
    """The raw arguments written so far; a whole object is cut off what follows it."""
    raw = raw.strip()
    try:
        _, end = json.JSONDecoder().raw_decode(raw)
    except (ValueError, RecursionError):
        return raw
    return raw[:end]


def cut_calls(
    body: str, parse: BodyParser | None, *, rule: CutRule, make_id: IdFactory
) -> list[CallPiece]:
    """The calls of a call section that the limit cut at the end of ``body``: the whole
    ones first, then the cut one (none if the cut came before its name was complete)."""
    matches = [m for m in rule.call.finditer(body) if m.group(0)]
    if not matches:
        return []
    last = matches[-1]
    if rule.field_end:
        whole = _markup_whole(body[: last.start()], parse)
        arguments = _markup_arguments(body[last.start() :], last.end() - last.start(), rule, parse)
    else:
        whole = _json_whole(body, matches[:-1], rule, make_id)
        arguments = json_arguments(body[last.end() :])
    return whole + [incomplete(rule.name(last), arguments, make_id)]


def _json_whole(
    body: str, matches: list[re.Match[str]], rule: CutRule, make_id: IdFactory
) -> list[CallPiece]:
    out = []
    for m in matches:
        arguments = json_arguments(body[m.end() :])
        if _object(arguments) is not None:
            out.append(CallPiece(arguments=arguments, id=make_id(), name=rule.name(m)))
    return out


def _markup_whole(text: str, parse: BodyParser | None) -> list[CallPiece]:
    calls = parse(text) if parse is not None and text.strip() else None
    return [CallPiece(arguments=c.arguments, id=c.id, name=c.name) for c in calls or ()]


def _markup_arguments(call: str, header: int, rule: CutRule, parse: BodyParser | None) -> str:
    """The arguments of the complete elements of a cut call, as a JSON object."""
    if parse is None:
        return "{}"
    found = [m for m in re.finditer(re.escape(rule.field_end), call) if m.start() >= header]
    ends = [m.start() if rule.before else m.end() for m in found]
    for end in [*ends[::-1], header]:
        calls = parse(call[:end] + rule.closer)
        if calls:
            return calls[-1].arguments
    return "{}"


def _rule(pattern: str, field_end="", closer="", json_name=False, before=False) -> CutRule:
    return CutRule(re.compile(pattern, re.DOTALL), field_end, closer, json_name, before)


_STRING = r'(?:[^"\\]|\\.)*'
_OTHER = r'(?:"[^"]*"\s*:\s*"[^"]*"\s*,\s*)*?'  # Command R's "tool_call_id": "0", first
# A JSON call object: {"name": NAME, "arguments": … under the key names the families use.
JSON_CALL = _rule(
    r"\{\s*" + _OTHER + r'"(?:name|tool_name|function)"\s*:\s*"(?P<name>' + _STRING + r')"\s*,'
    r"\s*" + _OTHER + r'"(?:arguments|parameters|args|input)"\s*:\s*',
    json_name=True,
)
_XML_FUNCTION = _rule(r"<function=(?P<name>[^>\n]+)>", "</parameter>", "\n</function>")

# Each format's rule (``formats.CallMarkup.cut``); JSON-object markups share ``JSON_CALL``.
APERTUS = _rule(r'(?:^|[\[,])\s*\{\s*"(?P<name>' + _STRING + r')"\s*:\s*(?=\{)', json_name=True)
MISTRAL = _rule(
    r"\[TOOL_CALLS\]\s*(?P<name>[A-Za-z0-9_.\-]+)\s*"
    r"(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?\[ARGS\]|"
    + JSON_CALL.call.pattern.replace("?P<name>", "?P<name2>"),
    json_name=True,
)
DEEPSEEK_V3 = _rule(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name_r1>[^\s<]+)[ \t]*\n\s*```(?:json)?"
    r"\s*\n?|(?P<name>[^<\n]+?)<｜tool▁sep｜>)"
)
DEEPSEEK_DSML = _rule(
    r'<｜DSML｜invoke\s+name="(?P<name>[^"]*)"\s*>',
    "</｜DSML｜parameter>",
    "\n</｜DSML｜invoke>",
)
KIMI_K2 = _rule(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^:<\s]+)(?::\d+)?\s*"
    r"<\|tool_call_argument_begin\|>"
)
SOLAR = _rule(r"<\|tool_call:name\|>(?P<name>[^<]+?)<\|tool_call:args\|>")
FUNCTIONARY = _rule(r"^\s*(?P<name>[\w.\-]+)>")
QWEN3_CODER = _XML_FUNCTION
SEED_OSS = _XML_FUNCTION
GLM47 = _rule(r"^\s*(?P<name>[^<\n]+?)\s*(?:\n|(?=<arg_key>))", "</arg_value>")
HY3 = _rule(
    r"<tool_call:opensource>(?P<name>[^<\n]+?)<tool_sep:opensource>",
    "</arg_value:opensource>",
    "\n</tool_call:opensource>",
)
MINIMAX_M2 = _rule(r'<invoke name="(?P<name>[^"]+)">', "</parameter>", "\n</invoke>")
MINICPM5 = _rule(r'^\s*"(?P<name>[^"]+)">', "</param>")  # after ``<function name=``
GEMMA4 = _rule(r"call:(?P<name>[\w.\-]+)\{", ",", "}", before=True)
