"""Families whose calls are JSON inside their own markers (no library parses them).

Apriel ``<tool_calls>[…]</tool_calls>``, MiniMax-M1 ``<tool_calls>{…}</tool_calls>``,
Nemotron Nano v2 ``<TOOLCALL>[…]</TOOLCALL>``, GigaChat 3.1 ``<|function_call|>{…}``,
Cohere Command R7B ``<|START_ACTION|>[…]<|END_ACTION|>``, Apertus
``<|tools_prefix|>[{"name": {…}}]<|tools_suffix|>``, Functionary v3.1
``<function=name>{…}</function>`` and Solar Open's ``<|tool_call:name|>`` fields.
mlx-lm has none of these (its ``json_tools`` takes one bare object per
``<tool_call>``), so the body parsing is written here, once, over a table of
the key names each family uses. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import re

from mlxd.actors.parsers import IdFactory, _arguments_text, _json_values, _utf8
from mlxd.protocol.messages import ToolCall

_NAME_KEYS = ("name", "tool_name", "function")
_ARGS_KEYS = ("arguments", "parameters", "args", "input")


def _call(obj: object, make_id: IdFactory) -> ToolCall | None:
    """One call object under any of the families' key names, or ``{"name": {args}}``."""
    if not isinstance(obj, dict):
        return None
    name = next((obj[k] for k in _NAME_KEYS if isinstance(obj.get(k), str)), None)
    if name is None and len(obj) == 1:  # Apertus: {"get_weather": {"city": "Paris"}}
        ((name, args),) = obj.items()
    else:
        args = next((obj[k] for k in _ARGS_KEYS if k in obj), {})
    text = _arguments_text(args)
    if not isinstance(name, str) or not name or not _utf8(name) or text is None:
        return None
    return ToolCall(id=make_id(), name=name, arguments=text)


def json_calls(body: str, make_id: IdFactory) -> list[ToolCall] | None:
    """Every call in ``body``: JSON objects or lists of them; None unless all are calls."""
    values = _json_values(body.strip(), ";,")
    if not values:
        return None
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(v, make_id) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


_FUNCTIONARY = re.compile(r"\s*([\w.\-]+)>")


def functionary_call(body: str, make_id: IdFactory) -> list[ToolCall] | None:
    """Functionary v3.1: the body after ``<function=`` is ``name>{…}``."""
    head = _FUNCTIONARY.match(body)
    if head is None:
        return None
    values = _json_values(body[head.end() :].strip())
    if not values or len(values) != 1:
        return None
    call = _call({"name": head.group(1), "arguments": values[0]}, make_id)
    return [call] if call else None


def solar_calls(body: str, make_id: IdFactory) -> list[ToolCall] | None:
    """Solar Open: ``<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{…}`` each,
    ended by ``<|tool_call:end|>``; ``body`` is everything between ``<|tool_calls|>`` and
    ``<|calls|>``."""
    calls = []
    for part in body.split("<|tool_call:begin|>"):
        if not part.strip():
            continue
        _, _, rest = part.partition("<|tool_call:name|>")
        name, _, args = rest.partition("<|tool_call:args|>")
        args = args.split("<|tool_call:end|>")[0]
        call = _call({"name": name.strip(), "arguments": args.strip()}, make_id)
        if call is None:
            return None
        calls.append(call)
    return calls or None
