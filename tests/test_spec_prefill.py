"""SpecPrefill (``actors/engine/speculative/spec_prefill.py``) on tiny random-weight models.

Keep fraction 1.0 runs the whole sparse machinery (positioned caches, per-chunk
feeding, position hand-over at the join) and must give exactly the tokens of a
normal prefill; below 1.0 requests complete and ``Started`` says how many prompt
tokens the target prefilled. The chunk planner is checked by hand.
"""

from __future__ import annotations

import pytest

from tests.engine_driver import alone, drive, load, request

TEXT = (
    "Once upon a time, in a land far away, there lived a king who had three daughters. "
    "The youngest was the cleverest, and every morning she walked to the river to read."
)


def _settings(**values):
    from mlxd.actors.engine.scheduler.options import SpecPrefillOptions

    return SpecPrefillOptions(**{"threshold_tokens": 8, "chunk_tokens": 4, **values})


def sparse_runner(model_dir, scorer_dir=None, **values):
    from mlxd.actors.engine.loading.load import load_model, make_spec_prefill
    from mlxd.actors.engine.runner.base import MlxRunner

    plain, info = load(model_dir)
    scorer = load_model(scorer_dir, dequantize_on_cpu=True)[0] if scorer_dir else plain.model
    sp = make_spec_prefill(plain.model, (scorer, "scorer"), _settings(**values))
    assert sp.stats.enabled, sp.stats.notes
    runner = MlxRunner(plain.model, sorted(info.tokenizer.eos_token_ids), 8, spec_prefill=sp)
    return plain, runner, info, sp


def _requests(info, n=4):
    tokens = info.tokenizer.encode(TEXT)
    return [request(f"r{i}", tokens[: len(tokens) - 3 * i], 8) for i in range(n)]


def test_chunk_plan_keeps_first_and_last():
    pytest.importorskip("mlx")
    from mlxd.actors.engine.speculative.spec_prefill import make_plan, select

    tokens = tuple(range(42))  # 41 tokens to prefill from position 1: chunks of 8
    plan = make_plan(tokens, 1, chunk_tokens=8, keep_fraction=0.5)
    assert plan.chunks[0] == (1, 9) and plan.chunks[-1] == (41, 41) or plan.chunks[-1][1] == 41
    assert plan.keep_middle == 1 and plan.needs_scores
    plan.surprise = [0.0] * 40
    plan.surprise[20] = 9.0  # token 22: in chunk (17, 25)
    plan.kept = select(plan)
    assert plan.kept == [(1, 9), (17, 25), (33, 41)]
    assert plan.skipped == 16 == 41 - 1 - sum(e - s for s, e in plan.kept)
    full = make_plan(tokens, 1, chunk_tokens=8, keep_fraction=1.0)
    assert not full.needs_scores and full.kept == [(1, 41)] and full.skipped == 0


@pytest.mark.mlx
@pytest.mark.parametrize("model", ["llama", "qwen3_5"])
def test_keep_fraction_one_equals_normal_prefill(tiny_models, model):
    hybrid = model == "qwen3_5"
    plain, runner, info, sp = sparse_runner(tiny_models(model), keep_fraction=1.0, hybrid=hybrid)
    requests = _requests(info)
    expected = alone(plain, requests)
    got, failed = drive(runner, {0: requests[:2], 2: requests[2:]}, prefill_chunk_tokens=6)
    assert not failed and got == expected
    assert sp.stats.requests == 4 and sp.stats.skipped_tokens == 0
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


@pytest.mark.mlx
def test_sparse_prefill_completes_and_reports_prefilled_tokens(tiny_models):
    from mlxd.actors.engine.scheduler.core import EngineCore

    _, runner, info, sp = sparse_runner(
        tiny_models("llama"), tiny_models("llama_draft"), keep_fraction=0.3
    )
    requests = _requests(info, 3)
    opted_out = request("out", requests[0].prompt_tokens, 8)
    import msgspec

    opted_out = msgspec.structs.replace(
        opted_out, sampling=msgspec.structs.replace(opted_out.sampling, spec_prefill=False)
    )
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=16)
    for r in [*requests, opted_out]:
        core.submit(r)
    started, tokens, finished = {}, {}, set()
    while not core.idle:
        step = core.step()
        assert not step.failed
        started |= {s.request_id: s for s in step.started}
        for t in step.tokens:
            tokens.setdefault(t.request_id, []).extend(t.tokens)
            if t.finish_reason:
                finished.add(t.finish_reason and t.request_id)
    assert finished == {r.request_id for r in [*requests, opted_out]}
    for r in requests:
        s = started[r.request_id]
        assert 0 < s.prefilled_tokens < s.prompt_tokens
        assert len(tokens[r.request_id]) == 8
    assert started["out"].prefilled_tokens == started["out"].prompt_tokens
    assert sp.stats.requests == 3 and sp.stats.skipped_tokens > 0
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


@pytest.mark.mlx
def test_positioned_cache_puts_tokens_at_the_positions_it_is_told(tiny_models):
    """RoPE is relative: the same tokens fed at positions shifted by a constant give the
    same logits, and the cache stores only the tokens fed. A cache that stored at the
    position, or rotated by the storage index, would not pass."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlxd.actors.engine.speculative.spec_prefill import positioned, set_position

    runner, info = load(tiny_models("llama"))
    model = runner.model
    tokens = mx.array(info.tokenizer.encode(TEXT)[:24])[None]
    plain = model(tokens, cache=make_prompt_cache(model))[:, -1]
    shifted_cache = positioned(make_prompt_cache(model))
    set_position(shifted_cache, 40)  # as if 40 earlier prompt tokens had been skipped
    shifted = model(tokens[:, :16], cache=shifted_cache)
    shifted = model(tokens[:, 16:], cache=shifted_cache)[:, -1]  # a second chunk continues
    assert mx.allclose(plain, shifted, atol=1e-3).item()
    assert all(c.offset == 64 and c.size() == 24 for c in shifted_cache)
    unshifted = positioned(make_prompt_cache(model))
    moved = model(tokens[:, :16], cache=unshifted)
    set_position(unshifted, 16 + 40)  # a gap between the chunks changes the answer
    moved = model(tokens[:, 16:], cache=unshifted)[:, -1]
    assert not mx.allclose(plain, moved, atol=1e-3).item()
