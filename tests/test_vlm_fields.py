"""Vision models honour every request field a text model honours.

Tools and ``chat_template_kwargs`` (with ``enable_thinking``, which Anthropic
``thinking`` and Responses ``reasoning.effort`` map to) reach the processor's
chat template; the output spec (tool-call and reasoning parsing) applies; JSON
schemas and forced tool calls compile against the processor's tokenizer and the
vision runner's decode applies them; Anthropic ``image`` blocks become the same
image parts as OpenAI ``image_url``. On the tiny random-weight ``qwen2_vl`` model
(``scripts/tiny_models.py``): only a grammar makes its output well formed.
"""

from __future__ import annotations

import copy
import json
import shutil

import httpx
import pytest
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.tokenizer import PromptBuilder
from mlxd.actors.tools import template_traits
from mlxd.actors.vision import ImageLimits
from mlxd.daemon.supervisor import mlx_runner_factory
from mlxd.protocol.messages import (
    ChatRequest,
    Constraint,
    ImagePart,
    Message,
    SamplingParams,
    TextPart,
    Tool,
)
from mlxd.scripts.tiny_models import QWEN_VL_TEMPLATE, data_url, png

from tests.conftest import real_server, settings_with
from tests.engine_driver import alone, load
from tests.test_http import client

mlx = pytest.mark.mlx

LIMITS = ImageLimits(4, 1 << 20, 1 << 20, False, 1.0)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = (Tool(name="get_weather", description="The weather", parameters=CITY),)
# No free whitespace: a random-weight model would otherwise emit whitespace until max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}

# The tiny model's template plus what real VLM templates (Qwen2.5-VL, Qwen3-VL) do:
# render ``tools``, open a ``<think>`` block on ``enable_thinking``, read a custom variable.
RICH_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %} (answer with <tool_call></tool_call>)<|im_end|>\n{% endif %}"
    "{% if house_style is defined %}STYLE={{ house_style }}\n{% endif %}"
    + QWEN_VL_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}",
    )
)


@pytest.fixture(scope="module")
def vlm(tiny_models):
    runner, info = load(tiny_models("qwen2_vl"))
    return runner, info, GrammarCompiler(info.tokenizer)


def builder(vlm, template: str | None = None) -> PromptBuilder:
    _, info, grammars = vlm
    processor = info.processor
    if template is not None:
        processor = copy.copy(processor)
        processor.chat_template = template
    return PromptBuilder(
        info.tokenizer,
        info.context_length,
        default_max_tokens=8,
        vocab_size=info.vocab_size,
        processor=processor,
        image_limits=LIMITS,
        traits=template_traits(processor, "auto", "auto"),
        grammars=grammars,
    )


def chat(rid="r", text="What is this?", picture=None, max_tokens=8, **fields) -> ChatRequest:
    content: str | tuple[ImagePart, TextPart] = text
    if picture is not None:
        content = (ImagePart(url=picture), TextPart(text=text))
    fields.setdefault("messages", (Message(role="user", content=content),))
    return ChatRequest(
        request_id=rid,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        **fields,
    )


def prompt_text(vlm, b: PromptBuilder, request: ChatRequest) -> str:
    return vlm[1].tokenizer.decode(list(b.build(request).prompt_tokens))


def generated(vlm, request) -> str:
    runner, info, _ = vlm
    return info.tokenizer.decode(alone(runner, [request])[request.request_id])


# ---- the prompt and the output spec --------------------------------------------------------


@mlx
def test_tools_reach_a_template_without_tool_support_as_a_system_prompt(vlm):
    b = builder(vlm)
    assert not b.traits.tools_in_template
    with_tools = b.build(chat(tools=TOOLS))
    text = vlm[1].tokenizer.decode(list(with_tools.prompt_tokens))
    assert "<tools>" in text and '"get_weather"' in text
    assert "get_weather" not in prompt_text(vlm, b, chat())
    assert "get_weather" not in prompt_text(vlm, b, chat(tools=TOOLS, tool_choice="none"))
    assert with_tools.output.tool_format == "hermes"  # the streamer parses its calls


@mlx
def test_tools_reach_a_template_that_renders_them(vlm):
    b = builder(vlm, RICH_TEMPLATE)
    assert b.traits.tools_in_template
    text = prompt_text(vlm, b, chat(picture=data_url(png(30, 20)), tools=TOOLS))
    assert "TOOLS: get_weather" in text and "<tools>" not in text
    assert "<|image_pad|>" in text


@mlx
def test_chat_template_kwargs_reach_the_template(vlm):
    b = builder(vlm, RICH_TEMPLATE)
    assert "STYLE=terse" in prompt_text(vlm, b, chat(template_kwargs={"house_style": "terse"}))
    assert "STYLE" not in prompt_text(vlm, b, chat())


@mlx
def test_enable_thinking_opens_the_reasoning_block_and_its_parsing(vlm):
    b = builder(vlm, RICH_TEMPLATE)
    thinking = b.build(chat(template_kwargs={"enable_thinking": True}))
    plain = b.build(chat(template_kwargs={"enable_thinking": False}))
    assert thinking.output.reasoning == ("<think>", "</think>")
    assert thinking.output.in_reasoning  # the streamer reads what follows as reasoning
    assert not plain.output.in_reasoning
    assert len(thinking.prompt_tokens) > len(plain.prompt_tokens)


@mlx
def test_anthropic_tool_result_image_reaches_a_vision_prompt(vlm):
    """An image inside a ``tool_result`` (a screenshot tool, say) is an image, not text."""
    from mlxd.daemon.api.anthropic import messages_of
    from mlxd.protocol.anthropic import count_decoder

    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}
    image = anthropic_image(png(30, 20, seed=3))
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [TEXT_SUNNY, image]}
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    wire = count_decoder.decode(json.dumps({"messages": turns}))
    request = builder(vlm).build(chat(tools=TOOLS, max_tokens=4, messages=messages_of(wire)))
    text = vlm[1].tokenizer.decode(list(request.prompt_tokens))
    assert request.vision is not None and request.vision.images == 1
    assert "<tool_response>\nsunny<|vision_start|><|image_pad|>" in text
    assert "base64" not in text


TEXT_SUNNY = {"type": "text", "text": "sunny"}


def anthropic_image(data: bytes) -> dict:
    encoded = data_url(data).partition(",")[2]
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": encoded},
    }


# ---- grammars on the processor's tokenizer, applied by the vision runner ------------------


@mlx
@pytest.mark.parametrize("with_image", [True, False])
def test_json_schema_output_on_a_vision_model(vlm, with_image):
    picture = data_url(png(40, 30, seed=4)) if with_image else None
    constraint = Constraint(kind="json_schema", schema=SCHEMA)
    request = builder(vlm).build(chat(picture=picture, max_tokens=30, constraint=constraint))
    assert request.grammar is not None
    assert (request.vision is not None) == with_image
    value = json.loads(generated(vlm, request))
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green")
    unconstrained = builder(vlm).build(chat(picture=picture, max_tokens=30))
    with pytest.raises(json.JSONDecodeError):  # test of the test: random weights alone are not JSON
        json.loads(generated(vlm, unconstrained))


@mlx
def test_forced_tool_call_on_a_vision_model(vlm):
    forced = Constraint(kind="tool_call", tool_names=("get_weather",), param="tool_choice")
    request = builder(vlm).build(
        chat(picture=data_url(png(30, 30, seed=2)), max_tokens=40, tools=TOOLS, constraint=forced)
    )
    text = generated(vlm, request)
    # the newlines around the object are optional in Hermes' grammar (forced.py)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Paris", "Rome")


# ---- the whole daemon over HTTP --------------------------------------------------------------


@pytest.fixture(scope="module")
def rich_vlm(tiny_models, tmp_path_factory):
    """The tiny qwen2_vl checkpoint with ``RICH_TEMPLATE`` as its chat template."""
    source = tiny_models("qwen2_vl")
    out = tmp_path_factory.mktemp("rich-vlm")
    for path in source.iterdir():
        if path.name == "model.safetensors":
            (out / path.name).symlink_to(path)
        else:
            shutil.copy(path, out / path.name)
    (out / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return out


ANTHROPIC = {"x-api-key": "k", "anthropic-version": "2023-06-01"}


def _body(content, **extra):
    """One user turn, for Anthropic Messages and OpenAI chat alike."""
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}


async def _post(http, path, body, status=200):
    r = await http.post(path, json=body, headers=ANTHROPIC)
    assert r.status_code == status, r.text
    return r.json()


@mlx
async def test_http_every_field_on_a_vision_model(rich_vlm):
    png_bytes = png(50, 40, seed=9)
    settings = settings_with(model={"path": str(rich_vlm)}, server={"max_body_bytes": 4_000_000})
    async with real_server(settings, mlx_runner_factory(settings)) as (url, _, runner):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            # Anthropic image block == OpenAI image_url (greedy, same prompt)
            block = anthropic_image(png_bytes)
            text = {"type": "text", "text": "What is this?"}
            text_turn = {"role": "user", "content": "Hi"}
            a = await _post(http, "/v1/messages", _body([block, text], temperature=0))
            image_url = {"type": "image_url", "image_url": {"url": data_url(png_bytes)}}
            o = await _post(http, "/v1/chat/completions", _body([image_url, text], temperature=0))
            prompt = a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"]
            assert prompt == o["usage"]["prompt_tokens"]
            assert a["content"] == [
                {"type": "text", "text": o["choices"][0]["message"]["content"], "citations": None}
            ]
            no_image = await _post(http, "/v1/chat/completions", _body("What is this?"))
            assert no_image["usage"]["prompt_tokens"] < o["usage"]["prompt_tokens"]
            # a url source goes where an image_url URL goes: remote URLs are off here
            remote = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
            err = await _post(http, "/v1/messages", _body([remote, text]), 400)
            assert "allow_remote_urls" in err["error"]["message"]
            # Anthropic thinking → enable_thinking: the template opens <think> (counted, as
            # generating past the 1024-token minimum budget would be slow)
            count = "/v1/messages/count_tokens"
            on = await _post(http, count, {"messages": [text_turn], "thinking": _THINKING})
            off = await _post(http, count, {"messages": [text_turn]})
            assert on["input_tokens"] > off["input_tokens"]
            # Responses reasoning.effort → enable_thinking → a reasoning item
            high = await _post(http, "/v1/responses", _responses("Hi", "high"))
            low = await _post(http, "/v1/responses", _responses("Hi", "minimal"))
            # (6 tokens: the reasoning may use them all; then there is no message item)
            assert [i["type"] for i in high["output"]][0] == "reasoning"
            assert [i["type"] for i in low["output"]] == ["message"]
            # response_format json_schema: output that parses against the schema
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
            body = _body("Give me JSON", response_format=fmt, max_tokens=30)
            got = await _post(http, "/v1/chat/completions", body)
            value = json.loads(got["choices"][0]["message"]["content"])
            assert set(value) == {"color", "n"}
            # a named tool_choice: a tool call, parsed by the streamer
            body = _body("Weather?", tools=_OPENAI_TOOLS, max_tokens=40)
            body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
            got = (await _post(http, "/v1/chat/completions", body))["choices"][0]
            assert got["finish_reason"] == "tool_calls"
            (call,) = got["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
            # apply_chat_template's own parameters are not template variables
            body = _body("Hi", chat_template_kwargs={"chat_template": "{{ 1 }}"})
            err = await _post(http, "/v1/chat/completions", body, 400)
            assert "chat_template" in err["error"]["message"]
    assert runner.cache_bytes == 0


_THINKING = {"type": "enabled", "budget_tokens": 1024}
_OPENAI_TOOLS = [
    {"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS
]


def _responses(text, effort):
    return {"input": text, "max_output_tokens": 6, "reasoning": {"effort": effort}}


@pytest.mark.parametrize("in_tool_result", [False, True])
async def test_anthropic_image_block_on_a_text_model_is_a_400(in_tool_result):
    content = [anthropic_image(png())]
    if in_tool_result:
        content = [{"type": "tool_result", "tool_use_id": "t1", "content": content}]
    async with client() as (c, _, _):
        r = await c.post("/v1/messages", json=_body(content), headers=ANTHROPIC)
        err = json.loads(await r.get_data())
    assert r.status_code == 400
    assert "not supported by this text model" in err["error"]["message"]


@mlx
def test_structured_output_with_vision_mtp_speculation_on(tiny_models):
    """The vision MTP runner decodes grammar requests in its plain lane: served, not a 400."""
    from types import SimpleNamespace

    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions
    from mlxd.actors.engine.speculative.vlm_mtp import VlmMtpRunner
    from mlxd.daemon.api.common import _check_speculation
    from mlxd.protocol.messages import EngineStats

    from tests.engine_driver import drive

    model_dir = tiny_models("qwen3_5_vl_mtp")
    runner, info = load_runner(
        str(model_dir),
        model_dir,
        dequantize_on_cpu=True,
        max_batch=4,
        speculative=SpeculativeOptions(),
    )
    assert isinstance(runner, VlmMtpRunner) and runner.spec_stats.enabled
    request = chat(max_tokens=30, constraint=Constraint(kind="json_schema", schema=SCHEMA))
    snapshot = EngineStats(counters=runner.counters())
    pipeline = SimpleNamespace(
        model_info=lambda model: info, model_stats={"m": snapshot}, speculative={"m": True}
    )
    _check_speculation(pipeline, [request], "m")  # no ApiError
    vlm = (runner, info, GrammarCompiler(info.tokenizer))
    tokens, failed = drive(runner, {0: [builder(vlm).build(request)]})
    assert not failed
    assert set(json.loads(info.tokenizer.decode(tokens["r"]))) == {"color", "n"}
    assert (runner.decoding, runner.cache_bytes) == (0, 0)


def test_tool_results_as_markup_keep_image_parts_and_join_text_parts():
    """For templates without tool support: text parts read as text (not a JSON dump of the
    parts), image parts stay parts for the vision path."""
    from mlxd.actors.tools import history_as_text

    picture, sunny = ImagePart(url="data:image/png;base64,AA=="), TextPart(text="sunny")
    texts, with_image = history_as_text(
        (
            Message(role="tool", content=(TextPart(text="4"), sunny)),
            Message(role="tool", content=(sunny, picture)),
        )
    )
    assert texts.content == "<tool_response>\n4\nsunny\n</tool_response>"
    assert with_image.role == "user"
    assert with_image.content[1:3] == (sunny, picture)
    assert with_image.content[0] == TextPart(text="<tool_response>\n")
