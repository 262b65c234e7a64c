"""Client cache hints: breakpoints (Anthropic ``cache_control``) become prefix-cache
checkpoints, and the cache key (``prompt_cache_key``) reaches the engine.

The builder tests use the fake character tokenizer; the ``mlx`` test runs a tiny hybrid
(GatedDeltaNet + attention) model, whose state is reusable only where it was captured
exactly, so the cached-token count shows which snapshot served a request."""

from __future__ import annotations

import msgspec
import pytest
from mlxd.actors.tokenizer import PromptBuilder
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import mlx_runner_factory, tokenizer_options
from mlxd.protocol.messages import ChatRequest, Finished, Message, SamplingParams

from tests.conftest import collect, running_graph, settings_with
from tests.fakes import CharTokenizer

SYSTEM = "You are a terse assistant for a bike shop. Opening hours are nine to five. " * 3
TURNS = [
    ("system", SYSTEM),
    ("user", "Do you fix brakes on old racing bikes?"),
    ("assistant", "Yes, we fix brakes on every kind of bike, old racing bikes included."),
    ("user", "How long does it usually take?"),
    ("assistant", "About a day."),
    ("user", "And the price?"),
]


def chat(rid, turns, breakpoints=(), key="", max_tokens=4):
    return ChatRequest(
        request_id=rid,
        messages=tuple(Message(role=r, content=c) for r, c in turns),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        cache_breakpoints=tuple(breakpoints),
        cache_key=key,
    )


def builder(tokenizer=None, **kw) -> PromptBuilder:
    return PromptBuilder(tokenizer or CharTokenizer(), 100_000, default_max_tokens=8, **kw)


def end_of(b: PromptBuilder, turns) -> int:
    """Tokens in the rendering of ``turns`` without a generation prompt."""
    messages = [{"role": r, "content": c} for r, c in turns]
    return len(b._encode(b._render(messages, False, {})))


# ---- the builder --------------------------------------------------------------------------


def test_a_breakpoint_marks_the_end_of_its_message():
    b = builder(vocab_size=0x110000)
    _, tokens, plain = b.render_chat(chat("a", TURNS))
    _, _, marks = b.render_chat(chat("a", TURNS, breakpoints=[2]))
    assert set(marks) - set(plain) == {end_of(b, TURNS[:3])}
    assert "".join(map(chr, tokens[: end_of(b, TURNS[:3])])).endswith(TURNS[2][1])


def test_the_last_breakpoints_are_kept_up_to_the_limit():
    b = builder(vocab_size=0x110000, max_breakpoints=2)
    _, _, marks = b.render_chat(chat("a", TURNS, breakpoints=[0, 1, 2, 3, 99, -1]))
    assert end_of(b, TURNS[:4]) in marks and end_of(b, TURNS[:3]) in marks
    assert end_of(b, TURNS[:2]) not in marks  # the third from last: over the limit
    under = builder(vocab_size=0x110000, max_breakpoints=4)
    marks = under.render_chat(chat("a", TURNS, breakpoints=[1, 2, 3]))[2]
    assert {end_of(b, TURNS[: i + 1]) for i in (1, 2, 3)} <= set(marks)
    off = builder(vocab_size=0x110000, max_breakpoints=0)
    assert (
        off.render_chat(chat("a", TURNS, breakpoints=[2]))[2]
        == off.render_chat(chat("a", TURNS))[2]
    )


def test_breakpoints_count_with_the_automatic_checkpoints_off():
    b = builder(vocab_size=0x110000, checkpoints=False)
    assert b.render_chat(chat("a", TURNS))[2] == ()
    assert b.render_chat(chat("a", TURNS, breakpoints=[2, 5]))[2] == (
        end_of(b, TURNS[:3]),
        end_of(b, TURNS),  # the last message's end, before the generation prompt
    )


class ClosingTokenizer(CharTokenizer):
    """A template that closes a conversation without a generation prompt with ``<end>``:
    a prefix rendered alone is then never a prefix of the whole prompt."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **extra):
        text = super().apply_chat_template(messages, add_generation_prompt, tokenize, **extra)
        return text if add_generation_prompt else text + "<end>"


def test_a_breakpoint_whose_rendering_is_not_a_prefix_of_the_prompt_is_dropped():
    b = builder(ClosingTokenizer(), vocab_size=0x110000)
    marks = b.render_chat(chat("a", TURNS, breakpoints=[2, 3]))[2]
    assert marks == b.render_chat(chat("a", TURNS))[2]  # the system prompt's end only
    assert marks == (len(f"<system>{SYSTEM}<user>"),)


def test_build_carries_the_cache_key_and_the_breakpoint_checkpoints():
    b = builder(vocab_size=0x110000)
    built = b.build(chat("a", TURNS, breakpoints=[2], key="conversation-7"))
    assert built.cache_key == "conversation-7"
    assert end_of(b, TURNS[:3]) in built.checkpoints


def test_the_settings_reach_the_builder():
    s = settings_with(prefix_cache={"max_breakpoints": 3})
    assert tokenizer_options(s).max_breakpoints == 3
    off = settings_with(prefix_cache={"enabled": False})
    assert tokenizer_options(off).max_breakpoints == 0


# ---- the real tiny hybrid model -----------------------------------------------------------


@pytest.mark.mlx
async def test_a_request_sharing_the_conversation_up_to_a_breakpoint_reuses_exactly_it(
    tmp_path_factory, tiny_models
):
    base = msgspec.to_builtins(load_settings())
    base["model"]["path"] = str(tiny_models("qwen3_5"))
    base["model"]["cache_dir"] = str(tmp_path_factory.getbasetemp() / "mlxd-cache")
    settings = msgspec.convert(base, type=type(load_settings()))
    other = [*TURNS[:3], ("user", "Can you true a wheel while I wait?")]
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (p, runner):
        position = end_of(p.builder, TURNS[:3])
        system_end = min(p.builder.render_chat(chat("s", TURNS))[2])

        async def cached(request) -> int:
            events = await collect(await p.submit(request))
            assert isinstance(events[-1], Finished), events[-1]
            return events[-1].cached_tokens

        # without the hint only the system prompt's snapshot serves the second request
        assert await cached(chat("plain-1", TURNS, key="k")) == 0
        assert await cached(chat("plain-2", other, key="k")) == system_end
        runner.clear_cache()
        assert await cached(chat("hint-1", TURNS, breakpoints=[2], key="k")) == 0
        assert await cached(chat("hint-2", other, key="k")) == position
        assert position > system_end
        assert runner.prefix_cache._newest["k"]  # the key reached the cache


def test_counting_tokens_probes_no_checkpoints():
    calls = []

    class Counting(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            calls.append(text)
            return super().encode(text, add_special_tokens)

    b = builder(Counting(), vocab_size=0x110000)
    request = chat("a", TURNS, breakpoints=[2])
    assert b.tokens(request) == b.render_chat(request)[1]
    assert len(calls) == 1 + 4  # the count: one encode; the build: the prompt and 3 marks
