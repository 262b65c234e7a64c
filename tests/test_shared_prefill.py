"""In-flight prefix sharing on real MLX models: K requests that share a long prefix and
arrive together compute it once. The first is prefilled; the others wait until it has
left a snapshot at the shared block boundary and start from it. Their answers equal those
with the prefix cache off, on SmolLM2 and on a hybrid (GatedDeltaNet) model, whose SSM
state can only be reused from an exact-boundary snapshot."""

from __future__ import annotations

import pytest
from mlxd.actors.engine.loading.load import load_runner
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.options import PrefixCacheOptions
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

pytestmark = pytest.mark.mlx

SHARED = tuple(range(1000, 1000 + 300))  # 4 full 64-token blocks and a bit
SUFFIXES = {"a0": (5, 6, 7), "a1": (8, 9), "a2": (10, 11, 12, 13), "a3": (14,)}


def requests():
    return [
        TokenizedRequest(
            request_id=rid,
            prompt_tokens=SHARED + suffix,
            sampling=SamplingParams(max_tokens=8, temperature=0.0),
        )
        for rid, suffix in SUFFIXES.items()
    ]


def run(runner, prefill_chunk_tokens=128):
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=prefill_chunk_tokens)
    for r in requests():
        core.submit(r)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    computed = 0
    while not core.idle:
        step = core.step()
        for s in step.started:
            cached[s.request_id] = s.cached_tokens
            computed += s.prefilled_tokens
        for t in step.tokens:
            tokens.setdefault(t.request_id, []).extend(t.tokens)
        assert not step.failed
    return tokens, cached, computed


@pytest.mark.parametrize("model", ["smollm", "qwen3_5"])
def test_requests_sharing_a_prefix_compute_it_once(model, smollm_tokenizer, tiny_models):
    path = smollm_tokenizer if model == "smollm" else tiny_models("qwen3_5")

    def load(prefix_cache):
        options = PrefixCacheOptions(block_size=64, max_bytes=1 << 30) if prefix_cache else None
        runner, _ = load_runner(
            str(path), path, dequantize_on_cpu=True, max_batch=8, prefix_cache=options
        )
        return runner

    plain, _, plain_computed = run(load(False))
    shared, cached, computed = run(load(True))
    assert shared == plain
    assert cached["a0"] == 0
    assert all(cached[rid] == 256 for rid in ("a1", "a2", "a3"))  # the shared 4 blocks
    assert plain_computed == sum(len(SHARED) + len(s) for s in SUFFIXES.values())
    assert computed == plain_computed - 3 * 256
