"""Real chat templates as test oracles: what each family's model writes for a tool call.

``scripts/install --test`` puts the ~70 templates llama.cpp vendors (from real
models) into ``.cache/templates``. A template renders an assistant turn holding
tool calls in the markup that family was trained to write, so rendering one
and cutting off the generation prompt before it and the end-of-turn after it
gives the text the model writes for that call: the parsers must read it back.
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest
from mlxd.actors import chat_template
from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES = Path(__file__).resolve().parent.parent / ".cache" / "templates"
_MARK = "XQZ-turn-end-probe"


def template_dir() -> Path:
    """The templates' folder; a skip where they are not installed (a failure in CI)."""
    if not TEMPLATES.is_dir():
        message = f"no chat templates in {TEMPLATES}: run scripts/install --test"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return TEMPLATES


def source(name: str) -> str:
    return (template_dir() / f"{name}.jinja").read_text()


def names() -> list[str]:
    if not TEMPLATES.is_dir():
        return []
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def render(template: str, messages: list[dict], generation: bool, tools=None, **extra) -> str:
    """As mlxd renders: transformers' renderer, or mlxd's fallback where that one refuses."""
    variables = {"bos_token": "<s>", "eos_token": "</s>", **extra}
    try:
        out, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template,
            add_generation_prompt=generation,
            **variables,
        )
    except jinja2.exceptions.SecurityError as exc:
        if not chat_template.refused_mutation(exc):
            raise
        return chat_template._compiled(template).render(
            messages=messages, tools=tools, add_generation_prompt=generation, **variables
        )
    return out[0]


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    # back off to the start of a marker cut in two (``<think>`` against ``</think>``)
    opening = max(a.rfind("<", 0, n), a.rfind("[", 0, n))
    if opening >= 0 and ">" not in a[opening:n] and "]" not in a[opening:n]:
        return opening
    return n


def written(
    template: str, user: str, assistant: dict, tools: list[dict], **extra
) -> tuple[str, str]:
    """(generation prompt, what the model writes) for ``assistant`` after one user turn."""
    first = [{"role": "user", "content": user}]
    prompt = render(template, first, True, tools, **extra)
    turn = render(template, [*first, assistant], False, tools, **extra)
    probe = render(
        template, [*first, {"role": "assistant", "content": _MARK}], False, tools, **extra
    )
    end = probe[probe.index(_MARK) + len(_MARK) :] if _MARK in probe else ""
    cut = _common(prompt, turn)
    text = turn[cut:]
    if end.strip() and text.endswith(end):
        text = text[: -len(end)]
    elif end.strip() and end.strip() in text:
        text = text[: text.rindex(end.strip())]
    return prompt[:cut], text


def feed(name: str, prompt: str, text: str, tools, chunk: int | None = None) -> list:
    """What mlxd's output parser makes of ``text`` after ``prompt``, with the formats
    detected from template ``name``: the ``Parsed`` of each chunk (``chunk`` characters
    at a time; None: whole), then of the flush."""
    from mlxd.actors.families.output import OutputParser
    from mlxd.actors.tools import traits_of
    from mlxd.protocol.messages import OutputSpec

    traits = traits_of(source(name), set())
    tags = traits.reasoning
    spec = OutputSpec(
        tool_format=traits.tool_format,
        reasoning=tags,
        in_reasoning=bool(tags) and prompt.rstrip().endswith(tags[0]),  # type: ignore[index]
        tools=tools,
    )
    parser = OutputParser(spec, make_id=lambda: "id")
    pieces = [text] if chunk is None else [text[i : i + chunk] for i in range(0, len(text), chunk)]
    return [parser.feed(p) for p in pieces] + [parser.flush()]
