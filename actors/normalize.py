"""Chat-message normalization before the chat template sees the conversation.

Agent clients send shapes that strict templates reject (``developer`` roles,
system messages mid-conversation, several user turns in a row, content as a list
of parts). Normalizing here means no template ever crashes on them. Pure
functions from ``Message`` to the dicts a chat template takes (a vision model's
image parts stay typed until ``vision.split_images``): no trio, no mlx.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlxd.actors.tools import template_tool_calls
from mlxd.protocol.messages import ContentPart, Message, TextPart

ChatDict = dict[str, object]

_ROLE_ALIASES = {"developer": "system"}


class NormalizeError(ValueError):
    """A message that cannot be turned into template input; becomes a 400."""


Content = str | list[ContentPart]


def _flatten(content: str | tuple[ContentPart, ...] | None, text_only: bool) -> Content:
    """Text parts joined for text models; multimodal lists kept for vision models."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not text_only:
        return list(content)
    texts = []
    for part in content:
        if not isinstance(part, TextPart):
            raise NormalizeError(
                "content part of type 'image_url' is not supported by this text model"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _join(a: Content, b: Content) -> Content:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}" if a and b else a or b
    as_list = lambda c: [TextPart(text=c)] if isinstance(c, str) else list(c)  # noqa: E731
    return as_list(a) + as_list(b)


def _turn(role: str, content: Content, message: Message) -> ChatDict:
    turn: ChatDict = {"role": role, "content": content}
    if message.name:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.reasoning and role == "assistant":
        # the two names templates read it by: Qwen3, GLM, MiniMax, Gemma 4 / gpt-oss
        turn["reasoning_content"] = turn["thinking"] = message.reasoning
    return turn


def normalize_messages(messages: Iterable[Message], *, text_only: bool = True) -> list[ChatDict]:
    """Return template-ready messages: one leading system message, no same-role runs."""
    system: Content | None = None
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
