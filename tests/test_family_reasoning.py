"""Every family's real chat template against mlxd's reasoning detection and parsing.

A template that renders an assistant turn's reasoning (``reasoning_content``,
``thinking``, ``reasoning`` or a ``thinking`` content part) renders it in the
markup its model was trained to think in; rendered with reasoning "I think,
therefore." and the answer "Answer.", and cut out as the model writes it
(``templates.written``), the reasoning format mlxd detects from that template
must split it back: the reasoning as reasoning, the answer as content, whole
and a character at a time. Templates that keep reasoning only beside a call
(Gemma 4, Kimi K2 Thinking, Command R7B) are rendered with one, and the call
must parse too.
"""

from __future__ import annotations

import json

import pytest
from mlxd.actors.families import reasoning
from mlxd.actors.families.output import AnswerMarkup
from mlxd.actors.tools import traits_of
from mlxd.protocol.messages import Tool

from tests import templates

REASONING, ANSWER = "I think, therefore.", "Answer."
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTION = {"name": "get_weather", "description": "Weather", "parameters": PARAMS}
TOOLS = [{"type": "function", "function": FUNCTION}]
TOOL = (Tool(name="get_weather", description="Weather", parameters=PARAMS),)
CALL = {
    "id": "c0x4Yz9Q7",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
# The ways an assistant turn carries its reasoning back to a template.
SHAPES = (
    {"reasoning_content": REASONING, "content": ANSWER},
    {"thinking": REASONING, "content": ANSWER},
    {"reasoning": REASONING, "content": ANSWER},
    {"content": [{"type": "thinking", "thinking": REASONING}, {"type": "text", "text": ANSWER}]},
    {  # Apertus's own blocks
        "content": {
            "blocks": [
                {"type": "thoughts", "text": REASONING},
                {"type": "response", "text": ANSWER},
            ]
        }
    },
)
# Templates whose turn with a call ends on a token handing over to the tool, not the
# end-of-turn ``templates.written`` cuts off.
CALL_TURN_END = {
    "google-gemma-4-31B-it": "<|tool_response>",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
}


def _effort(source: str) -> dict:
    """The template's variables for thinking, as a request with high effort renders it."""
    try:
        return reasoning.controls(source).kwargs("high")
    except reasoning.EffortError:
        return {}


def _rendered(name: str, shape: dict, call: bool) -> tuple[str, str] | None:
    """(the whole generation prompt, what the model writes); None where the template does not
    render the reasoning (or renders the message's parts as a Python list)."""
    source, extra = templates.source(name), _effort(templates.source(name))
    message = {"role": "assistant", **shape, **({"tool_calls": [CALL]} if call else {})}
    try:
        _, text = templates.written(source, "Hi", message, TOOLS, **extra)
        prompt = templates.render(source, [{"role": "user", "content": "Hi"}], True, TOOLS, **extra)
    except Exception:  # noqa: BLE001 - a template that refuses this shape does not render it
        return None
    if REASONING not in text or "'type'" in text or '"type"' in text:
        return None
    end = CALL_TURN_END.get(name)
    return prompt, text.removesuffix(end) if call and end else text


def turn(name: str) -> tuple[str, str, bool] | None:
    """The first shape the template renders reasoning in: (prompt, text, with a call)."""
    for call in (False, True):
        for shape in SHAPES:
            found = _rendered(name, shape, call)
            if found:
                return (*found, call)
    return None


def parse(name: str, prompt: str, text: str, chunk: int | None):
    """(reasoning, content, calls) as mlxd reads ``text`` after ``prompt``."""
    outs = templates.feed(name, prompt, text, TOOL, chunk)
    calls = [(p.name, json.loads(p.arguments)) for o in outs for p in o.calls if p.name]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs), calls


# Templates where the oracle cannot apply, and why (each is checked to still render no
# reasoning, so the list cannot go stale).
NO_REASONING_ORACLE = {
    # the template has no reasoning markup at all
    **dict.fromkeys(
        (
            "CohereForAI-c4ai-command-r-plus-tool_use",
            "GigaChat3-10B-A1.8B",
            "GigaChat3.1-10B-A1.8B",
            "Kimi-K2-Instruct",
            "LFM2-8B-A1B",
            "MiMo-VL",
            "MiniMax-M1",
            "Mistral-Small-3.2-24B-Instruct-2506",
            "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
            "Qwen-Qwen2.5-7B-Instruct",
            "Qwen3-Coder",
            "fireworks-ai-llama-3-firefunction-v2",
            "google-gemma-2-2b-it",
            "ibm-granite-granite-4.0",
            "ibm-granite-granite-4.1",
            "meetkai-functionary-medium-v3.1",
            "meetkai-functionary-medium-v3.2",
            "meta-llama-Llama-3.1-8B-Instruct",
            "meta-llama-Llama-3.2-3B-Instruct",
            "meta-llama-Llama-3.3-70B-Instruct",
            "microsoft-Phi-3.5-mini-instruct",
            "mistralai-Mistral-Nemo-Instruct-2407",
            "moonshotai-Kimi-K2",
            "unsloth-mistral-Devstral-Small-2507",
        ),
        "no reasoning markup",
    ),
    # thinking models whose history drops past reasoning (or keeps only what the content holds)
    **dict.fromkeys(
        (
            "HuggingFaceTB-SmolLM3-3B",
            "LFM2.5-Instruct",
            "NVIDIA-Nemotron-Nano-v2",
            "Qwen-QwQ-32B",
            "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "deepseek-ai-DeepSeek-V3.1",
            "ibm-granite-granite-3.3-2B-Instruct",
            "llama-cpp-deepseek-r1",
            "llama-cpp-rwkv-world",
        ),
        "history drops reasoning",
    ),
    # renders a ``thought`` only under an ``add_thoughts`` flag it never sets
    "unsloth-Apriel-1.5": "history drops reasoning",
}


@pytest.mark.parametrize("name", [n for n in templates.names() if n not in NO_REASONING_ORACLE])
def test_each_template_reads_back_the_reasoning_it_renders(name):
    found = turn(name)
    assert found, f"{name} renders no reasoning: list it in NO_REASONING_ORACLE"
    prompt, text, call = found
    for chunk in (None, 1):
        thought, content, calls = parse(name, prompt, text, chunk)
        answer = ANSWER if ANSWER in text else ""  # Command R7B drops a call turn's text
        assert (thought.strip(), content.strip()) == (REASONING, answer), (name, chunk, text)
        assert calls == ([("get_weather", {"city": "Paris"})] if call else []), (name, text)


@pytest.mark.parametrize("name", sorted(NO_REASONING_ORACLE))
def test_templates_without_a_reasoning_oracle_are_still_without_one(name):
    templates.template_dir()
    assert name in templates.names(), f"{name} is gone: take it off the list"
    assert turn(name) is None, f"{name} now renders reasoning: take it off the list"


# Answers the templates' histories cannot show: written without a thinking block, or in a
# family's own wrapper (template, effort, what the model writes, reasoning, content).
@pytest.mark.parametrize(
    ("name", "effort", "output", "thought", "answer"),
    [
        (
            "unsloth-Apriel-1.5",
            "high",
            "Here are my reasoning steps:\nI think, therefore.\n[BEGIN FINAL RESPONSE]\n"
            "Answer.\n[END FINAL RESPONSE]",
            REASONING,
            ANSWER,
        ),
        (
            "unsloth-Apriel-1.5",
            "high",
            "[BEGIN FINAL RESPONSE]Answer.[END FINAL RESPONSE]",
            "",
            ANSWER,
        ),
        (
            "Apriel-1.6-15b-Thinker-fixed",
            "high",
            "Hm.\n[BEGIN FINAL RESPONSE]\nAnswer.",
            "Hm.",
            ANSWER,
        ),
        ("MiniMax-M3", "low", "</mm:think>\nAnswer.", "", ANSWER),  # adaptive: it chose not to
        ("MiniMax-M3", "high", "Hm.</mm:think>Answer.", "Hm.", ANSWER),
        ("Kimi-K3", "none", "Answer.<|close|>response<|sep|><|close|>message<|sep|>", "", ANSWER),
        ("upstage-Solar-Open-100B", "low", "<|content|>Answer.", "", ANSWER),
        ("Cohere2MoE", "none", "<|START_TEXT|>Answer.<|END_TEXT|>", "", ANSWER),
    ],
)
def test_answers_outside_a_thinking_block_are_content(name, effort, output, thought, answer):
    source = templates.source(name)
    kwargs = reasoning.controls(source).kwargs(effort)
    prompt = templates.render(source, [{"role": "user", "content": "Hi"}], True, TOOLS, **kwargs)
    for chunk in (None, 1):
        got, content, calls = parse(name, prompt, output, chunk)
        assert (got.strip(), content.strip(), calls) == (thought, answer, [])


@pytest.mark.parametrize(
    ("name", "tags"),
    [
        ("Kimi-K3", ("<|open|>think<|sep|>", "<|close|>think<|sep|>")),
        (
            "Apriel-1.6-15b-Thinker-fixed",
            ("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"),
        ),
        ("unsloth-Apriel-1.5", ("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]")),
        ("tencent-Hy3", ("<think:opensource>", "</think:opensource>")),
        ("upstage-Solar-Open-100B", ("<|think|>", "<|end|>")),
        ("Apertus-8B-Instruct", ("<|inner_prefix|>", "<|inner_suffix|>")),
        ("MiniMax-M3", ("<mm:think>", "</mm:think>")),
    ],
)
def test_tags_built_from_pieces_are_found(name, tags):
    """Kimi K3 writes ``'<|open|>' + tag``, Hy3 ``'<think{}>'.format(':opensource')``."""
    assert traits_of(templates.source(name), set()).reasoning == tags


def test_answer_markup_is_dropped_across_chunks_with_the_space_after_it():
    markup = AnswerMarkup(("<|open|>response<|sep|>", "[END]"))
    text = "<|open|>response<|sep|>\n  Answer <b>.[END]\n"
    for size in (1, 2, 5):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert "".join(markup.feed(p) for p in pieces) + markup.flush() == "Answer <b>."
    assert markup.feed("<|open|>resp") == "" and markup.flush() == "<|open|>resp"  # cut off


@pytest.mark.parametrize(
    ("name", "effort", "expected"),
    [
        ("MiniMax-M3", "none", {"thinking_mode": "disabled"}),
        ("MiniMax-M3", "low", {"thinking_mode": "adaptive"}),
        ("MiniMax-M3", "high", {"thinking_mode": "enabled"}),
        ("Kimi-K3", "none", {"thinking": False}),
        ("Kimi-K3", "medium", {"thinking": True, "thinking_effort": "high"}),
        ("Kimi-K3", "max", {"thinking": True, "thinking_effort": "max"}),
    ],
)
def test_family_modes_take_the_effort(name, effort, expected):
    source = templates.source(name)
    assert reasoning.controls(source).kwargs(effort) == expected
    templates.render(source, [{"role": "user", "content": "Hi"}], True, TOOLS, **expected)
