"""Tool formats and prompts from chat templates; history for templates without tool support."""

from __future__ import annotations

import pytest
from mlxd.actors.tools import history_as_text, template_traits
from mlxd.protocol.messages import Message, ToolCall


class Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize(
    ("template", "fmt", "in_template", "reasoning"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", False, None),
        ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>", "hermes", True, None),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral", True, None),
        ("{% if tools %}{{ tools }}{% endif %}<|python_tag|>", "llama3", True, None),
        ("{% if tools %}{{ tools }}{% endif %}", "json", True, None),
        ("{% if tools %}<tool_call>{% endif %}<think>", "hermes", True, ("<think>", "</think>")),
        (None, "hermes", False, None),
    ],
)
def test_traits_from_the_template(template, fmt, in_template, reasoning):
    traits = template_traits(Tok(template), "auto", "auto")
    assert (traits.tool_format, traits.tools_in_template, traits.reasoning) == (
        fmt,
        in_template,
        reasoning,
    )


def test_settings_override_auto():
    traits = template_traits(Tok("<tool_call><think>"), "llama3", "none")
    assert traits.tool_format == "llama3" and traits.reasoning is None
    traits = template_traits(Tok(""), "auto", "<reason>,</reason>")
    assert traits.reasoning == ("<reason>", "</reason>")
    with pytest.raises(ValueError, match="unknown tool format"):
        template_traits(Tok(""), "xml", "auto")


def test_history_as_hermes_markup():
    call = ToolCall(id="c1", name="f", arguments='{"a": 1}')
    history = history_as_text(
        (
            Message(role="assistant", content="Let me look.", tool_calls=(call,)),
            Message(role="tool", tool_call_id="c1", content="42"),
        )
    )
    assert (
        history[0].content
        == 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert history[1].role == "user"
    assert history[1].content == "<tool_response>\n42\n</tool_response>"
