"""The markup a prompt asks for is the markup the parser reads, for every real template.

Each template in ``.cache/templates`` is rendered through mlxd's prompt builder
with a tool offered and an earlier call in the history. Where the template does
not render tools, mlxd adds a tool prompt (``families/tool_prompts.py``): the call
markup that prompt asks for must be in the prompt, be read back by the format's
parser, and be what its forced-call grammar writes. For every template, the
earlier call as it reaches the model (the template's own rendering, or mlxd's
text in the prompt's markup) must be read back by the parser as that call.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from mlxd.actors.families import tool_prompts
from mlxd.actors.grammar import _byte_tokenizer, tool_call_lark, tool_call_schema
from mlxd.actors.tokenizer import PromptBuilder
from mlxd.actors.tools import traits_of
from mlxd.protocol.messages import ChatRequest, Message, SamplingParams, Tool, ToolCall

from tests import templates

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = Tool(name="get_weather", description="Weather in a city", parameters=PARAMS)
ARGS = '{"city":"Paris"}'

# Templates whose history cannot show an earlier call, and why (checked to stay so).
NO_HISTORY = {
    "fireworks-ai-llama-3-firefunction-v2": "reads a 'functions' variable",
    # tests/test_families.py gives these the inputs they insist on
    "CohereForAI-c4ai-command-r-plus-tool_use": "needs every parameter described",
    "meetkai-functionary-medium-v3.2": "concatenates a call's arguments as a string",
    "llama-cpp-deepseek-r1": "concatenates a call's arguments as a string",
    # they render tools, and drop the calls from the history
    "LFM2-8B-A1B": "drops calls",
    "LFM2.5-Instruct": "drops calls",
    "ibm-granite-granite-3.3-2B-Instruct": "drops calls",
}


class TemplateTokenizer:
    """A chat template rendered as transformers renders it; text encoded as code points."""

    def __init__(self, name: str):
        self.chat_template = templates.source(name)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None, **extra):
        return templates.render(self.chat_template, messages, add_generation_prompt, tools, **extra)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _builder(name: str) -> PromptBuilder:
    traits = traits_of(templates.source(name), set())
    tokenizer = TemplateTokenizer(name)
    return PromptBuilder(
        tokenizer, 1 << 20, default_max_tokens=8, vocab_size=1 << 21, traits=traits
    )


def _request(*messages: Message) -> ChatRequest:
    return ChatRequest(
        request_id="r", messages=messages, sampling=SamplingParams(max_tokens=8), tools=(TOOL,)
    )


ASK = Message(role="user", content="Weather in Paris?")
MARK = "XQZ-turn-end-probe"
CALLED = Message(
    role="assistant",
    content="",
    tool_calls=(ToolCall(id="c0x4Yz9Q7", name="get_weather", arguments=ARGS),),
)


def _parsed(name: str, prompt: str, text: str) -> list[tuple[str, dict]]:
    pieces = templates.feed(name, prompt, text, (TOOL,))
    calls: list[list[str]] = []
    for parsed in pieces:
        for piece in parsed.calls:
            if piece.name is not None:
                calls.append([piece.name, ""])
            calls[-1][1] += piece.arguments
    return [(n, json.loads(a)) for n, a in calls]


def _accepted_by_grammar(fmt: str, text: str) -> bool:
    lark = tool_call_lark(tool_call_schema((TOOL,), ("get_weather",)), fmt)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def _without_tools() -> list[str]:
    return [
        n for n in templates.names() if not traits_of(templates.source(n), set()).tools_in_template
    ]


def test_the_templates_without_tools_include_deepseeks():
    names = _without_tools()
    assert {"deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"} <= set(names)
    assert "deepseek-ai-DeepSeek-R1-Distill-Llama-8B" in names


@pytest.mark.parametrize("name", _without_tools())
def test_the_tool_prompt_asks_for_the_parsers_and_the_grammars_markup(name):
    builder = _builder(name)
    prompt = builder.render_chat(_request(ASK), marks=False)[0]
    asked = builder.traits.tool_prompt
    assert asked.describe((TOOL,)) in prompt  # the prompt mlxd adds reaches the model
    example = asked.example("get_weather", ARGS)
    # as written after any reasoning the generation prompt opened
    assert _parsed(name, "", example) == [("get_weather", {"city": "Paris"})]
    # forced calls write JSON without spaces; the markup around it is the point here
    compact = example.replace('", "', '","').replace('": ', '":')
    assert _accepted_by_grammar(builder.traits.tool_format, compact), compact


def test_deepseek_gets_its_documented_prompt_not_hermes():
    for name in ("deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"):
        builder = _builder(name)
        prompt = builder.render_chat(_request(ASK), marks=False)[0]
        assert builder.traits.tool_format == "deepseek_v3"
        assert builder.traits.tool_prompt.name == "deepseek"
        assert "## Tools\nYou have access to the following tools:\n\n### get_weather\n" in prompt
        assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>" in prompt
        assert "<tool_call>" not in prompt


def _rendered(builder: PromptBuilder, *messages: Message) -> str:
    normalized, extra = builder._template_input(_request(*messages))
    return builder._render(normalized, False, extra)


def _history_call(name: str) -> tuple[str, str]:
    """(the prompt before the call, the call) as mlxd renders the conversation: the
    earlier turn after the generation prompt, less the template's end of turn."""
    builder = _builder(name)
    asked, _, _ = builder.render_chat(_request(ASK), marks=False)
    turn = _rendered(builder, ASK, CALLED)
    probe = _rendered(builder, ASK, Message(role="assistant", content=MARK))
    end = probe[probe.index(MARK) + len(MARK) :].strip()
    cut = templates._common(asked, turn)
    text = turn[cut:]
    return asked[:cut], text[: text.rindex(end)] if end and end in text else text


@pytest.mark.parametrize("name", [n for n in templates.names() if n not in NO_HISTORY])
def test_an_earlier_call_reaches_the_model_in_the_markup_the_parser_reads(name):
    prompt, text = _history_call(name)
    assert ("get_weather", {"city": "Paris"}) in _parsed(name, prompt, text), text


@pytest.mark.parametrize("name", sorted(NO_HISTORY))
def test_templates_without_a_history_oracle_still_have_none(name):
    with pytest.raises((AssertionError, ValueError, TypeError, KeyError, IndexError)):
        test_an_earlier_call_reaches_the_model_in_the_markup_the_parser_reads(name)


def test_deepseek_history_is_the_templates_own_markup():
    prompt, text = _history_call("deepseek-ai-DeepSeek-V3.1")
    assert "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" in text and "<tool_call>" not in text
    # results too: the template's own output markers, not Hermes' <tool_response>
    builder = _builder("deepseek-ai-DeepSeek-V3.1")
    result = Message(role="tool", content="sunny", tool_call_id="c0x4Yz9Q7")
    text = builder.render_chat(_request(ASK, CALLED, result), marks=False)[0]
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in text
    assert "<tool_response>" not in text


@pytest.mark.parametrize(
    "name",
    [
        # renders a call only where content is None, which transformers drops
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
        # renders R1's fenced form (function<｜tool▁sep｜>NAME ```json …```), not the prompt's
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    ],
)
def test_calls_the_template_does_not_write_in_the_prompts_markup_are_text_in_it(name):
    asked = _builder(name).traits.tool_prompt
    assert not asked.calls_in_template and asked.results_in_template
    _, text = _history_call(name)
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" in text
    assert "```json" not in text


def test_hermes_history_keeps_its_shape():
    prompt = tool_prompts.HERMES
    msgs = prompt.history((CALLED, Message(role="tool", content="sunny")))
    assert (
        msgs[0].content
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert msgs[1] == Message(role="user", content="<tool_response>\nsunny\n</tool_response>")


def test_a_template_that_refuses_a_system_role_gets_the_tools_in_the_first_user_turn():
    """Gemma 2 raises on a system message: the description opens the user's turn instead."""
    builder = _builder("google-gemma-2-2b-it")
    assert not builder.traits.tool_prompt.system_in_template
    prompt = builder.render_chat(_request(ASK), marks=False)[0]
    description = builder.traits.tool_prompt.describe((TOOL,))
    assert f"<start_of_turn>user\n{description}\n\nWeather in Paris?" in prompt
