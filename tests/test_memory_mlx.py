"""The runner's memory probe on a tiny random-weight hybrid model (attention + conv state)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def hybrid():
    import mlx.core as mx
    from mlx_lm.models import lfm2

    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=64,
        full_attn_idxs=[1, 3],
    )
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    return model


def test_probe_tells_attention_from_recurrent_layers(hybrid):
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.actors.engine.scheduler.memory import AttentionLayer, StateLayer

    layers = MlxRunner(hybrid, [0], 2).probe_layers()
    assert [type(layer) for layer in layers] == [StateLayer, AttentionLayer] * 2
    # keys + values: 2 KV heads × head_dim 8 × float32
    assert all(layer.bytes_per_token == 2 * 2 * 8 * 4 for layer in layers[1::2])
    assert all(layer.state_bytes > 0 for layer in layers[::2])


@pytest.mark.parametrize("prompt", [40, 300])
def test_estimate_equals_the_cache_a_prompt_really_fills(hybrid, prompt):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.actors.engine.scheduler.memory import MemoryModel

    memory = MemoryModel(layers=MlxRunner(hybrid, [0], 2).probe_layers(), budget_bytes=1 << 30)
    cache = make_prompt_cache(hybrid)
    hybrid(mx.array([[t % 63 + 1 for t in range(prompt)]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert memory.request_bytes(prompt, 0) == sum(c.nbytes for c in cache)
