"""MTP heads as the speculative drafter (``actors/engine/speculative/mtp.py``).

Tiny Qwen3.5 hybrid targets (GatedDeltaNet + attention) whose checkpoints carry an
``mtp.*`` head: a random head (drafts almost always rejected), an exact head on a
bigram target (every draft accepted) and one in between (rows accept different
counts). Greedy output with MTP speculation equals plain greedy output for 8
requests joining and leaving at different steps.
"""

from __future__ import annotations

import json

import pytest

from tests.engine_driver import alone, drive, load, speculative_runner
from tests.test_speculative import _requests, _schedule, assert_sampled_runs_repeat


def mtp_runner(model_dir, *, k=3, spec_max_batch=8, max_batch=8):
    from mlxd.actors.engine.loading.load import load_mtp_drafter

    config = json.loads((model_dir / "config.json").read_text())
    return speculative_runner(
        model_dir,
        lambda target: load_mtp_drafter(target, model_dir, config, True),
        k=k,
        spec_max_batch=spec_max_batch,
        max_batch=max_batch,
    )


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("model", "spec_max_batch"),
    [
        ("qwen3_5_mtp", 8),  # random head: every step rolls back (SSM state restored)
        ("qwen3_5_mtp_near", 8),  # rows accept different counts
        ("qwen3_5_mtp_near", 3),  # off above 3 rows: the head's pending pairs pile up
        ("qwen3_5_mtp_exact", 8),
    ],
)
def test_greedy_mtp_speculation_equals_plain_decoding(tiny_models, model, spec_max_batch):
    plain, runner, info = mtp_runner(tiny_models(model), spec_max_batch=spec_max_batch)
    requests = _requests(info)
    expected = alone(plain, requests)
    got, failed = drive(runner, _schedule(requests), prefill_chunk_tokens=8)
    assert not failed
    assert got == expected
    stats = runner.spec_stats
    assert stats.drafter == "mtp" and stats.steps > 0 and stats.drafted > 0
    if model == "qwen3_5_mtp_exact":
        assert stats.acceptance_rate == 1.0
    if model == "qwen3_5_mtp_near":
        assert 0.0 < stats.acceptance_rate < 1.0
    if spec_max_batch < 8:
        assert stats.plain_steps > 0
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


@pytest.mark.mlx
@pytest.mark.parametrize("spec_max_batch", [8, 0])
def test_the_head_sees_the_targets_hidden_states_paired_with_the_next_token(
    tiny_models, spec_max_batch
):
    """Mid-decode, the head's cache holds exactly the pairs (target hidden at position j,
    token j + 1) of the sequence so far, and its pending pairs are the rest: recomputed
    from scratch on the whole sequence, its attention keys are the same. (Output
    equality cannot see this: verification hides a badly fed head.) With
    ``spec_max_batch`` 0 no step drafts: the pairs wait, then all go in at once."""
    import mlx.core as mx
    from mlxd.actors.engine.speculative.batch import Target

    plain, runner, info = mtp_runner(tiny_models("qwen3_5_mtp"), spec_max_batch=8)
    (req,) = _requests(info)[3:4]
    runner.start(req)
    while runner.prefill(req.request_id, 8):
        pass
    runner.batch.max_batch = spec_max_batch
    for _ in range(4):
        runner.decode()
    drafter, row = runner.drafter, runner.batch.rows[0]
    if spec_max_batch == 0:
        assert len(drafter.tokens[0]) == 5  # 1 from the prompt + 4 plain steps
        runner.batch.max_batch = 8
        runner.decode()  # drafts again: the 5 waiting pairs go in first
        assert runner.spec_stats.steps == 1
    seq = row.tokens  # prompt + emitted; the last is not in the target cache yet
    hidden = Target(plain.model, split=True).hidden(mx.array(seq[:-1])[None], plain._make_cache())
    pending = len(drafter.tokens[0])
    assert drafter.tokens[0] == seq[len(seq) - pending :]
    assert mx.allclose(drafter.hidden[0], hidden[0, len(seq) - 1 - pending :], atol=1e-4)
    fed = len(seq) - 1 - pending  # pairs in the head's cache
    fresh = drafter.head.make_cache()
    drafter.head(drafter.embed(mx.array(seq[1 : fed + 1])[None]), hidden[:, :fed], fresh)
    c = runner.drafter.cache[0]
    keys = c.keys[0, :, c.left_padding[0].item() : c._idx]
    assert keys.shape[1] == fed
    assert mx.allclose(keys, fresh[0].keys[0, :, :fed], atol=1e-4)


@pytest.mark.mlx
def test_sampled_requests_with_an_exact_head(tiny_models):
    """Temperature > 0: the head's distribution equals the target's, so every draft is
    accepted by rejection sampling; a seed makes a request repeatable."""
    _, runner, info = mtp_runner(tiny_models("qwen3_5_mtp_exact"))
    assert_sampled_runs_repeat(runner, info)
    assert runner.spec_stats.acceptance_rate > 0.95


@pytest.mark.mlx
def test_prefix_cache_hits_start_the_head_without_a_hidden_state(tiny_models):
    """A prompt served whole from the prefix cache gives the head no hidden state for its
    last token: it drafts from zeros, and the output is still the plain output."""
    from mlxd.actors.engine.runner.prefix_cache import PrefixCache
    from mlxd.actors.engine.speculative.runner import SpeculativeRunner

    model_dir = tiny_models("qwen3_5_mtp_near")
    plain, runner, info = mtp_runner(model_dir)
    cached = SpeculativeRunner(
        plain.model,
        runner.drafter,
        sorted(info.tokenizer.eos_token_ids),
        8,
        num_draft=3,
        spec_max_batch=8,
        prefix_cache=PrefixCache(block_size=4, max_bytes=1 << 30),
    )
    requests = _requests(info)
    expected = alone(plain, requests)
    first, _ = drive(cached, _schedule(requests), prefill_chunk_tokens=8)
    again, failed = drive(cached, _schedule(requests), prefill_chunk_tokens=8)
    assert not failed and first == expected and again == expected
    assert cached.prefix_cache.stats.hits > 0


@pytest.mark.mlx
def test_load_runner_picks_the_drafter(tiny_models):
    """``drafter = "auto"``: the MTP head when the checkpoint has one, else the draft model;
    ``"mtp"`` on a model without a head turns speculation off and says why."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions

    def spec(model, **kw):
        settings = SpeculativeOptions(**kw)
        runner, info = load_runner(
            str(model), model, dequantize_on_cpu=True, max_batch=4, speculative=settings
        )
        return runner.spec_stats

    assert spec(tiny_models("qwen3_5_mtp")).drafter == "mtp"
    assert spec(tiny_models("qwen3_5_mtp"), drafter="draft_model").drafter.endswith("(self)")
    assert spec(tiny_models("llama")).drafter.endswith("(self)")
    off = spec(tiny_models("llama"), drafter="mtp")
    assert not off.enabled
    assert "no MTP support for 'llama'" in off.notes[0]


def test_expert_weights_are_stacked_like_mlx_lm():
    import mlx.core as mx
    from mlxd.actors.engine.speculative.mtp import _experts

    per_expert = {
        f"layers.0.mlp.experts.{e}.{p}.weight": mx.full((2, 3), e)
        for e in range(3)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    out = _experts({**per_expert, "fc.weight": mx.zeros((1,))})
    assert sorted(out) == [
        "fc.weight",
        "layers.0.mlp.switch_mlp.down_proj.weight",
        "layers.0.mlp.switch_mlp.gate_proj.weight",
        "layers.0.mlp.switch_mlp.up_proj.weight",
    ]
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"][:, 0, 0].tolist() == [0, 1, 2]
    fused = {
        "layers.0.mlp.experts.gate_up_proj": mx.concatenate(
            [mx.zeros((4, 2, 3)), mx.ones((4, 2, 3))], axis=1
        ),
        "layers.0.mlp.experts.down_proj": mx.zeros((4, 3, 2)),
    }
    out = _experts(fused)
    assert out["layers.0.mlp.switch_mlp.gate_proj.weight"].sum().item() == 0
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"].shape == (4, 2, 3)
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"].min().item() == 1


@pytest.mark.mlx
def test_vision_model_text_requests_speculate_with_mtp_images_decode_plainly(tiny_models):
    """A Qwen3.5 VLM whose text backbone has an MTP head: in one mixed schedule, text-only
    requests go through the speculative lane (drafted, verified), image requests through
    the plain batch, and every request's tokens equal plain decoding's."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions
    from mlxd.actors.engine.speculative.vlm_mtp import VlmMtpRunner
    from mlxd.actors.tokenizer import PromptBuilder

    from tests.test_vlm import LIMITS, mixed_requests

    model_dir = tiny_models("qwen3_5_vl_mtp")
    plain, info = load(model_dir)
    runner, _ = load_runner(
        str(model_dir),
        model_dir,
        dequantize_on_cpu=True,
        max_batch=8,
        speculative=SpeculativeOptions(),
    )
    assert isinstance(runner, VlmMtpRunner)
    builder = PromptBuilder(
        info.tokenizer,
        info.context_length,
        default_max_tokens=8,
        vocab_size=info.vocab_size,
        processor=info.processor,
        image_limits=LIMITS,
    )
    requests = mixed_requests(builder)
    expected = alone(plain, requests)
    schedule = {0: requests[:2], 1: requests[2:4], 3: requests[4:6], 6: requests[6:]}
    got, failed = drive(runner, schedule, prefill_chunk_tokens=8)
    assert not failed
    assert got == expected
    stats = runner.spec_stats
    assert stats is not None and stats.drafter == "mtp" and stats.enabled
    # Only the four text requests drafted: k per request per speculative step, at most.
    assert 0 < stats.drafted <= 3 * 4 * stats.steps
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)
    # A draft model cannot draft for a vision model (yet): off, and the status says why.
    off, _ = load_runner(
        str(model_dir),
        model_dir,
        dequantize_on_cpu=True,
        max_batch=8,
        speculative=SpeculativeOptions(drafter="draft_model"),
    )
    assert not off.spec_stats.enabled and "MTP head" in off.spec_stats.notes[0]
