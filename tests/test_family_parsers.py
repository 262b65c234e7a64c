"""gpt-oss harmony and DeepSeek parsers: each output fed whole, one character at a time and
split at every position; DeepSeek's markup (and gpt-oss's history form) as the real chat
templates render it parses back to the calls rendered."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from mlxd.actors.families import deepseek, harmony
from mlxd.actors.parsers import Parsed

TEMPLATES = Path(__file__).resolve().parent.parent / ".cache" / "templates"

# Arguments that must come back exactly: nesting, quotes, newlines, non-ASCII, null, bools.
TRICKY = {
    "city": 'Zürich "HQ"\nline two',
    "opts": {"units": ["c", 1, None, True], "note": "東京 \\ é"},
    "n": 3,
}


def run(module, chunks: list[str]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """Feed the chunks; return (content, reasoning, [(name, arguments text)], deltas)."""
    counter = itertools.count()
    parser = module.make_parser(lambda: f"call_{next(counter)}", ())
    total, deltas = Parsed(), []
    for part in [*(parser.feed(c) for c in chunks), parser.flush()]:
        deltas += [part.content, part.reasoning]
        total.extend(part)
    assert [p.id for p in total.calls] == [f"call_{i}" for i in range(len(total.calls))]
    return total.content, total.reasoning, [(p.name, p.arguments) for p in total.calls], deltas


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def check(module, text, content, reasoning="", calls=(), never_shown=()):
    """``calls``: (name, arguments object); their text must be exactly what json.dumps writes."""
    want = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    for chunks in splits(text):
        got_content, got_reasoning, got_calls, deltas = run(module, chunks)
        assert (got_content, got_reasoning, got_calls) == (content, reasoning, want), chunks
        for marker in never_shown:  # not even a piece of it, in any delta
            assert all(marker not in d for d in deltas), chunks


def template(name: str) -> str:
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: scripts/install --test downloads the templates")
        pytest.skip(f"{path} is missing (scripts/install --test downloads it)")
    return path.read_text()


def render(name: str, messages: list[dict]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=[
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "Weather", "parameters": {}},
            }
        ],
        chat_template=template(name),
        add_generation_prompt=False,
        bos_token="<s>",
        eos_token="</s>",
    )
    return rendered[0]


def openai_calls(calls, *, as_text=False) -> list[dict]:
    """Calls as a request's history carries them (arguments as an object, or as JSON text)."""
    return [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a) if as_text else a},
        }
        for i, (n, a) in enumerate(calls)
    ]


# ---- harmony ---------------------------------------------------------------------------

SPECIAL = "<|"  # no piece of a harmony token shows in well-formed output
WEATHER = '{"city":"Paris"}'
CALL = (
    f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>"
)
THINK = "<|channel|>analysis<|message|>The user wants weather.\nCall the tool.<|end|>"


@pytest.mark.parametrize(
    ("text", "content", "reasoning", "calls"),
    [
        ("Just an answer.", "Just an answer.", "", []),  # no header at all
        ("<|channel|>final<|message|>Hi there.<|return|>", "Hi there.", "", []),
        ("<|channel|>final<|message|>Hi there.", "Hi there.", "", []),  # <|return|> unseen
        (
            "<|channel|>analysis<|message|>Easy.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>",
            "4",
            "Easy.",
            [],
        ),
        ("<|channel|>analysis<|message|>Still thinking", "", "Still thinking", []),
        (CALL, "", "", [("get_weather", {"city": "Paris"})]),
        (CALL.removesuffix("<|call|>"), "", "", [("get_weather", {"city": "Paris"})]),
        # The recipient before the channel, the content type written " json" or not at all.
        (
            f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>",
            "",
            "",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            f"<|channel|>commentary to=functions.get_weather<|message|>{WEATHER}",
            "",
            "",
            [("get_weather", {"city": "Paris"})],
        ),
        # A call after reasoning, with the next message's header either way round.
        (
            THINK + "<|start|>assistant" + CALL,
            "",
            "The user wants weather.\nCall the tool.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            THINK + "<|start|>assistant to=functions.get_weather<|channel|>commentary "
            "<|constrain|>json<|message|>" + WEATHER + "<|call|>",
            "",
            "The user wants weather.\nCall the tool.",
            [("get_weather", {"city": "Paris"})],
        ),
        # Reasoning, a preamble to the user (content), then the call.
        (
            THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking Paris.<|end|>"
            "<|start|>assistant" + CALL,
            "Checking Paris.",
            "The user wants weather.\nCall the tool.",
            [("get_weather", {"city": "Paris"})],
        ),
        # Several calls in one output.
        (
            CALL + "<|start|>assistant" + CALL.replace("get_weather", "get_time"),
            "",
            "",
            [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})],
        ),
        (
            "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>"
            + json.dumps(TRICKY, ensure_ascii=False, indent=2)
            + "<|call|>",
            "",
            "",
            [("lookup", TRICKY)],
        ),
        # The model skipped <|end|>: the next header still opens a new message.
        (
            "<|channel|>analysis<|message|>Hmm<|start|>assistant<|channel|>final<|message|>Ok",
            "Ok",
            "Hmm",
            [],
        ),
    ],
)
def test_harmony(text, content, reasoning, calls):
    check(harmony, text, content, reasoning, calls, never_shown=(SPECIAL,))


@pytest.mark.parametrize(
    ("text", "content", "reasoning"),
    [
        # A call whose body is not a JSON object comes back whole, header and all.
        (
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>",
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>",
            "",
        ),
        (
            THINK + "<|start|>assistant to=functions.f<|channel|>commentary<|message|>[1]",
            "<|start|>assistant to=functions.f<|channel|>commentary<|message|>[1]",
            "The user wants weather.\nCall the tool.",
        ),
        # A header that never reaches <|message|>.
        ("<|channel|>final and then<|end|>Rest", "<|channel|>final and then<|end|>Rest", ""),
        ("<|channel|>final no message", "<|channel|>final no message", ""),
        # Text that only starts like a header.
        ("to be or not", "to be or not", ""),
        ("<|chan", "<|chan", ""),
        # A recipient outside functions. is no call: the message goes by its channel.
        (
            "<|channel|>analysis to=python code<|message|>print(1)<|call|>",
            "",
            "print(1)",
        ),
    ],
)
def test_harmony_malformed_is_content(text, content, reasoning):
    check(harmony, text, content, reasoning)


def test_harmony_streams_reasoning_and_content_before_the_end():
    parser = harmony.make_parser(lambda: "call_0", ())
    first = parser.feed("<|channel|>analysis<|message|>Thinking about it<|e")
    assert first.reasoning == "Thinking about it"  # "<|e" may start <|end|>: held
    second = parser.feed("nd|><|start|>assistant<|channel|>final<|message|>The answer")
    assert (second.reasoning, second.content) == ("", "The answer")
    assert parser.flush() == Parsed()


def test_harmony_history_render_parses_back():
    """The template's history form: recipient before the channel, `` json`` content type."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "thinking": "Need a tool.",
            "tool_calls": openai_calls([("get_weather", TRICKY)]),
        },
    ]
    rendered = render("openai-gpt-oss-120b", messages)
    output = rendered.split("Weather?<|end|><|start|>assistant", 1)[1]
    assert "to=functions.get_weather<|channel|>commentary json<|message|>" in output
    check(harmony, output, "", "Need a tool.", [("get_weather", TRICKY)])


def test_harmony_history_final_answer_parses_back():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "thinking": "Easy.", "content": "Sunny, 20 °C."},
    ]
    output = render("openai-gpt-oss-120b", messages).split("Weather?<|end|><|start|>assistant", 1)[
        1
    ]
    check(harmony, output, "Sunny, 20 °C.", "Easy.")


# ---- DeepSeek --------------------------------------------------------------------------

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3 = f'{BEGIN}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{CB}get_time{SEP}{{}}{CE}{END}'
R1 = (
    f'{BEGIN}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}\n'
    f"{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{END}"
)
PARIS_AND_TIME = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def dsml(block: str, *invokes: str) -> str:
    return f"<｜DSML｜{block}>\n{''.join(invokes)}</｜DSML｜{block}>"


def invoke(name: str, **params: tuple[str, str]) -> str:
    body = "".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n'
        for k, (s, v) in params.items()
    )
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


PARIS = invoke("get_weather", city=("true", "Paris"))
TRICKY_DSML = invoke(
    "lookup",
    city=("true", TRICKY["city"]),
    opts=("false", json.dumps(TRICKY["opts"], ensure_ascii=False)),
    n=("false", "3"),
)
MARKERS = ("<｜", "｜>")  # no piece of a DeepSeek marker shows in well-formed output


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        ("  spaced answer\n", "  spaced answer\n", []),
        (V3, "", PARIS_AND_TIME),
        ("Let me check." + V3, "Let me check.", PARIS_AND_TIME),
        (V3 + "\n\nDone.", "\n\nDone.", PARIS_AND_TIME),
        # Whitespace right before a section is the markup's, not the answer's.
        ("Checking.\n\n" + V3 + " Done.", "Checking. Done.", PARIS_AND_TIME),
        (V3.removesuffix(END), "", PARIS_AND_TIME),  # the output ended before the end marker
        (R1, "", PARIS_AND_TIME),
        ("Checking.\n\n" + R1 + "\n", "Checking.", PARIS_AND_TIME),
        (
            f"{BEGIN}{CB}lookup{SEP}{json.dumps(TRICKY, ensure_ascii=False)}{CE}{END}",
            "",
            [("lookup", TRICKY)],
        ),
        (
            f"{BEGIN}{CB}function{SEP}lookup\n```json\n{json.dumps(TRICKY, indent=2)}\n```{CE}{END}",
            "",
            [("lookup", TRICKY)],
        ),
        # Arguments as a JSON string holding the object (a template's tojson of a string).
        (f'{BEGIN}{CB}f{SEP}"{{\\"x\\": 1}}"{CE}{END}', "", [("f", {"x": 1})]),
        (dsml("function_calls", PARIS), "", [("get_weather", {"city": "Paris"})]),
        (
            "Let me check.\n\n" + dsml("tool_calls", PARIS, invoke("get_time")),
            "Let me check.",
            PARIS_AND_TIME,
        ),
        (dsml("tool_calls", TRICKY_DSML), "", [("lookup", TRICKY)]),
        (dsml("function_calls", TRICKY_DSML, PARIS), "", [("lookup", TRICKY), PARIS_AND_TIME[0]]),
        # string="false" with a value that is not JSON: the value is kept as written.
        (dsml("tool_calls", invoke("f", x=("false", "not json"))), "", [("f", {"x": "not json"})]),
        # Two sections, content between.
        (V3 + "Also:" + dsml("tool_calls", PARIS), "Also:", [*PARIS_AND_TIME, PARIS_AND_TIME[0]]),
    ],
)
def test_deepseek(text, content, calls):
    check(deepseek, text, content, calls=calls, never_shown=MARKERS)


@pytest.mark.parametrize(
    "text",
    [
        f"{BEGIN}{CB}f{SEP}{{oops{CE}{END}",  # arguments not JSON
        f"{BEGIN}{CB}f{SEP}[1, 2]{CE}{END}",  # arguments not an object
        f"{BEGIN}{CB}f {{}}{CE}{END}",  # no separator
        f"{BEGIN}stray text{CB}f{SEP}{{}}{CE}{END}",  # text outside the calls
        f"{BEGIN}{CB}{SEP}{{}}{CE}{END}",  # no name
        f'{BEGIN}{CB}f{SEP}{{"a": 1',  # cut off mid-arguments
        f"{BEGIN}{END}",  # no calls
        dsml("tool_calls", "junk" + PARIS),
        dsml("tool_calls", '<｜DSML｜invoke name="f">\nvalue</｜DSML｜invoke>\n'),
        dsml("function_calls", PARIS).removesuffix("</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
        "a <｜ b <｜DSML｜",
    ],
)
def test_deepseek_malformed_is_content(text):
    check(deepseek, text, text)


def test_deepseek_bad_call_spends_no_id():
    """A section that fails gives back its text; the next good call is still call_0."""
    bad = f"{BEGIN}{CB}f{SEP}{{}}{CE}{CB}g{SEP}oops{CE}{END}"
    check(deepseek, bad + " then " + V3, bad + " then", calls=PARIS_AND_TIME)


def test_deepseek_streams_content_before_the_end():
    parser = deepseek.make_parser(lambda: "call_0", ())
    assert (
        parser.feed("Let me check the weather <｜tool▁calls").content == "Let me check the weather"
    )
    assert parser.feed("▁begin｜>").content == ""
    assert parser.flush().content == " <｜tool▁calls▁begin｜>"  # no calls: given back


def assistant_turn(rendered: str) -> str:
    """What the model wrote for the assistant turn after the user's "Weather?"."""
    turn = rendered.split("Weather?", 1)[1].split("<｜end▁of▁sentence｜>", 1)[0]
    return turn.removeprefix("<｜Assistant｜>").split("</think>", 1)[-1]


@pytest.mark.parametrize(
    ("name", "content", "as_text"),
    [
        ("deepseek-ai-DeepSeek-V3.1", "Let me check.", False),
        ("deepseek-ai-DeepSeek-V3.1", "Let me check.", True),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "", False),  # content is rendered apart
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "", True),
        ("deepseek-ai-DeepSeek-V3.2", "Let me check.", False),  # DSML: arguments as objects
        ("deepseek-ai-DeepSeek-V4", "Let me check.", False),
        ("deepseek-ai-DeepSeek-V4-Flash-0731", "Let me check.", False),
    ],
)
def test_deepseek_template_render_parses_back(name, content, as_text):
    calls = [("lookup", TRICKY), ("get_weather", {"city": "Paris"}), ("get_time", {})]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": openai_calls(calls, as_text=as_text),
        },
    ]
    check(deepseek, assistant_turn(render(name, messages)), content, calls=calls)
