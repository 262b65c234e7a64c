"""Batched prefill on real MLX models: the chunks of several requests go through the model
in one forward pass (right-padded to the longest, on their caches merged into one batch
cache), and every request's greedy answer equals its answer alone. Covered: a dense model
(SmolLM2), a hybrid (GatedDeltaNet + attention, whose SSM state must ignore the padding),
and a model with sliding-window (rotating) caches; requests start at different offsets
(one resumes from a prefix-cache hit) and their chunks differ in length."""

from __future__ import annotations

import mlx.core as mx
import msgspec
import pytest
from mlxd.actors.engine.loading.load import load_runner
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.options import PrefixCacheOptions

from tests.engine_driver import request, until_idle

pytestmark = pytest.mark.mlx

BASE = tuple(range(2000, 2000 + 70))
PROMPTS = {
    "a": tuple(range(300, 337)),
    "b": tuple(range(500, 550)),
    "c": BASE + (7, 8, 9),  # shares 64 tokens with "warm": starts from a prefix-cache hit
    "d": tuple(range(900, 923)),
}


def load(path, prefix_cache=True):
    options = PrefixCacheOptions(block_size=64, max_bytes=1 << 30) if prefix_cache else None
    runner, _ = load_runner(
        str(path), path, dequantize_on_cpu=True, max_batch=8, prefix_cache=options
    )
    return runner


def run(runner, prompts, *, batch_prefill, chunk=256):
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=chunk, batch_prefill=batch_prefill)
    for rid, prompt in prompts.items():
        # "warm" snapshots at 64 tokens: an exact boundary, which hybrid and rotating caches
        # (they cannot be trimmed back) need for a hit
        marks = (64,) if rid == "warm" else ()
        core.submit(msgspec.structs.replace(request(rid, prompt, max_tokens=8), checkpoints=marks))
    return until_idle(core)


def counting(runner, fail_first=False):
    """Record the rows of each batched pass (and make the first one raise, if asked)."""
    passes = []
    rows = runner._prefill_rows

    def prefill_rows(group):
        passes.append([p.request.request_id for p, _ in group])
        if fail_first and len(passes) == 1:
            raise RuntimeError("injected: a batched pass fails")
        return rows(group)

    runner._prefill_rows = prefill_rows
    return passes


def answers_alone(path):
    runner = load(path)
    run(runner, {"warm": BASE + (1, 2)}, batch_prefill=False)  # leaves a 64-token snapshot
    alone = {}
    for rid, prompt in PROMPTS.items():  # one at a time (their prompts share no block)
        alone |= run(runner, {rid: prompt}, batch_prefill=False)
    return alone


@pytest.mark.parametrize("model", ["smollm", "qwen3_5", "baichuan_m1"])
def test_batched_prefill_equals_each_request_alone(model, smollm_tokenizer, tiny_models):
    path = smollm_tokenizer if model == "smollm" else tiny_models(model)
    alone = answers_alone(path)
    runner = load(path)
    run(runner, {"warm": BASE + (1, 2)}, batch_prefill=False)
    passes = counting(runner)
    # a budget of 96 per step: several requests share each step, in unequal chunks
    together = run(runner, PROMPTS, batch_prefill=True, chunk=96)
    assert together == alone
    assert any(len(p) >= 3 for p in passes), passes
    assert any("c" in p for p in passes)  # the one resuming from the prefix cache
    assert runner.prefix_cache.stats.hits >= 1


def test_a_failed_batched_pass_changes_nothing_and_each_request_goes_on_alone(tiny_models):
    path = tiny_models("qwen3_5")
    alone = answers_alone(path)
    runner = load(path)
    run(runner, {"warm": BASE + (1, 2)}, batch_prefill=False)
    passes = counting(runner, fail_first=True)
    assert run(runner, PROMPTS, batch_prefill=True, chunk=96) == alone
    assert len(passes[0]) >= 3  # the pass that failed held most of the requests


@pytest.mark.parametrize("model", ["smollm", "qwen3_5", "baichuan_m1"])
def test_auto_batches_only_the_rows_within_the_context_limit(model, smollm_tokenizer, tiny_models):
    """``engine.batch_prefill = "auto"`` on the CPU backend: the loader sets the runner's
    ``batch_prefill_max_context``; rows whose cache would hold more after the pass go alone,
    the short ones share one right-padded pass (their chunks differ in length)."""
    path = smollm_tokenizer if model == "smollm" else tiny_models(model)
    alone = answers_alone(path)
    runner = load(path)
    run(runner, {"warm": BASE + (1, 2)}, batch_prefill=False)
    runner.batch_prefill_max_context = 40  # "a" (36 tokens to run) and "d" (22) only
    assert runner.batch_prefill_pays
    passes = counting(runner)
    assert run(runner, PROMPTS, batch_prefill=None, chunk=96) == alone
    assert passes and all(set(p) <= {"a", "d"} for p in passes), passes
    runner.batch_prefill_max_context = None
    assert runner.batch_prefill_pays == (mx.default_device() == mx.gpu)  # off on the CPU


@pytest.mark.parametrize("model", ["qwen3_5", "baichuan_m1"])
def test_short_rows_keep_their_own_recurrent_state(model, tiny_models):
    """Short rows batched on the CPU backend (right-padded where the model allows it) end
    with the recurrent state each would have alone. Baichuan-M1's key/value convolution
    stores its last inputs whatever the padding mask says, so its rows go unpadded."""
    from mlx_lm.models.cache import ArraysCache
    from mlxd.actors.engine.runner.base import _leaf_caches

    runner = load(tiny_models(model), prefix_cache=False)
    runner.batch_prefill_max_context = 128
    assert runner.padding_keeps_rows() == (model != "baichuan_m1")

    def pending(rid, prompt):
        runner.start(request(rid, prompt, max_tokens=4))
        return runner._pending[rid], len(prompt) - 1

    prompts = {"a": PROMPTS["a"], "d": PROMPTS["d"]}  # 36 and 22 tokens to run
    together = runner._prefill_rows([pending(f"{r}-both", p) for r, p in prompts.items()])
    for (rid, prompt), batched in zip(prompts.items(), together, strict=True):
        (alone,) = runner._prefill_rows([pending(f"{rid}-alone", prompt)])
        pairs = zip(_leaf_caches(alone), _leaf_caches(batched), strict=True)
        states = [
            (x, y)
            for a, b in pairs
            if isinstance(a, ArraysCache)
            for x, y in zip(a.cache, b.cache, strict=True)
        ]
        assert states
        assert all(mx.allclose(x, y, rtol=1e-3, atol=1e-4).item() for x, y in states), rid


def test_a_row_gets_its_first_token_in_the_step_it_joins(tiny_models):
    """mlx-lm's generator runs a step ahead: the runner makes the call that yields a
    joined row's first token in the same engine step, not after the next step's prefill
    (in a burst, another whole prefill pass). The rows already decoding get two tokens
    that step, and every answer is the one it has alone."""
    runner = load(tiny_models("llama"), prefix_cache=False)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=256)
    got: dict[str, list[int]] = {}

    def step() -> list[tuple[str, int]]:
        out = core.step()
        for t in out.tokens:
            got.setdefault(t.request_id, []).extend(t.tokens)
        return sorted((t.request_id, len(t.tokens)) for t in out.tokens)

    core.submit(request("a", PROMPTS["a"], max_tokens=8))
    assert step() == [("a", 1)]  # prefilled, joined the batch, first token
    core.submit(request("b", PROMPTS["b"], max_tokens=8))
    assert step() == [("a", 2), ("b", 1)]
    assert step() == [("a", 1), ("b", 1)]  # nothing joined: one decode
    for rid, tokens in until_idle(core).items():
        got[rid] += tokens
    for rid in ("a", "b"):
        solo = EngineCore(runner, max_batch=8, prefill_chunk_tokens=256)
        solo.submit(request(rid, PROMPTS[rid], max_tokens=8))
        assert until_idle(solo)[rid] == got[rid]
