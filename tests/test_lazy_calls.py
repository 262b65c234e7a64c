"""Tool calls constrained once the model opens one (``tool_choice: auto``).

A scripted model (``tests/fakes.ScriptedModel``) means to write free text and then a
malformed call: a wrong parameter name, a string where the schema wants an integer, or
a call that never closes. Under the lazy grammar (``actors/lazy_calls.py``) the text
before the opener is left as written and the call comes back valid for its schema, in
every format that has an opener; without it the call is written as scripted. Then the
same through the whole daemon in every API, whole and streamed, with the setting off
and the request's ``constrain_tool_calls: false`` leaving the call alone (a tool's
``strict: false``, which Codex sends on every tool, changes nothing).
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import jsonschema
import pytest
from mlxd.actors.families import formats
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.lazy_calls import LazyCalls
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.protocol.messages import Tool

from tests import templates
from tests.conftest import running_graph, settings_with
from tests.fakes import GrammarRunner, ScriptedModel, grammar_factory
from tests.test_anthropic import events as anthropic_events
from tests.test_forced_calls import HIDDEN, SAMPLES, _hf_tokenizer
from tests.test_http import sse_events
from tests.test_openai_features import post_json, read_stream
from tests.test_openai_features import post_json as _post_json
from tests.test_openai_features import read_stream as _read_stream
from tests.test_responses import events as responses_events

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "nights": {"type": "integer"},
        "prefs": {"type": "object"},
    },
    "required": ["city", "nights", "prefs"],
}
BOOK = Tool(name="book", parameters=PARAMS)
PREFACE = "Sure, booking now. "
LINE = PREFACE.rstrip() + "\n"  # a text opener opens a call only at the start of a line


def _write(compiler: GrammarCompiler, hf, fmt: str, script: str, lazy: bool = True, **kw) -> str:
    """What the scripted model writes, with the lazy grammar of ``fmt`` or without."""
    grammar = compiler.compile_lazy((BOOK,), fmt, **kw) if lazy else None
    constraint = LazyCalls(grammar) if grammar is not None else None
    tokens = hf.encode(script, add_special_tokens=False) + [hf.eos_token_id]
    model = ScriptedModel(tokens, constraint, hf, len(hf))
    out: list[int] = []
    while len(out) < 600 and (not out or out[-1] != hf.eos_token_id):
        out.append(model.next())
    return hf.decode(out[:-1])


def _calls(fmt: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls) as the family's parser reads the text."""
    parser = formats.make_tool_parser(fmt, tools=(BOOK,))
    out = parser.feed(text.replace(HIDDEN.get(fmt, "\0"), ""))
    out.extend(parser.flush())
    calls: list[list[str]] = []
    for piece in out.calls:
        if piece.name is not None:
            calls.append([piece.name, ""])
        calls[-1][1] += piece.arguments
    return out.content, [(n, json.loads(a)) for n, a in calls]


def _malformed(fmt: str) -> str:
    """The family's sample call with a wrong key and a string for the integer."""
    sample = SAMPLES[fmt]
    bad = sample.replace("city", "cty").replace('"nights":3', '"nights":"3"')
    return (
        bad.replace(">3<", ">three<")
        .replace("\n3\n", "\nthree\n")
        .replace("nights=3", "nights='3'")
    )


HELD = sorted(f.name for f in formats.BY_NAME.values() if f.calls.held)
LAZY = [f for f in HELD if f in SAMPLES]  # the others' samples: tests/test_more_grammars.py


def test_every_format_with_a_grammar_has_an_opener_but_functionary_v3_2():
    built = {f.name for f in formats.BY_NAME.values() if f.calls.grammar is not None}
    assert built - set(HELD) == {"functionary_v3_2"}
    for fmt in LAZY:
        openers = formats.named(fmt).calls.openers
        assert any(SAMPLES[fmt].startswith(o) for o in openers), fmt


@pytest.mark.parametrize("fmt", LAZY)
def test_a_malformed_call_comes_back_valid_after_free_text(fmt):
    """Markers as the vocabulary's special tokens where the format shows them."""
    hf = _hf_tokenizer([m for m in formats.named(fmt).show if m in SAMPLES[fmt]])
    compiler = GrammarCompiler(hf)
    preface = "" if formats.named(fmt).calls.leading else PREFACE.rstrip() + "\n"
    script = preface + _malformed(fmt)
    free = _write(compiler, hf, fmt, script, lazy=False)
    assert free == script  # as scripted without the grammar
    text = _write(compiler, hf, fmt, script)
    assert text.startswith(preface) and text != script
    content, calls = _calls(fmt, text)
    assert content.strip() == preface.strip()
    assert [name for name, _ in calls] == ["book"]
    jsonschema.validate(calls[0][1], PARAMS)
    assert calls[0][1]["city"] == "Le Mans"


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "mistral", "kimi_k2", "deepseek_v3"])
def test_a_call_that_never_closes_is_closed(fmt):
    hf = _hf_tokenizer([m for m in formats.named(fmt).show if m in SAMPLES[fmt]])
    sample = SAMPLES[fmt]
    cut = sample[: sample.index("3") + 1]  # the model stops after the integer
    text = _write(GrammarCompiler(hf), hf, fmt, PREFACE + cut)
    content, calls = _calls(fmt, text)
    assert content.strip() == PREFACE.strip()
    jsonschema.validate(calls[0][1], PARAMS)


def test_the_opener_inside_the_reasoning_block_is_not_a_call():
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    compiler = GrammarCompiler(hf)
    think = '<think>Maybe <tool_call>\n{"name": "nope"} or not.</think>\n'
    script = think + PREFACE + _malformed("hermes")
    text = _write(compiler, hf, "hermes", script, reasoning=("<think>", "</think>"))
    assert text.startswith(think + PREFACE)
    _, calls = _calls("hermes", text.split("</think>", 1)[1])
    jsonschema.validate(calls[0][1], PARAMS)
    # a block the prompt opened: the answer starts inside it
    opened = script.removeprefix("<think>")
    text = _write(
        compiler, hf, "hermes", opened, reasoning=("<think>", "</think>"), in_reasoning=True
    )
    assert text.startswith(opened.split("</think>")[0] + "</think>\n" + PREFACE)
    assert _calls("hermes", text.split("</think>", 1)[1])[1][0][0] == "book"


def test_a_text_opener_split_over_tokens_and_ending_inside_one():
    """No special tokens: ``<tool_call>`` is text; it starts a line inside one token, and
    its last token goes on past it."""
    hf = _hf_tokenizer([])
    hf.add_tokens(["ing.\n<tool_", "call>\n{"])  # plain (non-special) merged pieces
    compiler = GrammarCompiler(hf)
    script = "Book" + "ing.\n<tool_call>\n{" + _malformed("hermes").split("{", 1)[1]
    tokens = hf.encode(script, add_special_tokens=False)
    assert hf.convert_tokens_to_ids("call>\n{") in tokens
    text = _write(compiler, hf, "hermes", script)
    content, calls = _calls("hermes", text)
    assert content.strip() == "Booking."
    jsonschema.validate(calls[0][1], PARAMS)


def test_after_a_call_another_may_follow_or_the_answer_ends():
    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    bad = _malformed("hermes")
    text = _write(GrammarCompiler(hf), hf, "hermes", PREFACE + bad + "\n" + bad)
    _, calls = _calls("hermes", text)
    assert len(calls) == 2
    for _, args in calls:
        jsonschema.validate(args, PARAMS)


def test_a_text_opener_cannot_complete_off_its_markup(caplog):
    """Gemma 3 echoes the tool prompt's ``<tool_call></tool_call>`` at the start of a line.
    Where ``<tool_call>`` is text and one token (``_call></``) would complete it and go on
    off the markup, that token is not allowed there (``OpenerGuard``): the model writes
    something else, no call is left free after its opener, and the real call is held."""
    import logging

    hf = _hf_tokenizer([])
    hf.add_tokens(["_call></"])
    echo = "<tool_call></tool_call> XML tags hold calls.\n"
    assert hf.convert_tokens_to_ids("_call></") in hf.encode(echo, add_special_tokens=False)
    with caplog.at_level(logging.INFO, logger="mlxd.grammar"):
        text = _write(GrammarCompiler(hf), hf, "hermes", echo + _malformed("hermes"))
    assert "went on off its markup" not in caplog.text
    assert "<tool_call></" not in text
    _, calls = _calls("hermes", text)
    assert [name for name, _ in calls] == ["book"]
    jsonschema.validate(calls[0][1], PARAMS)
    free = _write(GrammarCompiler(hf), hf, "hermes", echo + _malformed("hermes"), lazy=False)
    assert free.startswith(echo)  # as scripted without the grammar


def test_a_leading_format_takes_a_call_only_at_the_answers_start():
    hf = _hf_tokenizer([])
    compiler = GrammarCompiler(hf)
    prose = 'Here is JSON: {"name": "x"}'
    assert _write(compiler, hf, "json", prose) == prose
    text = _write(compiler, hf, "json", "  " + _malformed("json"))
    jsonschema.validate(_calls("json", text)[1][0][1], PARAMS)


def test_only_functionary_v3_2_stays_free():
    """31 of 32 formats hold a call in auto mode; Functionary v3.2 has no opener."""
    hf = _hf_tokenizer([])
    compiler = GrammarCompiler(hf)
    for fmt in formats.TOOL_FORMATS:
        held = compiler.compile_lazy((BOOK,), fmt) is not None
        assert held == (fmt != "functionary_v3_2"), fmt


# ---- through the whole daemon, every API -------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
SAID = "Let me check."
# Qwen3's template: Hermes markup, <tool_call> a special token of its vocabulary
BAD_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"cty": "Paris", "days": "3"}}\n</tool_call>'
)
WANT = {"city": "Paris", "days": 3}
AS_WRITTEN = {"cty": "Paris", "days": "3"}
QWEN3 = ("Qwen-Qwen3-0.6B", ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])


def family_tokenizer(template: str, specials: list[str]):
    hf = _hf_tokenizer(specials)
    hf.chat_template = templates.source(template)
    return hf


@asynccontextmanager
async def lazy_client(family=QWEN3, **tokenizer_settings):
    runner = GrammarRunner(tokenizer=family_tokenizer(*family))
    settings = settings_with(tokenizer=tokenizer_settings) if tokenizer_settings else None
    async with running_graph(settings or load_settings(), factory=grammar_factory(runner)) as (
        pipeline,
        _,
    ):
        yield create_app(pipeline, settings or load_settings()).test_client()


def _chat_tools(strict=None):
    function = {"name": "get_weather", "parameters": WEATHER}
    if strict is not None:
        function["strict"] = strict
    return [{"type": "function", "function": function}]


def _chat(script: str, strict=None) -> dict:
    return {
        "messages": [{"role": "user", "content": f"@@{script}@@"}],
        "tools": _chat_tools(strict),
        "max_tokens": 300,
    }


def _streamed_chat(frames: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    deltas = [json.loads(f)["choices"][0]["delta"] for f in frames if '"delta"' in f]
    pieces: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.get("tool_calls") or ():
            entry = pieces.setdefault(t["index"], ["", ""])
            entry[0] += t["function"].get("name") or ""
            entry[1] += t["function"].get("arguments") or ""
    content = "".join(d.get("content") or "" for d in deltas)
    return content, [(n, json.loads(a)) for n, a in pieces.values()]


async def _every_api(
    c, script: str, extra: dict | None = None
) -> dict[str, tuple[str, list[tuple[str, dict]]]]:
    """(content, calls) from each API, whole and streamed; ``extra`` joins every body."""
    out = {}
    extra = extra or {}

    async def post_json(c, path, body):
        return await _post_json(c, path, body | extra)

    async def read_stream(c, path, body):
        return await _read_stream(c, path, body | extra)

    whole = (await post_json(c, "/v1/chat/completions", _chat(script)))["choices"][0]["message"]
    out["chat"] = (
        whole["content"] or "",
        [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in whole["tool_calls"] or ()
        ],
    )
    out["chat stream"] = _streamed_chat(
        sse_events(await read_stream(c, "/v1/chat/completions", _chat(script)))
    )
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    body = {"input": f"@@{script}@@", "tools": [tool], "max_output_tokens": 300}
    r = await post_json(c, "/v1/responses", body)
    out["responses"] = _responses(r["output"])
    done = responses_events(await read_stream(c, "/v1/responses", body))[-1]
    out["responses stream"] = _responses(done["response"]["output"])
    body = {
        "model": "m",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": f"@@{script}@@"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
    }
    out["anthropic"] = _anthropic((await post_json(c, "/v1/messages", body))["content"])
    out["anthropic stream"] = _anthropic_stream(
        anthropic_events(await read_stream(c, "/v1/messages", body))
    )
    body = {
        "model": "m",
        "stream": False,
        "messages": [{"role": "user", "content": f"@@{script}@@"}],
        "tools": _chat_tools(),
    }
    message = (await post_json(c, "/api/chat", body))["message"]
    calls = [
        (t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls") or ()
    ]
    out["ollama"] = (message["content"], calls)
    lines = (await read_stream(c, "/api/chat", body)).decode().splitlines()
    messages = [json.loads(line)["message"] for line in lines if line.strip()]
    calls = [
        (t["function"]["name"], t["function"]["arguments"])
        for m in messages
        for t in m.get("tool_calls") or ()
    ]
    out["ollama stream"] = ("".join(m["content"] for m in messages), calls)
    return out


def _responses(items: list[dict]) -> tuple[str, list[tuple[str, dict]]]:
    text = "".join(
        p["text"] for i in items if i["type"] == "message" for p in i["content"] if "text" in p
    )
    calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    return text, calls


def _anthropic(blocks: list[dict]) -> tuple[str, list[tuple[str, dict]]]:
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    return text, [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]


def _anthropic_stream(events: list[dict]) -> tuple[str, list[tuple[str, dict]]]:
    blocks: dict[int, dict] = {}
    for e in events:
        if e.get("type") == "content_block_start":
            blocks[e["index"]] = {**e["content_block"], "partial": ""}
        elif e.get("type") == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            b["text"] = b.get("text", "") + d.get("text", "")
            b["partial"] += d.get("partial_json", "")
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["partial"] or "{}")
    return _anthropic(list(blocks.values()))


async def test_every_api_gets_the_call_valid_and_the_text_before_it():
    async with lazy_client() as c:
        got = await _every_api(c, f"{SAID} {BAD_CALL}")
    for api, (content, calls) in got.items():
        assert content.strip() == SAID, api
        assert calls == [("get_weather", WANT)], api


async def test_with_the_setting_off_the_call_is_as_written():
    async with lazy_client(constrain_auto_calls=False) as c:
        got = await _every_api(c, f"{SAID} {BAD_CALL}")
    for api, (content, calls) in got.items():
        assert content.strip() == SAID, api
        assert calls == [("get_weather", AS_WRITTEN)], api


async def test_the_request_field_opts_out_or_in_in_every_api():
    async with lazy_client() as c:
        got = await _every_api(c, f"{SAID} {BAD_CALL}", {"constrain_tool_calls": False})
    for api, (content, calls) in got.items():
        assert content.strip() == SAID, api
        assert calls == [("get_weather", AS_WRITTEN)], api
    async with lazy_client(constrain_auto_calls=False) as c:
        got = await _every_api(c, f"{SAID} {BAD_CALL}", {"constrain_tool_calls": True})
    for api, (_, calls) in got.items():
        assert calls == [("get_weather", WANT)], api


async def test_strict_false_promises_nothing_and_true_holds_calls_with_the_setting_off():
    async with lazy_client() as c:  # Codex's strict: false on every tool is no opt-out
        held = await post_json(c, "/v1/chat/completions", _chat(f"{SAID} {BAD_CALL}", strict=False))
    call = held["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == WANT
    strict_schema = {**WEATHER, "additionalProperties": False}
    body = _chat(f"{SAID} {BAD_CALL}", strict=True)
    body["tools"][0]["function"]["parameters"] = strict_schema
    async with lazy_client(constrain_auto_calls=False) as c:  # strict: true wins
        held = await post_json(c, "/v1/chat/completions", body)
    call = held["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == WANT


QWEN35 = (
    "Qwen3.5-4B",
    ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"],
)
DEVSTRAL = ("unsloth-mistral-Devstral-Small-2507", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]"])
# (family, what the model writes, the reasoning before the answer)
OTHERS = {
    # the prompt opens <think>: an opener inside the reasoning is not a call
    "qwen3_coder": (
        QWEN35,
        "Maybe <tool_call> or not.</think>\n\nLet me check. <tool_call>\n<function=get_weather>\n"
        '<parameter=cty>\nParis\n</parameter>\n<parameter=days>\n"3"\n</parameter>\n'
        "</function>\n</tool_call>",
        "Maybe <tool_call> or not.",
    ),
    "mistral": (DEVSTRAL, 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"cty": "Paris"}', None),
}


@pytest.mark.parametrize("fmt", sorted(OTHERS))
async def test_other_families_through_the_daemon(fmt):
    family, script, reasoning = OTHERS[fmt]
    body = _chat(script)
    async with lazy_client(family) as c:
        whole = (await post_json(c, "/v1/chat/completions", body))["choices"][0]["message"]
        content, calls = _streamed_chat(
            sse_events(await read_stream(c, "/v1/chat/completions", body))
        )
    assert whole["content"].strip() == content.strip() == SAID
    assert whole.get("reasoning_content") == reasoning
    got = [
        (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in whole["tool_calls"]
    ]
    assert got == calls
    assert got[0][0] == "get_weather"
    jsonschema.validate(got[0][1], {**WEATHER, "additionalProperties": False})


# ---- the real runner: a constrained row beside a free one ------------------------------------

FLAGS = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "exact": {"type": "boolean"}},
    "required": ["unit", "exact"],
}


@pytest.mark.mlx
async def test_a_constrained_row_and_a_free_row_batched_equal_each_alone(
    real_tokenizer_model, tmp_path
):
    """Qwen3.5's real vocabulary on random weights, pushed into ``<tool_call>`` (its own
    added token) by ``logit_bias``: what follows is random but for the grammar, so only
    the lazy grammar makes it a call; the free row beside it is not masked by it."""
    import trio
    from mlxd.daemon.supervisor import mlx_runner_factory
    from transformers import AutoTokenizer

    model = real_tokenizer_model("qwen35")
    opener = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<tool_call>")
    settings = settings_with(model={"path": str(model), "cache_dir": str(tmp_path)})
    ask = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": FLAGS}}]
    common = {"messages": ask, "temperature": 0, "max_tokens": 40, "reasoning_effort": "none"}
    called = {**common, "tools": tools, "logit_bias": {str(opener): 100}}
    free = {**common, "seed": 1}

    def answer(r: dict) -> tuple:
        m = r["choices"][0]["message"]
        calls = [
            (t["function"]["name"], t["function"]["arguments"]) for t in m.get("tool_calls") or ()
        ]
        return m["content"], calls

    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, _):
        c = create_app(pipeline, settings).test_client()
        alone = [answer(await post_json(c, "/v1/chat/completions", b)) for b in (called, free)]
        together: list = [None, None]

        async def one(i: int, body: dict) -> None:
            together[i] = answer(await post_json(c, "/v1/chat/completions", body))

        async with trio.open_nursery() as nursery:
            for i, body in enumerate((called, free)):
                nursery.start_soon(one, i, body)
    assert together == alone
    name, arguments = alone[0][1][0]
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), {**FLAGS, "additionalProperties": False})
    assert "<tool_call>" not in (alone[1][0] or "")  # the free row is not pushed into a call


def test_a_resumed_row_finds_where_its_call_stands():
    """A row replayed after a preemption or a failed step: its processor reads the tokens it
    emitted and masks as the processor that saw them one by one."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.logits import LazyCallProcessor

    hf = _hf_tokenizer(["<tool_call>", "</tool_call>"])
    compiler = GrammarCompiler(hf)
    prompt = hf.encode("Q: book it", add_special_tokens=False)
    emitted = hf.encode('Hi <tool_call>\n{"name":"book","arguments":{"ci', add_special_tokens=False)
    context, logits = prompt + emitted, mx.zeros((1, len(hf)))
    stepwise = LazyCallProcessor(compiler.compile_lazy((BOOK,), "hermes"))
    for n in range(len(prompt), len(context) + 1):
        seen = stepwise(mx.array(context[:n]), logits)
        if n > len(prompt):  # the engine reads the step's input token back after it
            stepwise.readback(context[n - 1])
    resumed = LazyCallProcessor(compiler.compile_lazy((BOOK,), "hermes"), resumed=len(emitted))
    replayed = resumed(mx.array(context), logits)
    assert mx.array_equal(seen, replayed)
    allowed = [i for i, v in enumerate(replayed[0].tolist()) if v > -1e30]
    assert hf.decode(allowed) == "t"  # "ci" can only go on as "city"


def test_off_where_the_runner_cannot_carry_it():
    """Speculative decoding's runner and the other ranks of a group run no per-row
    logits processor: there the setting is off (the calls stay free)."""
    from mlxd.daemon.supervisor import tokenizer_options

    assert tokenizer_options(load_settings()).auto_call_grammars
    assert not tokenizer_options(settings_with(speculative={"enabled": True})).auto_call_grammars
    assert not tokenizer_options(
        settings_with(distributed={"parallel": "tensor"})
    ).auto_call_grammars


def test_where_the_runner_cannot_carry_it_strict_tools_are_refused():
    """Under speculative decoding or --parallel no mask is applied: calls stay free, and a
    strict tool, whose arguments were promised to match, is a 400 naming the settings."""
    import msgspec
    from mlxd.actors.tokenizer import PromptBuilder, PromptError
    from mlxd.protocol.messages import ChatRequest, Message, SamplingParams

    hf = family_tokenizer(*QWEN3)
    strict = Tool(name="get_weather", parameters=WEATHER, strict=True)
    ask = ChatRequest(
        request_id="r",
        messages=(Message(role="user", content="hi"),),
        sampling=SamplingParams(),
        tools=(strict,),
    )

    def builder(**options) -> PromptBuilder:
        grammars = GrammarCompiler(hf)
        return PromptBuilder(
            hf, 4096, default_max_tokens=64, vocab_size=len(hf), grammars=grammars, **options
        )

    assert builder().lazy_grammar(ask, "") is not None
    assert builder(constrain_auto_calls=False).lazy_grammar(ask, "") is not None  # strict wins
    with pytest.raises(PromptError, match=r"speculative\.enabled.*distributed\.parallel"):
        builder(auto_call_grammars=False).lazy_grammar(ask, "")
    loose = msgspec.structs.replace(ask, tools=(Tool(name="get_weather", parameters=WEATHER),))
    assert builder(auto_call_grammars=False).lazy_grammar(loose, "") is None


async def test_a_schema_the_grammar_cannot_take_leaves_auto_calls_free_unless_strict():
    odd = {"type": "object", "properties": {"city": {"not": {"type": "integer"}}}}
    body = _chat(f"{SAID} {BAD_CALL}")
    body["tools"][0]["function"]["parameters"] = odd
    strict = json.loads(json.dumps(body))
    strict["tools"][0]["function"] |= {
        "strict": True,
        "parameters": odd | {"required": ["city"], "additionalProperties": False},
    }
    async with lazy_client() as c:
        free = await post_json(c, "/v1/chat/completions", body)
        refused = await c.post("/v1/chat/completions", json=strict)
    call = free["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == AS_WRITTEN
    assert refused.status_code == 400
    assert "not" in json.loads(await refused.get_data())["error"]["message"]


def test_llama3_calls_keep_the_parameters_key_its_template_writes():
    hf = _hf_tokenizer([])
    script = _malformed("llama3").replace('"arguments"', '"parameters"')
    text = _write(GrammarCompiler(hf), hf, "llama3", script)
    assert '"parameters"' in text
    jsonschema.validate(_calls("llama3", text)[1][0][1], PARAMS)


def test_a_hermes_call_without_the_newlines_is_held_too():
    """``<tool_call>{`` with ``>{`` one token of a vocabulary where the opener is text."""
    hf = _hf_tokenizer([])
    hf.add_tokens(["_call>{"])
    script = LINE + _malformed("hermes").replace(">\n{", ">{")
    assert hf.convert_tokens_to_ids("_call>{") in hf.encode(script, add_special_tokens=False)
    text = _write(GrammarCompiler(hf), hf, "hermes", script)
    content, calls = _calls("hermes", text)
    assert content.strip() == PREFACE.strip()
    jsonschema.validate(calls[0][1], PARAMS)


def test_the_text_opener_on_a_real_vocabulary(smollm_tokenizer):
    """SmolLM2's vocabulary (what ``hermes`` serves where the template renders no tools):
    ``<tool_call>`` is several text tokens, and ``{"`` one token."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm_tokenizer)
    script = LINE + _malformed("hermes")
    assert len(hf.encode(" <tool_call>", add_special_tokens=False)) == 5
    text = _write(GrammarCompiler(hf), hf, "hermes", script)
    content, calls = _calls("hermes", text)
    assert content.strip() == PREFACE.strip()
    jsonschema.validate(calls[0][1], PARAMS)
    assert _write(GrammarCompiler(hf), hf, "hermes", script, lazy=False) == script
