"""Tools and reasoning as the chat template sees them: formats, prompts, history.

``template_traits`` reads the model's chat template once: which tool-call
format its output uses (``auto``: from the markers in the template), whether the
template renders ``tools`` itself, and which reasoning tags it uses. A
template without tool support (SmolLM2's, for one) gets a system-prompt
description of the tools instead, asking for Hermes-style ``<tool_call>``
markup, and earlier calls and results are written into the history as that
markup. Pure functions: no trio, no mlx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxd.actors.parsers import TOOL_FORMATS
from mlxd.protocol.messages import ContentPart, Message, TextPart, Tool, ToolCall

_FORMAT_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
)
_REASONING_TAGS = (("<think>", "</think>"),)


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does with tools and reasoning."""

    tool_format: str
    tools_in_template: bool
    reasoning: tuple[str, str] | None


def template_source(tokenizer: object) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def template_traits(tokenizer: object, tool_format: str, reasoning: str) -> TemplateTraits:
    """Traits from the template; ``tool_format`` / ``reasoning`` settings override ``auto``."""
    source = template_source(tokenizer)
    in_template = "tools" in source
    if tool_format == "auto":
        found = [fmt for marker, fmt in _FORMAT_MARKERS if marker in source]
        tool_format = found[0] if found else ("json" if in_template else "hermes")
    elif tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}; known: auto, {TOOL_FORMATS}")
    tags: tuple[str, str] | None = None
    if reasoning == "auto":
        tags = next((t for t in _REASONING_TAGS if t[0] in source), None)
    elif reasoning != "none":
        open_tag, _, close_tag = reasoning.partition(",")
        tags = (open_tag.strip(), close_tag.strip())
    # A format whose markup the model was never taught needs the prompt description.
    return TemplateTraits(tool_format, in_template, tags)


def tool_dicts(tools: tuple[Tool, ...]) -> list[dict]:
    """Tools in the shape HF chat templates expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def tool_system_prompt(tools: tuple[Tool, ...]) -> str:
    """The tools described in a system prompt, for templates that cannot render them."""
    specs = "\n".join(json.dumps(d["function"], ensure_ascii=False) for d in tool_dicts(tools))
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def call_markup(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _tool_response(content: str | tuple[ContentPart, ...] | None) -> str | tuple[ContentPart, ...]:
    """A tool result in ``<tool_response>`` markup; image parts stay parts (vision models)."""
    if not isinstance(content, tuple):
        text = content if isinstance(content, str) else json.dumps(content)
        return f"<tool_response>\n{text}\n</tool_response>"
    texts = [p.text for p in content if isinstance(p, TextPart)]
    if len(texts) == len(content):
        return _tool_response("\n".join(texts))
    opening, closing = TextPart(text="<tool_response>\n"), TextPart(text="\n</tool_response>")
    return (opening, *content, closing)


def history_as_text(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """Tool calls and results written as Hermes markup, for templates without tool support."""
    out = []
    for m in messages:
        if m.role == "tool":
            out.append(Message(role="user", content=_tool_response(m.content)))
        elif m.tool_calls:
            parts = [m.content] if isinstance(m.content, str) and m.content else []
            parts += [call_markup(c) for c in m.tool_calls]
            out.append(Message(role=m.role, content="\n".join(parts), name=m.name))
        else:
            out.append(m)
    return tuple(out)


def template_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """Assistant tool calls in the shape HF chat templates expect (arguments as objects)."""
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": _arguments(c)},
        }
        for c in calls
    ]
