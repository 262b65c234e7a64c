"""Checks on a request's sampling options before it joins a batch: MLX checks no indices,
so an option the model cannot run (a token id outside the vocabulary, ``top_k`` not below
it, an unusable seed, a non-finite number) is an ``InvalidRequest`` (a 400) here, before any
MLX op sees it. Plain Python: the scheduler calls it."""

from __future__ import annotations

import math

from mlxd.actors.engine.scheduler.types import InvalidRequest
from mlxd.protocol.messages import SamplingParams

MAX_SEED = 2**63 - 1


def check_sampling(params: SamplingParams, prompt: tuple[int, ...], vocab_size: int) -> None:
    """Raise ``InvalidRequest`` for any option this model cannot run; no MLX op has seen it."""
    floats = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    for name, value in floats.items():
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number", name)
    if not 0 <= params.top_k < vocab_size:
        raise InvalidRequest(f"top_k must be in [0, {vocab_size}) for this model", "top_k")
    bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            f"logit_bias token ids out of range [0, {vocab_size}): {bad[:5]}", "logit_bias"
        )
    if not all(math.isfinite(v) for v in params.logit_bias.values()):
        raise InvalidRequest("logit_bias values must be finite numbers", "logit_bias")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, {MAX_SEED}]", "seed")
    outside = [t for t in prompt if not 0 <= t < vocab_size]
    if outside:
        raise InvalidRequest(
            f"prompt token ids out of range [0, {vocab_size}): {outside[:5]}", "prompt"
        )
