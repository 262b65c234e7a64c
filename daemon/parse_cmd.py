"""``mlxd parse``: what mlxd makes of a model's raw output, without a server.

    mlxd parse MODEL_DIR < output.txt
    mlxd parse --template chat_template.jinja [--tools tools.json] < output.txt

It picks the tool-call format as ``mlxd serve`` does (from the chat template,
else the vocabulary), runs the same streaming parsers over stdin, and prints one
JSON object: ``chat_template`` (which template serves the model and why: its own, or,
where it has none, its family's as ``mlxd serve`` picks it from the vocabulary),
``format`` and ``why`` (what chose it), ``fim`` (the fill-in-the-middle format and why),
``reasoning_format``,
``content``, ``reasoning`` and ``tool_calls`` (``name``, ``arguments`` as an
object). It answers "why was my tool call not recognised?". Loads no weights
and no MLX.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlxd.actors.families import fim
from mlxd.actors.families.fallback_templates import TemplateChoice, choose
from mlxd.actors.families.output import OutputParser
from mlxd.actors.tools import TemplateTraits, traits_of
from mlxd.protocol.messages import OutputSpec, Tool


def add_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "parse", help="parse a model's raw output from stdin as mlxd would (see --help)"
    )
    cmd.add_argument("model", nargs="?", type=Path, help="a model directory (its tokenizer files)")
    cmd.add_argument("--template", type=Path, help="a chat template file instead of a model")
    cmd.add_argument("--tools", type=Path, help="JSON file: the tools offered (OpenAI shape)")
    cmd.add_argument(
        "--prompt-opens-reasoning",
        action="store_true",
        help="the generation prompt already opened the reasoning block (e.g. ends in <think>)",
    )


def _tokenizer_source(model: Path) -> tuple[str, frozenset[str], TemplateChoice]:
    """The chat template that serves the model (its own, else its family's as ``mlxd serve``
    picks it), its vocabulary, and which template it is and why, from its tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    jinja = model / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text()
    vocab = frozenset(tokenizer.get_vocab())
    choice = choose(template or "", vocab)
    return choice.template or template or "", vocab, choice


def _tools(path: Path | None) -> tuple[Tool, ...]:
    if path is None:
        return ()
    items = json.loads(path.read_text())
    tools = []
    for item in items if isinstance(items, list) else [items]:
        fn = item.get("function", item)
        params = fn.get("parameters") or fn.get("input_schema") or {}
        tools.append(
            Tool(name=fn["name"], description=fn.get("description", ""), parameters=params)
        )
    return tuple(tools)


def parse_text(
    text: str,
    traits: TemplateTraits,
    tools: tuple[Tool, ...] = (),
    opened: bool = False,
    template: TemplateChoice | None = None,
) -> dict:
    """The report ``mlxd parse`` prints for ``text`` under ``traits``."""
    spec = OutputSpec(
        tool_format=traits.tool_format,
        reasoning=traits.reasoning,
        in_reasoning=opened and traits.reasoning is not None,
        tools=tools,
    )
    parser = OutputParser(spec)
    out = parser.feed(text)
    out.extend(parser.flush())
    calls: dict[int, dict] = {}
    for piece in out.calls:
        if piece.id is not None:
            calls[piece.index] = {"name": piece.name, "arguments": piece.arguments}
        else:
            calls[piece.index]["arguments"] += piece.arguments
    for call in calls.values():
        call["arguments"] = json.loads(call["arguments"] or "{}")
    chosen = template or TemplateChoice("setting", "--template: the file given")
    return {
        "chat_template": {"source": chosen.source, "family": chosen.family, "why": chosen.why},
        "format": traits.tool_format,
        "why": traits.why_format,
        "reasoning_format": list(traits.reasoning) if traits.reasoning else None,
        "reasoning_why": traits.why_reasoning,
        "template_variables": traits.controls.why,
        "content": out.content,
        "reasoning": out.reasoning,
        "tool_calls": list(calls.values()),
    }


def parse_command(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.template is None):
        print("mlxd parse: give a model directory or --template FILE", file=sys.stderr)
        return 2
    try:
        choice = None
        if args.template is not None:
            template, vocab = args.template.read_text(), frozenset()
        else:
            template, vocab, choice = _tokenizer_source(args.model)
        tools = _tools(args.tools)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"mlxd parse: {exc}", file=sys.stderr)
        return 2
    traits = traits_of(template, vocab)
    report = parse_text(sys.stdin.read(), traits, tools, args.prompt_opens_reasoning, choice)
    found = fim.detect(template, vocab)  # fill in the middle: the family's tokens, or none
    report["fim"] = {"format": found.format.name if found.format else None, "why": found.why}
    print(json.dumps(report, ensure_ascii=False, indent=2))
    return 0
