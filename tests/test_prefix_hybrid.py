"""Prefix cache on hybrid models: SSM state is reused only where it was captured exactly."""

from __future__ import annotations

import pytest
from mlxd.actors.engine.runner.prefix_cache import PrefixCache
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.engine_driver import drive, load

pytestmark = pytest.mark.mlx

SYSTEM = "You are a terse assistant for a bike shop. Opening hours are nine to five. " * 3


@pytest.fixture(scope="module", params=["qwen3_5", "baichuan_m1"])
def hybrid(request, tiny_models):
    runner, info = load(tiny_models(request.param))
    return runner, info.tokenizer.encode


def req(rid, tokens, checkpoints=(), max_tokens=8):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return TokenizedRequest(
        request_id=rid, prompt_tokens=tuple(tokens), sampling=sampling, checkpoints=checkpoints
    )


def run_one(runner, request):
    tokens, failed = drive(runner, {0: [request]})
    assert not failed
    return tokens[request.request_id]


def conversation(runner, encode):
    """Exact repeat, shared system prompt, a prefix of an earlier prompt, a second turn."""
    system = encode(SYSTEM)
    first = system + encode(" Q: are you open on Sunday? A:")
    second = system + encode(" Q: do you fix brakes? A:")
    out = {"first": run_one(runner, req("first", first, (len(system),)))}
    out["repeat"] = run_one(runner, req("repeat", first, (len(system),)))
    out["second"] = run_one(runner, req("second", second, (len(system),)))
    out["prefix"] = run_one(runner, req("prefix", first[: len(system) + 3]))
    turn2 = first + out["first"] + encode(" Q: and on Monday? A:")
    out["turn2"] = run_one(runner, req("turn2", turn2, (len(system), len(first))))
    return out


def test_hits_equal_misses_and_use_only_exact_states(hybrid):
    runner, encode = hybrid
    runner.prefix_cache = None
    cold = conversation(runner, encode)
    cache = PrefixCache(block_size=16, max_bytes=1 << 30)
    runner.prefix_cache = cache
    try:
        warm = conversation(runner, encode)
    finally:
        runner.prefix_cache = None
    assert warm == cold
    assert all(len(v) > 0 for v in warm.values())
    # repeat (end of prefill), second (system checkpoint), prefix (system checkpoint),
    # turn2 (the first turn's finished sequence): four hits; the first request misses.
    assert cache.stats.hits == 4
    assert cache.stats.misses == 1
    assert runner.cache_bytes == 0
    assert not any(e.trimmable for e in cache._entries.values())  # hybrid: never trimmed
