"""Hybrid-cache models (SSM / linear-attention state mixed with attention) in one batch.

Tiny random-weight models with a real tokenizer (``scripts/tiny_models.py``):
``qwen3_5`` interleaves GatedDeltaNet layers (ArraysCache) with full attention
(KVCache); ``baichuan_m1`` gives every layer a CacheList of a conv state
(ArraysCache) and a KV cache, a RotatingKVCache (window 8, shorter than most
prompts here) on its sliding-window layers.
"""

from __future__ import annotations

import pytest
from mlxd.actors.engine.runner.caches import (
    RowDeltas,
    UnbatchableCache,
    can_trim,
    check_batchable,
    layer_kinds,
    trim,
)

from tests.engine_driver import alone, drive, load, request

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
    "The three primary colors are red, yellow and",
    "My favourite recipe for a quick weeknight dinner with friends and family starts with",
    "Q: What is 2 + 2?\nA:",
]


@pytest.fixture(scope="module", params=["qwen3_5", "baichuan_m1"])
def hybrid(request, tiny_models):
    runner, info = load(tiny_models(request.param))
    return request.param, runner, info


def _requests(info, max_tokens=(12, 5, 9, 12, 3, 12, 7, 10)):
    encode = info.tokenizer.encode
    return [
        request(f"r{i}", encode(p), m)
        for i, (p, m) in enumerate(zip(PROMPTS, max_tokens, strict=True))
    ]


def _stages(runner):
    return runner.decoding, runner.prefilling_count, runner.cache_bytes


@pytest.mark.mlx
def test_cache_layout_is_hybrid(hybrid):
    name, runner, _ = hybrid
    kinds = layer_kinds(runner._make_cache())
    expected = {
        "qwen3_5": ["ArraysCache×2", "KVCache×2"],
        "baichuan_m1": ["CacheList(ArraysCache+KVCache)", "CacheList(ArraysCache+RotatingKVCache)"],
    }[name]
    assert all(k in kinds for k in expected), kinds


@pytest.mark.mlx
def test_alone_equals_plain_mlx_lm_generation(hybrid):
    """The per-request prefill + batch join path gives mlx-lm's own greedy tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    _, runner, info = hybrid
    requests = _requests(info)[:4]
    ours = alone(runner, requests)
    for r in requests:
        n = r.sampling.max_tokens
        steps = generate_step(mx.array(r.prompt_tokens), runner.model, max_tokens=n)
        reference = [int(token) for token, _ in steps]
        assert ours[r.request_id] == reference[: len(ours[r.request_id])], r.request_id
        assert len(ours[r.request_id]) == n or reference[len(ours[r.request_id])] in (
            info.tokenizer.eos_token_ids
        )


@pytest.mark.mlx
def test_eight_requests_joining_at_different_steps_equal_alone(hybrid):
    """8 prompts of different lengths join at different steps, finish at different steps."""
    _, runner, info = hybrid
    requests = _requests(info)
    expected = alone(runner, requests)
    joins = [0, 0, 1, 2, 3, 5, 8, 13]
    schedule: dict[int, list] = {}
    for step, r in zip(joins, requests, strict=True):
        schedule.setdefault(step, []).append(r)
    batched, failed = drive(runner, schedule)
    assert not failed
    assert batched == expected
    assert len({len(t) for t in expected.values()}) > 3  # they really finish at different steps
    assert _stages(runner) == (0, 0, 0)


@pytest.mark.mlx
def test_leaving_and_joining_mid_batch_leaves_others_unchanged(hybrid):
    """An abort mid-decode and mid-prefill, and late joiners, change no one else's tokens."""
    _, runner, info = hybrid
    requests = _requests(info, max_tokens=(12,) * 8)
    expected = alone(runner, requests)
    schedule = {0: requests[:4], 4: requests[4:6], 9: requests[6:]}
    aborts = {3: ["r1"], 5: ["r5"]}  # r1 while decoding, r5 before its prefill finished
    batched, failed = drive(runner, schedule, aborts, prefill_chunk_tokens=4)
    assert not failed
    for rid, tokens in expected.items():
        if rid in ("r1", "r5"):
            assert batched.get(rid, []) == tokens[: len(batched.get(rid, []))]
        else:
            assert batched[rid] == tokens, rid
    assert _stages(runner) == (0, 0, 0)


@pytest.mark.mlx
def test_trim_only_when_every_layer_can(hybrid):
    _, runner, info = hybrid
    cache = runner._make_cache()
    import mlx.core as mx

    runner.model(mx.array(info.tokenizer.encode("one two three four"))[None], cache=cache)
    assert not can_trim(cache)  # SSM state cannot be rewound
    before = [c.nbytes for c in cache]
    assert trim(cache, 2) == 0
    assert [c.nbytes for c in cache] == before


@pytest.mark.mlx
def test_unbatchable_cache_is_refused_at_start_up():
    """A layer without merge (e.g. QuantizedKVCache) is named in a start-up error."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache

    check_batchable([KVCache(), ArraysCache(2)], [KVCache(), ArraysCache(2)])
    with pytest.raises(UnbatchableCache, match=r"layer 1 \(QuantizedKVCache\) lacks merge"):
        check_batchable([KVCache(), QuantizedKVCache()], [KVCache(), QuantizedKVCache()])
    nested = [CacheList(ArraysCache(2), QuantizedKVCache())]
    with pytest.raises(UnbatchableCache, match="layer 0"):
        check_batchable(nested, [CacheList(ArraysCache(2), QuantizedKVCache())])


@pytest.mark.mlx
def test_quantized_kv_model_fails_to_load_with_a_clear_message(tiny_models):
    from mlx_lm.models.cache import QuantizedKVCache
    from mlxd.actors.engine.runner.base import MlxRunner

    runner, _ = load(tiny_models("qwen3_5"))

    class QuantizedKV:
        """The tiny model, but asking for a quantized KV cache on every layer."""

        def __init__(self, model):
            self.model = model
            self.layers = model.layers

        def __call__(self, *args, **kwargs):
            return self.model(*args, **kwargs)

        def make_cache(self):
            return [QuantizedKVCache() for _ in self.layers]

    with pytest.raises(UnbatchableCache, match="QuantizedKVCache"):
        MlxRunner(QuantizedKV(runner.model), [0], 4)


@pytest.mark.mlx
def test_row_deltas_follow_their_rows():
    import mlx.core as mx

    a, b, c = (RowDeltas(mx.array([[v]])) for v in (1, 2, 3))
    batch = RowDeltas.merge([a, b])
    batch.extend(c)
    batch.filter([0, 2])
    assert batch.values.tolist() == [[1], [3]]
    assert batch.extract(1).values.tolist() == [[3]]
