"""Prefix cache on the real model: a cache hit never changes a greedy answer."""

from __future__ import annotations

import msgspec
import pytest
import trio
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import mlx_runner_factory
from mlxd.protocol.messages import (
    ChatRequest,
    CompletionRequest,
    Finished,
    Message,
    SamplingParams,
)

from tests.conftest import collect, running_graph, text_of

pytestmark = pytest.mark.mlx

SYSTEM = (
    "You are a meticulous assistant for a hardware store. Answer in one short sentence. "
    "Our opening hours are 8am to 6pm, Monday to Saturday. We sell tools, paint, timber, "
    "garden supplies and plumbing parts. Deliveries are free above fifty pounds. "
) * 3
QUESTIONS = ["Do you sell paint?", "When do you open on Saturday?", "Is delivery free?"]


def settings_for(tmp_path_factory, enabled: bool):
    base = msgspec.to_builtins(load_settings())
    base["model"]["cache_dir"] = str(tmp_path_factory.getbasetemp() / "mlxd-cache")
    base["prefix_cache"]["enabled"] = enabled
    return msgspec.convert(base, type=type(load_settings()))


def chat(rid, messages, max_tokens=16):
    return ChatRequest(
        request_id=rid,
        messages=tuple(Message(role=r, content=c) for r, c in messages),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def completion(rid, prompt, max_tokens=12):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return CompletionRequest(request_id=rid, prompt=prompt, sampling=sampling)


async def scenario(pipeline):
    """Exact, prefix, supersequence and multi-turn requests; returns (text, cached) per step."""
    out = []

    async def ask(request):
        events = await collect(await pipeline.submit(request))
        assert isinstance(events[-1], Finished)
        out.append((text_of(events), events[-1].cached_tokens))
        return out[-1][0]

    first = [("system", SYSTEM), ("user", QUESTIONS[0])]
    await ask(chat("exact-1", first))
    await ask(chat("exact-2", first))  # exact hit
    await ask(chat("prefix", [("system", SYSTEM), ("user", QUESTIONS[1])]))  # system prompt hit
    long_text = "The history of the bicycle begins in 1817, when Karl Drais " * 16
    await ask(completion("super-long", long_text))
    await ask(completion("super-short", long_text[: len(long_text) // 2]))  # supersequence hit
    turns = [("system", SYSTEM)]
    for i, question in enumerate(QUESTIONS):  # a conversation growing turn by turn
        turns.append(("user", question))
        turns.append(("assistant", await ask(chat(f"turn-{i}", turns))))
    async with trio.open_nursery() as nursery:  # two concurrent requests sharing a prefix
        for i in range(2):
            nursery.start_soon(
                ask, chat(f"concurrent-{i}", [("system", SYSTEM), ("user", QUESTIONS[2 - i])])
            )
    return out


async def test_cache_hits_give_the_same_greedy_output(tmp_path_factory):
    results = {}
    for enabled in (False, True):
        settings = settings_for(tmp_path_factory, enabled)
        async with running_graph(settings, factory=mlx_runner_factory(settings)) as (p, runner):
            results[enabled] = await scenario(p)
            assert runner.cache_bytes == 0  # nothing pinned by finished requests
            if enabled:
                stats = p.engine_stats.counters.prefix_cache
                assert 0 < stats.bytes <= stats.max_bytes
                assert stats.hits >= 6
    off, on = results[False], results[True]
    assert [t for t, _ in on][:8] == [t for t, _ in off][:8]
    assert sorted(t for t, _ in on[8:]) == sorted(t for t, _ in off[8:])
    assert all(cached == 0 for _, cached in off)
    cached = [c for _, c in on]
    assert cached[0] == 0
    assert cached[1] > 100  # exact hit: all but the last prompt token
    assert cached[2] > 100  # the shared system prompt
    assert cached[4] > 64  # a prefix of an earlier, longer prompt (at least one block)
    assert cached[6] > cached[5]  # each turn reuses the previous one
    assert cached[7] > cached[6]
    assert min(cached[8:]) > 100
