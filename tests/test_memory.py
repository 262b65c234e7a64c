"""The memory estimator and budget: pure arithmetic, no MLX."""

from __future__ import annotations

import pytest
from mlxd.actors.engine.scheduler.memory import (
    AttentionLayer,
    MemoryModel,
    StateLayer,
    is_memory_error,
    kv_budget,
)

HYBRID = (
    AttentionLayer(bytes_per_token=100),
    StateLayer(state_bytes=5000),
    AttentionLayer(bytes_per_token=100, window=64),
    StateLayer(state_bytes=5000),
)


def test_attention_grows_per_token_state_is_fixed():
    m = MemoryModel(layers=HYBRID, budget_bytes=10**9, step=1)
    # 100 B/token × 30 tokens + windowed layer (30 < 64) + two fixed states
    assert m.request_bytes(10, 20) == 100 * 30 + 100 * 30 + 2 * 5000
    # past the window the sliding layer stops growing; the full layer does not
    assert m.request_bytes(100, 100) == 100 * 200 + 100 * 64 + 2 * 5000
    assert m.kv_bytes_per_token == 200
    assert m.state_bytes == 10_000


def test_tokens_round_up_to_the_cache_step():
    m = MemoryModel(layers=(AttentionLayer(bytes_per_token=10),), budget_bytes=10**9, step=256)
    assert m.request_bytes(1, 1) == 10 * 256
    assert m.request_bytes(200, 56) == 10 * 256
    assert m.request_bytes(200, 57) == 10 * 512


@pytest.mark.parametrize("budget", [0, 9_999, 10_000, 10_050, 25_000, 10**6])
def test_max_tokens_fitting_is_the_largest_that_fits(budget):
    m = MemoryModel(layers=HYBRID, budget_bytes=budget, step=1)
    fits = m.max_tokens_fitting(5, 1000)
    brute = max((n for n in range(1001) if m.request_bytes(5, n) <= budget), default=0)
    assert fits == brute


def test_too_large_message_has_the_numbers():
    m = MemoryModel(layers=HYBRID, budget_bytes=1 << 20, step=1)
    text = m.too_large_message(1000, 9000)
    assert "200 bytes per token" in text
    assert "1000 prompt + 9000 completion" in text
    assert "1.0 MiB" in text


def test_budget_is_device_share_minus_weights_and_headroom():
    gib = 1 << 30
    assert kv_budget(
        device_bytes=16 * gib, weights_bytes=4 * gib, fraction=0.75, headroom_bytes=gib
    ) == (7 * gib)
    explicit = kv_budget(
        device_bytes=gib, weights_bytes=4 * gib, fraction=0.5, headroom_bytes=0, explicit_bytes=123
    )
    assert explicit == 123
    with pytest.raises(ValueError, match="weights"):
        kv_budget(device_bytes=4 * gib, weights_bytes=4 * gib, fraction=0.9, headroom_bytes=0)


def test_memory_errors_are_recognised():
    assert is_memory_error(MemoryError())
    assert is_memory_error(RuntimeError("[metal::malloc] Attempting to allocate 123 bytes"))
    assert is_memory_error(
        RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory (out of memory)")
    )
    assert not is_memory_error(RuntimeError("shape mismatch"))
    assert not is_memory_error(ValueError("out of memory"))  # not an MLX runtime failure
