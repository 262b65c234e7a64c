"""Every family's real chat template against mlxd's format detection and parsers.

Each template in ``.cache/templates`` (llama.cpp's vendored copies of real
models' templates) renders an assistant turn with tool calls in the markup its
model was trained to write; the format mlxd detects from that template must
read the calls back exactly, whole and streamed a character at a time.
"""

from __future__ import annotations

import json

import pytest
from mlxd.actors.families import formats, reasoning
from mlxd.actors.families.output import OutputParser
from mlxd.actors.tools import traits_of
from mlxd.protocol.messages import OutputSpec, Tool

from tests import templates

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "options": {"type": "object"},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS},
    }
]
TOOL = (Tool(name="get_weather", description="Weather", parameters=PARAMS),)

# The twelve, and the format each must be read as.
MAIN = {
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "GLM-4.6": "glm47",
    "GLM-4.7-Flash": "glm47",
    "MiniMax-M2": "minimax_m2",
    "openai-gpt-oss-120b": "harmony",
    "google-gemma-4-31B-it": "gemma4",
    "Kimi-K2-Instruct": "kimi_k2",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3",
    "Qwen-Qwen3-0.6B": "hermes",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
}

# Templates whose history cannot serve as an oracle here, and why (each is checked to
# still be so, so the list cannot go stale).
NO_ORACLE = {
    # gpt-oss renders past calls in another shape than it writes them (tests/test_family_parsers)
    "openai-gpt-oss-120b": "history differs from output",
    "fireworks-ai-llama-3-firefunction-v2": "reads a 'functions' variable",
    "llama-cpp-deepseek-r1": "llama.cpp's own test template",
    # their history drops the calls: nothing to compare against
    "HuggingFaceTB-SmolLM3-3B": "no markup",
    "LFM2-8B-A1B": "no markup",
    "LFM2.5-Instruct": "no markup",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "no markup",
    "google-gemma-2-2b-it": "no markup",
    "ibm-granite-granite-3.3-2B-Instruct": "no markup",
    "llama-cpp-rwkv-world": "no markup",
    "microsoft-Phi-3.5-mini-instruct": "no markup",
}
SINGLE_CALL = {"GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B"}  # they render one call a turn
MULTI_TURN_CALLS = {  # templates that refuse two calls in one turn
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
}

CASES = {
    "simple": [{"city": "Paris"}],
    "rich": [
        {
            "city": 'São Paulo "centre" — 東京',
            "days": 3,
            "options": {"units": ["c", "f"], "deep": {"a": 1.5, "q": 'it\'s "x"'}},
        }
    ],
    "newline": [{"city": "line 1\nline 2"}],
    "two": [{"city": "Paris"}, {"city": "Tokyo", "days": 2}],
}
# Values a template renders in a shape its model does not write: skip those cases there.
SKIP_CASES = {
    ("LFM2.5-8B-A1B", "newline"),  # a raw newline inside a Python string literal
}


# Templates that concatenate a call's arguments as a string (Functionary v3.2): given JSON text.
STRING_ARGUMENTS = {"meetkai-functionary-medium-v3.2"}
# Templates that need each parameter described and each object's additionalProperties
# (Command R+ writes the tools as Python signatures with docstrings).
DESCRIBED = {"CohereForAI-c4ai-command-r-plus-tool_use"}
# Templates that render an instruction turn after the history (Command R+): where the
# model's turn starts and ends in the rendered turn.
TURN_BOUNDS = {
    "CohereForAI-c4ai-command-r-plus-tool_use": ("<|CHATBOT_TOKEN|>", "<|START_OF_TURN_TOKEN|>")
}


def _assistant(args: list[dict], as_text: bool = False) -> dict:
    calls = [
        {
            "id": f"c{i}x4Yz9Q7",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(a) if as_text else a},
        }
        for i, a in enumerate(args)
    ]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def _described(tools: list[dict]) -> list[dict]:
    out = json.loads(json.dumps(tools))
    for tool in out:
        for param in tool["function"]["parameters"]["properties"].values():
            param["description"] = "A parameter."
            if param["type"] == "object":
                param["additionalProperties"] = {}
    return out


def _written(name: str, user: str, args: list[dict]) -> tuple[str, str]:
    """``templates.written`` for a call turn, with the tools and turn bounds ``name`` needs."""
    tools = _described(TOOLS) if name in DESCRIBED else TOOLS
    assistant = _assistant(args, as_text=name in STRING_ARGUMENTS)
    prompt, text = templates.written(templates.source(name), user, assistant, tools)
    if name in TURN_BOUNDS:
        start, end = TURN_BOUNDS[name]
        text = text.split(start, 1)[-1].split(end, 1)[0]
    return prompt, text


def _parse(text: str, prompt: str, name: str, chunk: int | None = None):
    outs = templates.feed(name, prompt, text, TOOL, chunk)
    calls: dict[int, list[str]] = {}
    for out in outs:
        for piece in out.calls:
            if piece.id is not None:
                calls[piece.index] = [piece.name, piece.arguments]
            else:
                calls[piece.index][1] += piece.arguments
    content = "".join(o.content for o in outs)
    return [(n, json.loads(a)) for n, a in calls.values()], content


def test_the_main_families_are_detected_from_their_templates():
    templates.template_dir()
    for name, fmt in MAIN.items():
        found = formats.detect(templates.source(name))
        assert found.format.name == fmt, (name, found.why)
        assert found.why.startswith("template: ")


def test_vocabulary_alone_picks_a_format_and_says_so():
    found = formats.detect("{{ messages }}", {"<|tool_call_start|>", "<|tool_call_end|>"})
    assert found.format.name == "pythonic"
    assert found.why.startswith("vocabulary: ")
    assert formats.detect("{{ messages }}{{ tools }}").format.name == "json"


@pytest.mark.parametrize("name", [n for n in templates.names() if n not in NO_ORACLE])
@pytest.mark.parametrize("case", list(CASES))
def test_each_template_reads_back_the_calls_it_renders(name, case):
    if (name, case) in SKIP_CASES or (case == "two" and name in SINGLE_CALL | MULTI_TURN_CALLS):
        pytest.skip("the template renders this case in another shape")
    args = CASES[case]
    prompt, text = _written(name, "Weather?", args)
    assert "get_weather" in text, text
    want = [("get_weather", a) for a in args]
    for chunk in (None, 1, 7):
        calls, content = _parse(text, prompt, name, chunk)
        assert calls == want, (name, chunk, text)
        assert "get_weather" not in content, (name, chunk, content)


@pytest.mark.parametrize("name", sorted(NO_ORACLE))
def test_templates_without_an_oracle_are_still_without_one(name):
    templates.template_dir()
    try:
        _, text = templates.written(
            templates.source(name), "Hi", _assistant(CASES["simple"]), TOOLS
        )
    except Exception:  # noqa: BLE001 - a template that raises has no oracle either
        return
    if NO_ORACLE[name] == "no markup":
        assert '"Paris"' not in text and "Paris<" not in text
    elif name != "openai-gpt-oss-120b":
        calls, _ = _parse(text, "", name)
        assert calls != [("get_weather", {"city": "Paris"})], f"{name} now parses: list it"


def test_content_before_a_call_streams_and_stays_content():
    name = "Qwen3-Coder"
    prompt, text = templates.written(
        templates.source(name), "Hi", _assistant(CASES["simple"]), TOOLS
    )
    calls, content = _parse("Let me check.\n" + text, prompt, name, 3)
    assert calls == [("get_weather", {"city": "Paris"})]
    assert content.strip() == "Let me check."


def test_broken_markup_is_content_not_a_call():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"  # cut off
    calls, content = _parse(text, "", "Qwen3-Coder", 2)
    assert calls == [] and "Paris" in content


@pytest.mark.parametrize(
    ("name", "effort", "expected"),
    [
        ("Qwen-Qwen3-0.6B", "none", {"enable_thinking": False}),
        ("Qwen-Qwen3-0.6B", "high", {"enable_thinking": True}),
        ("openai-gpt-oss-120b", "low", {"reasoning_effort": "low"}),
        ("openai-gpt-oss-120b", "high", {"reasoning_effort": "high"}),
        ("deepseek-ai-DeepSeek-V3.1", "none", {"enable_thinking": False, "thinking": False}),
        ("deepseek-ai-DeepSeek-V3.1", "medium", {"enable_thinking": True, "thinking": True}),
        ("google-gemma-4-31B-it", "high", {"enable_thinking": True}),
        ("tencent-Hy3", "none", {"reasoning_effort": "no_think"}),
        ("openai-gpt-oss-120b", "minimal", {"reasoning_effort": "low"}),
        ("Qwen3-Coder", "high", {}),  # no switch: it answers as it always does
    ],
)
def test_reasoning_efforts_map_to_each_familys_template_variables(name, effort, expected):
    assert reasoning.controls(templates.source(name)).kwargs(effort) == expected


@pytest.mark.parametrize(
    ("name", "effort"),
    [
        ("openai-gpt-oss-120b", "none"),  # gpt-oss always reasons
        ("openai-gpt-oss-120b", "xhigh"),
        ("tencent-Hy3", "medium"),
    ],
)
def test_an_effort_a_family_cannot_take_is_refused(name, effort):
    with pytest.raises(reasoning.EffortError):
        reasoning.controls(templates.source(name)).kwargs(effort)


@pytest.mark.parametrize(
    ("name", "tags"),
    [
        ("Qwen-Qwen3-0.6B", ("<think>", "</think>")),
        ("google-gemma-4-31B-it", ("<|channel>thought", "<channel|>")),
        ("mistralai-Ministral-3-14B-Reasoning-2512", ("[THINK]", "[/THINK]")),
        ("ByteDance-Seed-OSS", ("<seed:think>", "</seed:think>")),
    ],
)
def test_reasoning_tags_come_from_the_template(name, tags):
    assert traits_of(templates.source(name), set()).reasoning == tags


def test_reasoning_then_a_call_in_one_output():
    name = "GLM-4.7-Flash"
    source = templates.source(name)
    prompt = templates.render(source, [{"role": "user", "content": "Hi"}], True, TOOLS)
    _, call = templates.written(source, "Hi", _assistant(CASES["simple"]), TOOLS)
    text = "I should look it up.</think>" + call.split("</think>", 1)[-1]
    traits = traits_of(source, set())
    assert prompt.rstrip().endswith("<think>")
    spec = OutputSpec(
        tool_format=traits.tool_format, reasoning=traits.reasoning, in_reasoning=True, tools=TOOL
    )
    parser = OutputParser(spec)
    out = parser.feed(text)
    out.extend(parser.flush())
    assert out.reasoning == "I should look it up."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def _builder(smollm_tokenizer, template: str):
    """SmolLM2's tokenizer wearing another family's chat template."""
    from mlxd.actors.tokenizer import PromptBuilder
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_tokenizer))
    tokenizer.chat_template = template
    return PromptBuilder(tokenizer, 8192, default_max_tokens=16, vocab_size=len(tokenizer))


def _chat(**fields):
    from mlxd.protocol.messages import ChatRequest, Message, SamplingParams

    fields.setdefault("messages", (Message(role="user", content="Weather in Paris?"),))
    return ChatRequest(request_id="r", sampling=SamplingParams(max_tokens=8), **fields)


def test_the_effort_reaches_gpt_oss_template_and_none_is_a_400(smollm_tokenizer):
    from mlxd.actors.tokenizer import PromptError

    builder = _builder(smollm_tokenizer, templates.source("openai-gpt-oss-120b"))
    text, _, _ = builder.render_chat(_chat(reasoning_effort="high"), marks=False)
    assert "Reasoning: high" in text
    with pytest.raises(PromptError, match="low, medium, high") as err:
        builder.render_chat(_chat(reasoning_effort="none"), marks=False)
    assert err.value.param == "reasoning_effort"
    spec = builder.output_spec(_chat(), text)
    assert spec.tool_format == "harmony" and spec.reasoning is None  # channels need no tools


def test_the_effort_switches_deepseek_thinking(smollm_tokenizer):
    builder = _builder(smollm_tokenizer, templates.source("deepseek-ai-DeepSeek-V3.1"))
    on, _, _ = builder.render_chat(_chat(reasoning_effort="high"), marks=False)
    off, _, _ = builder.render_chat(_chat(reasoning_effort="none"), marks=False)
    assert on.endswith("<think>") and off.endswith("</think>")


def test_offered_tools_reach_the_output_spec_for_typed_parameters(smollm_tokenizer):
    builder = _builder(smollm_tokenizer, templates.source("Qwen3-Coder"))
    spec = builder.output_spec(_chat(tools=TOOL), "")
    assert spec.tool_format == "qwen3_coder" and spec.tools == TOOL


def test_mlxd_parse_prints_format_why_content_and_calls(tmp_path, smollm_tokenizer):
    import shutil
    import subprocess
    import sys

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    output = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    model = tmp_path / "model"
    shutil.copytree(smollm_tokenizer, model)
    (model / "chat_template.jinja").write_text(templates.source("Qwen3-Coder"))
    for where in (["--template", str(templates.TEMPLATES / "Qwen3-Coder.jinja")], [str(model)]):
        done = subprocess.run(
            [sys.executable, "-m", "mlxd.daemon.cli", "parse", *where, "--tools", str(tools)],
            input=output,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        report = json.loads(done.stdout)
        assert report["format"] == "qwen3_coder" and "<function=" in report["why"]
        assert report["content"] == "Checking.\n"
        assert report["tool_calls"] == [
            {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
        ]


def test_gpt_oss_gets_its_reasoning_back_between_calls(smollm_tokenizer):
    """An assistant turn's reasoning and call, then the tool result: gpt-oss's template
    renders the analysis message before the call, in the form it was trained on."""
    from mlxd.protocol.messages import Message, ToolCall

    builder = _builder(smollm_tokenizer, templates.source("openai-gpt-oss-120b"))
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    history = (
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content="", tool_calls=(call,), reasoning="Need the tool."),
        Message(role="tool", tool_call_id="call_1", content="sunny"),
    )
    text, _, _ = builder.render_chat(_chat(messages=history, tools=TOOL), marks=False)
    assert "<|channel|>analysis<|message|>Need the tool.<|end|>" in text
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}' in text
    assert "<|start|>functions.get_weather to=assistant" in text


def test_mistral_history_gets_the_nine_character_ids_its_template_demands(smollm_tokenizer):
    from mlxd.protocol.messages import Message, ToolCall

    builder = _builder(smollm_tokenizer, templates.source("mistralai-Mistral-Nemo-Instruct-2407"))
    call = ToolCall(id="call_0123456789abcdef", name="get_weather", arguments='{"city": "Paris"}')
    history = (
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content="", tool_calls=(call,)),
        Message(role="tool", tool_call_id="call_0123456789abcdef", content="sunny"),
    )
    text, _, _ = builder.render_chat(_chat(messages=history, tools=TOOL), marks=False)
    nine = formats.mistral_id("call_0123456789abcdef")
    assert len(nine) == 9 and nine.isalnum()
    assert text.count(nine) == 2  # the call and its result


@pytest.mark.parametrize("kind", ["tool_call", "json_schema"])
def test_constrained_answers_close_a_think_block_the_prompt_opened(smollm_tokenizer, kind):
    """MiniMax-M2's generation prompt ends inside ``<think>``: a forced call or a JSON answer
    written there would be read as reasoning, so the grammar closes the block first."""
    from mlxd.actors.grammar import GrammarCompiler
    from mlxd.protocol.messages import Constraint

    builder = _builder(smollm_tokenizer, templates.source("MiniMax-M2"))
    builder.grammars = GrammarCompiler(builder.tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constraint = (
        Constraint(kind="tool_call", tool_names=("get_weather",), param="tool_choice")
        if kind == "tool_call"
        else Constraint(kind="json_schema", schema=schema)
    )
    request = _chat(tools=TOOL, tool_choice="required", constraint=constraint)
    text, _, _ = builder.render_chat(request, marks=False)
    spec = builder.output_spec(request, text)
    assert spec.in_reasoning
    answer = (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        "</parameter>\n</invoke>\n</minimax:tool_call>"
        if kind == "tool_call"
        else '{"a": 1}'
    )

    def accepts(output: str) -> bool:
        matcher = builder.grammar(request, spec).matcher
        tokens = builder.tokenizer.encode(output, add_special_tokens=False)
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert accepts("</think>\n" + answer)
    assert not accepts(answer)
    parser = OutputParser(spec)
    out = parser.feed("</think>\n" + answer)
    out.extend(parser.flush())
    if kind == "tool_call":
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    else:
        assert json.loads(out.content) == {"a": 1} and out.reasoning == ""


def test_kimi_k2_templates_that_append_to_a_list_still_render(smollm_tokenizer):
    """Kimi K2's current templates queue call ids with ``list.append``, which transformers'
    immutable sandbox refuses: mlxd renders them in the mutable sandbox instead."""
    from mlxd.protocol.messages import Message, ToolCall

    builder = _builder(smollm_tokenizer, templates.source("Kimi-K2-Instruct"))
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    history = (
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content="", tool_calls=(call,)),
        Message(role="tool", tool_call_id="call_1", content="sunny"),
    )
    text, _, _ = builder.render_chat(_chat(messages=history, tools=TOOL), marks=False)
    assert (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>' in text
    )
    assert "## Return of functions.get_weather:0\nsunny" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    # the same template through transformers alone is refused: the fallback is what renders it
    with pytest.raises(Exception, match="unsafe"):
        builder.tokenizer.apply_chat_template(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                }
            ],
            tokenize=False,
        )


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("MiniMax-M3", "minimax_m3"),  # its template also writes <tool_call>: not Hermes
        ("CohereForAI-c4ai-command-r-plus-tool_use", "command_r_plus"),
        ("meetkai-functionary-medium-v3.2", "functionary_v3_2"),
        ("muse-glimmer", "muse_spark"),
    ],
)
def test_the_newer_families_are_detected_from_their_templates(name, fmt):
    assert formats.detect(templates.source(name)).format.name == fmt


def _read(fmt: str, text: str, tools: tuple[Tool, ...] = TOOL, chunk: int = 1):
    parser = formats.make_tool_parser(fmt, lambda: "id", tools)
    outs = [parser.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)]
    outs.append(parser.flush())
    calls = [(p.name, json.loads(p.arguments)) for o in outs for p in o.calls if p.name]
    return calls, "".join(o.content for o in outs), "".join(o.reasoning for o in outs)


M3 = "]<]minimax[>["


def _m3(args: str, name: str = "get_weather") -> str:
    return f'{M3}<tool_call>\n{M3}<invoke name="{name}">{args}{M3}</invoke>\n{M3}</tool_call>'


def _el(key: str, inner: str) -> str:
    return f"{M3}<{key}>{inner}{M3}</{key}>"


def test_minimax_m3_reads_nested_arguments_by_the_schema():
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "hot": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object"},
        },
    }
    tool = (Tool(name="get_weather", parameters=params),)
    args = (
        _el("city", "3 <b>&</b>")  # a string stays as written: digits, < and & too
        + _el("days", "3")
        + _el("hot", "false")
        + _el("tags", _el("item", "1") + _el("item", "b"))
        + _el("opts", _el("deep", _el("item", _el("a", "1.5") + _el("q", "x"))) + _el("n", ""))
    )
    calls, content, _ = _read("minimax_m3", "Checking." + _m3(args), tool)
    assert content == "Checking."
    assert calls == [
        (
            "get_weather",
            {
                "city": "3 <b>&</b>",
                "days": 3,
                "hot": False,
                "tags": ["1", "b"],
                "opts": {"deep": [{"a": 1.5, "q": "x"}], "n": ""},
            },
        )
    ]


def test_minimax_m3_markup_that_does_not_nest_is_content():
    for broken in (
        _m3(f"{M3}<city>Paris{M3}</town>"),  # closes another element
        _m3(f"{M3}<city>Paris"),  # never closed
        _m3(f"{M3}<city>Paris{M3}</city>stray"),  # text between elements
        _m3("", name=""),
    ):
        calls, content, _ = _read("minimax_m3", broken)
        assert calls == [] and content == broken


def test_functionary_v3_2_streams_content_then_reads_each_call():
    text = 'all\nLet me check.>>>get_weather\n{"city": "Paris"}>>>get_weather\n{"city": "Tokyo"}'
    for chunk in (1, 4, len(text)):
        calls, content, _ = _read("functionary_v3_2", text, chunk=chunk)
        assert content == "Let me check."
        assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]


def test_functionary_v3_2_gives_back_what_is_not_a_call():
    assert _read("functionary_v3_2", "get_weather\nnot json") == ([], "get_weather\nnot json", "")
    assert _read("functionary_v3_2", "Hello there, >>>") == ([], "Hello there, >>>", "")
    assert _read("functionary_v3_2", ">>>all\n1 >> 2") == ([], "1 >> 2", "")


def test_command_r_plus_reads_the_fenced_action_and_leaves_prose_alone():
    action = 'Action: ```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```'
    assert _read("command_r_plus", "Plan.\n" + action) == (
        [("get_weather", {"city": "Paris"})],
        "Plan.\n",
        "",
    )
    prose = "Action: none needed, it is sunny."
    assert _read("command_r_plus", prose) == ([], prose, "")


def test_muse_messages_split_into_reasoning_content_and_calls():
    call = (
        '<atem:function_calls>\n<atem:invoke name="get_weather">\n'
        '<atem:parameter name="city">Paris</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
    )
    text = (
        " to=self<|message|>Need the weather.<|eom|><|start|>assistant to=user<|message|>Checking."
        f"<|eom|><|start|>assistant to=get_weather<|message|>{call}<|eom|>"
    )
    for chunk in (1, 9):
        assert _read("muse_spark", text, chunk=chunk) == (
            [("get_weather", {"city": "Paris"})],
            "Checking.",
            "Need the weather.",
        )
    broken = " to=get_weather<|message|>{not atem}<|eot|>"
    assert _read("muse_spark", broken)[:2] == ([], broken.lstrip())
