"""The sampling chain: the one place a sampled request's distribution is built.

Plain decoding (``runner.make_sampler``, the sampler ``BatchGenerator`` calls) and every
verifier of speculative decoding (``speculative.SpeculativeBatch``: the drafts it
samples and the target distribution it accepts them against) call ``scaled_logits``,
so the two cannot drift apart. The order is mlx-lm's ``make_sampler``'s: top-p,
min-p, top-k, then temperature. Logits processors (penalties, bias, a grammar mask)
run before it, where each caller applies them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlxd.protocol.messages import SamplingParams


def filtered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """``logprobs`` with the tokens the request's filters exclude set to ``-inf``."""
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def scaled_logits(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The distribution a sampled (not greedy) request draws from, as logits: its
    filters, then its temperature."""
    return filtered(logprobs, params) * (1.0 / params.temperature)
