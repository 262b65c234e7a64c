"""Tool prompts for chat templates that do not render ``tools``, one per markup.

Where a model's template renders the request's tools, the template's own prompt
asks for its family's markup. Where it does not, mlxd describes the tools in a
system prompt, and that prompt must ask for the markup the format's parser reads
and its forced-call grammar writes. Each entry here is one such prompt: how the
tools are described, the call markup it asks for (``example``), and how earlier
calls and results reach the template (the template's own rendering where it
writes them in that markup, else text in that markup).

- ``deepseek``: DeepSeek's documented tool prompt for V3.1 (its model card), asking
  for ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>
  <｜tool▁calls▁end｜>``, the markup of the ``deepseek_v3`` parser and grammar. The
  R1-Distill templates (which render no tools either) get it too; they write earlier
  calls in R1's fenced form (or drop them), so there the calls are written as text in
  V3.1's, and the model sees one markup throughout.
- ``hermes``: every other template without tools: Hermes ``<tool_call>`` JSON, the
  fallback format ``formats.detect`` gives such a template.

``for_template`` picks the entry by the tool format and probes the template once
for whether it renders calls and results itself. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
import msgspec
from mlxd.protocol.messages import ContentPart, Message, TextPart, Tool, ToolCall

# A tool's description for the prompt: (name, description, parameters as JSON text).
Spec = tuple[str, str, str]


@dataclass(frozen=True)
class ToolPrompt:
    """How mlxd offers tools to a template that does not render them, in one markup."""

    name: str
    why: str
    describe: Callable[[tuple[Tool, ...]], str]  # the system prompt
    call_text: Callable[[ToolCall], str]  # an earlier call, written in the markup
    result_text: Callable[[str], str]  # an earlier tool result, written in the markup
    separator: str = ""  # between an answer's text and its calls, and between calls
    section: tuple[str, str] = ("", "")  # around the calls of one turn
    # The template writes earlier calls / results in this very markup (probed per template).
    calls_in_template: bool = False
    results_in_template: bool = False
    system_in_template: bool = True  # else the description opens the first user turn

    def offer(self, messages: tuple[Message, ...], tools: tuple[Tool, ...]) -> tuple[Message, ...]:
        """The conversation with the tools described: in a system message (joined to the
        client's), or before the first user turn where the template refuses a system role."""
        text = self.describe(tools)
        if self.system_in_template:
            return (*messages, Message(role="system", content=text))
        first = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first is None:
            return (Message(role="user", content=text), *messages)
        m = messages[first]
        if isinstance(m.content, tuple):  # parts are joined by a newline
            opened = msgspec.structs.replace(m, content=(TextPart(text=text + "\n"), *m.content))
        else:
            opened = msgspec.structs.replace(m, content=f"{text}\n\n{m.content or ''}")
        return (*messages[:first], opened, *messages[first + 1 :])

    def example(self, name: str, arguments: str) -> str:
        """The call markup the prompt asks for, holding ``name`` and ``arguments`` (JSON)."""
        call = self.call_text(ToolCall(id="example", name=name, arguments=arguments))
        return f"{self.section[0]}{call}{self.section[1]}"

    def history(self, messages: tuple[Message, ...]) -> tuple[Message, ...]:
        """The conversation with what the template does not write turned into text."""
        return tuple(self._message(m) for m in messages)

    def _message(self, m: Message) -> Message:
        if m.role == "tool" and not self.results_in_template:
            return Message(role="user", content=_result(m.content, self.result_text))
        if m.tool_calls and not self.calls_in_template:
            parts = [m.content] if isinstance(m.content, str) and m.content else []
            calls = self.separator.join(self.call_text(c) for c in m.tool_calls)
            parts.append(f"{self.section[0]}{calls}{self.section[1]}")
            return Message(role=m.role, content=self.separator.join(parts), name=m.name)
        return m


def _result(content: str | tuple[ContentPart, ...] | None, write: Callable[[str], str]):
    """A result's text in the markup; a result holding images stays parts (vision models)."""
    if not isinstance(content, tuple):
        return write(content if isinstance(content, str) else json.dumps(content))
    texts = [p.text for p in content if isinstance(p, TextPart)]
    if len(texts) == len(content):
        return write("\n".join(texts))
    opening, closing = write("\0").split("\0")
    return (TextPart(text=opening), *content, TextPart(text=closing))


def _specs(tools: tuple[Tool, ...]) -> list[Spec]:
    return [
        (
            t.name,
            t.description,
            json.dumps(t.parameters or {"type": "object", "properties": {}}, ensure_ascii=False),
        )
        for t in tools
    ]


def _arguments(call: ToolCall) -> str:
    """A call's arguments as compact JSON (as the forced-call grammar writes them)."""
    try:
        return json.dumps(json.loads(call.arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return call.arguments


# DeepSeek's markup (special tokens of its vocabulary).
_CALLS, _CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_CALL, _SEP, _CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_OUTPUT, _OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


def deepseek_prompt(tools: tuple[Tool, ...]) -> str:
    """DeepSeek V3.1's tool prompt as its model card documents it (the wording it was
    trained on, kept as written there), for the system prompt."""
    described = "".join(
        f"### {name}\nDescription: {description}\n\nParameters: {params}\n\n"
        for name, description, params in _specs(tools)
    )
    return (
        "## Tools\nYou have access to the following tools:\n\n"
        f"{described}"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{_CALLS}{_CALL}tool_call_name{_SEP}tool_call_arguments{_CALL_END}"
        "{additional_tool_calls}"
        f"{_CALLS_END}\n\n"
        "Where:\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
        "Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces"
    )


def _deepseek_call(call: ToolCall) -> str:
    return f"{_CALL}{call.name}{_SEP}{_arguments(call)}{_CALL_END}"


def hermes_prompt(tools: tuple[Tool, ...]) -> str:
    """The tools described for Hermes-style ``<tool_call>`` JSON calls."""
    specs = "\n".join(
        json.dumps(
            {"name": name, "description": description, "parameters": json.loads(params)},
            ensure_ascii=False,
        )
        for name, description, params in _specs(tools)
    )
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_call(call: ToolCall) -> str:
    try:
        arguments: object = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _hermes_result(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


DEEPSEEK = ToolPrompt(
    "deepseek",
    "DeepSeek's documented V3.1 tool prompt (## Tools … <｜tool▁calls▁begin｜>), the markup "
    "of the deepseek_v3 parser and grammar",
    deepseek_prompt,
    _deepseek_call,
    lambda text: f"{_OUTPUT}{text}{_OUTPUT_END}",
    section=(_CALLS, _CALLS_END),
)
HERMES = ToolPrompt(
    "hermes",
    "the template does not render tools: mlxd describes them in a system prompt asking "
    "for Hermes <tool_call> JSON, and writes earlier calls and results in that markup",
    hermes_prompt,
    hermes_call,
    _hermes_result,
    separator="\n",
)

# A call and a result unlike any real ones, to see whether the template writes them.
_PROBE_NAME, _PROBE_RESULT = "mlxd_probe_call", "mlxd-probe-result"
_PROBE = [
    {"role": "user", "content": "Hi"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
        ],
    },
    {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "c1"},
]


def _render(source: str, messages: list[dict]) -> str | None:
    from mlxd.actors.chat_template import _compiled

    try:
        return _compiled(source).render(
            messages=messages, add_generation_prompt=False, bos_token="", eos_token=""
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None  # the template refuses this conversation


def for_template(source: str, prompt: ToolPrompt | None) -> ToolPrompt:
    """The prompt for a template that does not render tools, in the markup of its format's
    ``prompt`` (``formats.CallMarkup``; None: Hermes); a family's template that writes its
    own calls and results keeps them (the Hermes prompt's markup is no template's: always
    text)."""
    system = _render(source, [{"role": "system", "content": "S"}, *_PROBE[:1]]) is not None
    if prompt is None:
        return dataclasses.replace(HERMES, system_in_template=system)
    # the template's own rendering counts only where it is the prompt's markup (the
    # R1-Distill templates write R1's fenced calls: those are written as text instead)
    history = _render(source, _PROBE) or ""
    call = ToolCall(id="c1", name=_PROBE_NAME, arguments="{}")
    return dataclasses.replace(
        prompt,
        calls_in_template=prompt.call_text(call) in history,
        results_in_template=prompt.result_text(_PROBE_RESULT) in history,
        system_in_template=system,
    )
