"""One sampling chain (``actors/engine/runner/sampling.py``) for plain decoding and the verifiers.

For the same params and seed, the plain sampler ``BatchGenerator`` calls, the bonus token
a speculative verify pass draws, and the draft tokens a drafter samples come from the
same distribution with the same keys: token for token equal draws over a vocabulary where
every filter (top-p, min-p, top-k) and the temperature change the answer.
"""

from __future__ import annotations

import pytest
from mlxd.protocol.messages import SamplingParams

pytestmark = pytest.mark.mlx

PARAMS = [
    SamplingParams(temperature=0.7, top_k=3, seed=1),
    SamplingParams(temperature=1.3, top_p=0.6, seed=2),
    SamplingParams(temperature=0.9, min_p=0.2, seed=3),
    SamplingParams(temperature=0.5, top_p=0.9, min_p=0.05, top_k=5, seed=4),
    SamplingParams(temperature=2.0, seed=5),
]
DRAWS = 100


def _logprobs():
    import mlx.core as mx

    logits = mx.array([3.0, 2.5, 2.2, 1.9, 1.0, 0.7, 0.2, -0.5, -1.0, -2.0])
    return logits - mx.logsumexp(logits)


def _batch(params: SamplingParams):
    """A speculative batch of one row whose verifier can be called without a model."""
    import mlx.core as mx
    from mlxd.actors.engine.speculative.batch import Drafter, SpecRow, SpeculativeBatch
    from mlxd.protocol.messages import SpeculativeCounters

    batch = SpeculativeBatch(
        None, Drafter(), num_draft=0, max_batch=1, stop_tokens=(), stats=SpeculativeCounters()
    )
    row = SpecRow("r", [1], 10**6, params, key=mx.random.key(params.seed))
    batch.rows = [row]
    return batch


def _plain(params: SamplingParams, rows: bool = False) -> list[int]:
    """The plain sampler's draws, over ``[V]`` or (``rows``) ``[1, V]`` logprobs: a draw
    depends on the shape its key is used for, so each comparison matches its caller's."""
    from mlxd.actors.engine.runner.base import make_sampler

    sample, logprobs = make_sampler(params), _logprobs()
    logprobs = logprobs[None] if rows else logprobs
    return [int(sample(logprobs).item()) for _ in range(DRAWS)]


@pytest.mark.parametrize("params", PARAMS)
def test_verifier_draws_as_plain_decoding(params):
    """The verify pass's bonus token (no drafts) equals the plain sampler's draw."""
    batch, logits = _batch(params), _logprobs()[None, None]  # [B, 1, V]
    verified = [batch._accept(logits, [[]], [[]])[1][0] for _ in range(DRAWS)]
    assert verified == _plain(params)


@pytest.mark.parametrize("params", PARAMS)
def test_drafter_samples_as_plain_decoding(params):
    """A drafter's sampled tokens, and the distribution it records for rejection sampling,
    come from the same chain."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.sampling import scaled_logits

    batch, logits = _batch(params), _logprobs()[None]  # [B, V]
    q: list[list] = [[]]
    drafted = [int(batch._draft_tokens(logits, q)[0].item()) for _ in range(DRAWS)]
    assert drafted == _plain(params, rows=True)
    want = mx.softmax(scaled_logits(_logprobs(), params))
    assert mx.allclose(q[0][0], want).item()


def test_each_filter_changes_the_draws():
    """The comparison above is not vacuous: each param alone changes the sampled tokens."""
    base = SamplingParams(temperature=1.0, seed=9)
    plain = _plain(base)
    for change in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.3}, {"temperature": 0.3}):
        other = SamplingParams(**{"temperature": 1.0, "seed": 9, **change})
        assert _plain(other) != plain, change
