"""Chat-message normalization before the chat template sees the conversation.

Agent clients send shapes that strict templates reject (``developer`` roles,
system messages mid-conversation, several user turns in a row, content as a list
of parts). Normalizing here means no template ever crashes on them. Pure
functions over plain dicts: no trio, no mlx.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.tools import template_tool_calls
from protocol.messages import Message

ChatDict = dict[str, object]

_ROLE_ALIASES = {"developer": "system"}


class NormalizeError(ValueError):
    """A message that cannot be turned into template input; becomes a 400."""


def _flatten(content: object, text_only: bool) -> str | list[dict]:
    """Text parts joined for text models; multimodal lists kept for vision models."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise NormalizeError("message content must be a string or a list of parts")
    if not text_only:
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            texts.append(str(part.get("text", "")))
        else:
            raise NormalizeError(
                f"content part of type {kind!r} is not supported by this text model"
            )
    return "\n".join(texts)


def _join(a: str | list[dict], b: str | list[dict]) -> str | list[dict]:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}" if a and b else a or b
    as_list = lambda c: [{"type": "text", "text": c}] if isinstance(c, str) else list(c)  # noqa: E731
    return as_list(a) + as_list(b)


def _turn(role: str, content: str | list[dict], message: Message) -> ChatDict:
    turn: ChatDict = {"role": role, "content": content}
    if message.name:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def normalize_messages(messages: Iterable[Message], *, text_only: bool = True) -> list[ChatDict]:
    """Return template-ready messages: one leading system message, no same-role runs."""
    system: str | list[dict] | None = None
    turns: list[ChatDict] = []
    for message in messages:
        role = _ROLE_ALIASES.get(message.role, message.role)
        content = _flatten(message.content, text_only)
        if role == "system":
            system = content if system is None else _join(system, content)
        elif turns and turns[-1]["role"] == role and role in ("user", "assistant"):
            turns[-1]["content"] = _join(turns[-1]["content"], content)  # type: ignore[arg-type]
            if message.tool_calls:
                calls = turns[-1].setdefault("tool_calls", [])
                calls.extend(template_tool_calls(message.tool_calls))  # type: ignore[attr-defined]
        else:
            turns.append(_turn(role, content, message))
    if not turns and system is None:
        raise NormalizeError("messages must not be empty")
    return ([{"role": "system", "content": system}] if system is not None else []) + turns
