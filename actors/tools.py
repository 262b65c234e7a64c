"""Tools and reasoning as the chat template sees them: formats, prompts, history.

``template_traits`` reads the model's chat template once: which tool-call
format its output uses (``auto``: from the markers in the template), whether the
template renders ``tools`` itself, and which reasoning tags it uses. A
template without tool support gets a system-prompt description of the tools
instead, in the markup its format's parser reads (``families/tool_prompts.py``:
DeepSeek's documented prompt for DeepSeek's templates, Hermes-style
``<tool_call>`` for the rest, SmolLM2's for one), and earlier calls and results
the template does not write are written into the history in that markup.
Pure functions: no trio, no mlx.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from mlxd.actors.families import formats, reasoning, tool_prompts
from mlxd.protocol.messages import Message, Tool, ToolCall


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does with tools and reasoning, and why mlxd thinks so."""

    tool_format: str
    tools_in_template: bool
    reasoning: tuple[str, str] | None
    reasoning_in_parser: bool = False  # the tool-call parser reads reasoning too (harmony)
    history_id: Callable[[str], str] | None = None  # call ids as the template wants them
    controls: reasoning.Controls = reasoning.Controls((), False, None)
    why_format: str = ""
    why_reasoning: str = ""
    # where the template does not render tools: the prompt mlxd describes them in
    tool_prompt: tool_prompts.ToolPrompt = tool_prompts.HERMES


def template_source(tokenizer: object) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def vocabulary(tokenizer: object) -> frozenset[str]:
    """The tokenizer's token strings (where the template names no markup, they may)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return frozenset(get_vocab()) if callable(get_vocab) else frozenset()
    except (TypeError, ValueError, NotImplementedError):  # a tokenizer without a vocab dict
        return frozenset()


def template_traits(tokenizer: object, tool_format: str, reasoning_tags: str) -> TemplateTraits:
    """Traits from the template and vocabulary; ``tool_format`` / ``reasoning_tags`` settings
    override ``auto``."""
    return traits_of(template_source(tokenizer), vocabulary(tokenizer), tool_format, reasoning_tags)


def traits_of(
    source: str, vocab: frozenset[str] | set[str], tool_format: str = "auto", tags: str = "auto"
) -> TemplateTraits:
    if tool_format == "auto":
        found = formats.detect(source, vocab)
        fmt, why_format = found.format, found.why
    else:
        fmt, why_format = (
            formats.named(tool_format),
            f"setting: tokenizer.tool_format = {tool_format!r}",
        )
    pair: tuple[str, str] | None = None
    if fmt.reasoning:
        why_reasoning = f"the {fmt.name} parser reads the reasoning channel"
    elif tags == "auto":
        found_tags, why_reasoning = reasoning.detect_tags(source, vocab)
        pair = (found_tags.open, found_tags.close) if found_tags else None
    elif tags == "none":
        why_reasoning = "setting: tokenizer.reasoning_tags = 'none'"
    else:
        open_tag, _, close_tag = tags.partition(",")
        pair = (open_tag.strip(), close_tag.strip())
        why_reasoning = f"setting: tokenizer.reasoning_tags = {tags!r}"
    tools_in_template = "tools" in source
    return TemplateTraits(
        tool_format=fmt.name,
        tools_in_template=tools_in_template,
        reasoning=pair,
        reasoning_in_parser=fmt.reasoning,
        history_id=fmt.history_id,
        controls=reasoning.controls(source),
        why_format=why_format,
        why_reasoning=why_reasoning,
        tool_prompt=tool_prompts.HERMES
        if tools_in_template
        else tool_prompts.for_template(source, fmt.calls.prompt),
    )


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
    """The tools described in a Hermes system prompt (``tool_prompts.HERMES``)."""
    return tool_prompts.hermes_prompt(tools)


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def call_markup(call: ToolCall) -> str:
    """A call in Hermes ``<tool_call>`` markup."""
    return tool_prompts.hermes_call(call)


def history_as_text(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """Tool calls and results written as Hermes markup, for templates without tool support."""
    return tool_prompts.HERMES.history(messages)


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


def with_call_ids(
    messages: tuple[Message, ...], rename: Callable[[str], str]
) -> tuple[Message, ...]:
    """The history with every call id (and every result's ``tool_call_id``) renamed."""
    out = []
    for m in messages:
        calls = tuple(replace_id(c, rename) for c in m.tool_calls)
        result_of = rename(m.tool_call_id) if m.tool_call_id else m.tool_call_id
        out.append(
            m if not calls and result_of == m.tool_call_id else _message(m, calls, result_of)
        )
    return tuple(out)


def replace_id(call: ToolCall, rename: Callable[[str], str]) -> ToolCall:
    return ToolCall(id=rename(call.id), name=call.name, arguments=call.arguments)


def _message(m: Message, calls: tuple[ToolCall, ...], result_of: str | None) -> Message:
    import msgspec

    return msgspec.structs.replace(m, tool_calls=calls or m.tool_calls, tool_call_id=result_of)
