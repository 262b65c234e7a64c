"""Quantized KV inside the continuous batch (``engine.kv_bits``, ``runner/kv_quant.py``).

On tiny random models whose attention heads take a 32-value group (dense llama, a
GatedDeltaNet hybrid, a sliding-window model with conv state) and on SmolLM2, at 8 and
4 bits: the attention layers really hold quantized packs (and the hybrid's SSM state
does not), a row decoded alone equals the same row decoded in a batch with others of
other lengths (chunked and batched prefill included), a prefix-cache hit equals the
miss, speculative decoding (prompt lookup, a draft model, an MTP head; all with
rollback) equals plain decoding, and the memory gate and ``/v1/status`` count the
quantized bytes per token. Greedy output with quantized KV is compared with itself
(the same math on every path), not with full precision.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import trio

pytestmark = pytest.mark.mlx

GROUP = 32
PROMPTS = {
    "a": tuple(range(300, 337)),  # 37 tokens
    "b": tuple(range(500, 550)),  # 50
    "c": (900, 901, 902, 903, 904),  # 5
    # repeats itself: prompt lookup finds drafts, some accepted, some rolled back
    "d": (7, 8, 9, 10, 11, 12) * 6,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm_tokenizer):
    """Tiny models whose head size (32) a quantization group divides."""
    from mlxd.scripts import tiny_models as tm

    root = tmp_path_factory.mktemp("kvq")
    two_heads = {"num_attention_heads": 2, "num_key_value_heads": 1}  # 64 / 2 = 32
    configs = {
        "llama": {**tm.LLAMA, **two_heads},
        "llama_near": {**tm.LLAMA, **two_heads},
        "qwen3_5": {**tm.QWEN3_5, "head_dim": 32},
        "baichuan_m1": {**tm.BAICHUAN_M1, **two_heads},
    }
    out = {"smollm": smollm_tokenizer}
    for name, config in configs.items():
        noise = 0.1 if name == "llama_near" else 0.0  # a draft that agrees only sometimes
        out[name] = tm.build_text_model(config, smollm_tokenizer, root / name, noise=noise)
    mtp = {**tm.QWEN3_5_MTP, "head_dim": 32}
    out["qwen3_5_mtp"] = tm.build_mtp_model(mtp, smollm_tokenizer, root / "mtp", residual=0.05)
    return out


def load(path, bits, **options):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import PrefixCacheOptions

    options.setdefault("prefix_cache", PrefixCacheOptions(block_size=16, max_bytes=1 << 30))
    return load_runner(
        str(path), path, dequantize_on_cpu=True, max_batch=8, kv_bits=bits, kv_group_size=GROUP,
        **options,
    )  # fmt: skip


def leaves(cache):
    return [x for c in cache for x in (c.caches if hasattr(c, "caches") else (c,))]


def run(runner, prompts, *, batch_prefill=False, chunk=16, max_tokens=10):
    from mlxd.actors.engine.scheduler.core import EngineCore

    from tests.engine_driver import request, until_idle

    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=chunk, batch_prefill=batch_prefill)
    for rid, prompt in prompts.items():
        core.submit(request(rid, prompt, max_tokens=max_tokens))
    out = until_idle(core)
    assert runner.cache_bytes == 0  # the engine is idle: no request holds KV
    return out


def alone(runner, prompts, **kwargs):
    out = {}
    for rid, prompt in prompts.items():
        out |= run(runner, {rid: prompt}, **kwargs)
    return out


# (model, quantized attention layers, other layers) of each layout
LAYOUTS = {"smollm": (30, 0), "llama": (4, 0), "qwen3_5": (2, 2), "baichuan_m1": (2, 6)}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("model", ["smollm", "llama", "qwen3_5", "baichuan_m1"])
def test_batch_equals_alone_and_hit_equals_miss(models, model, bits):
    """Quantized attention layers, full-precision SSM state; each row decoded alone (its
    prompt prefilled in chunks) == decoded in a batch with rows of other lengths, every
    prompt resumed from a prefix-cache hit == the misses."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache
    from mlxd.actors.engine.runner.kv_quant import QuantizedRowCache, quantized_layers

    runner, _ = load(models[model], bits)
    quantized, other = LAYOUTS[model]
    assert quantized_layers(runner._make_cache()) == quantized
    assert len(leaves(runner._make_cache())) - quantized == other
    prompts = PROMPTS if model != "smollm" else {k: PROMPTS[k] for k in "abc"}
    first = alone(runner, prompts)
    assert runner.prefix_cache.stats.hits == 0
    snapshot = next(iter(runner.prefix_cache._entries.values())).snapshot
    for layer in leaves(snapshot):
        if isinstance(layer, QuantizedRowCache):
            packs, scales, _ = layer.keys
            assert packs.dtype == mx.uint32 and layer.bits == bits
            assert packs.shape[-1] * 32 // bits == scales.shape[-1] * GROUP  # the head size
        elif isinstance(layer, ArraysCache):  # SSM / conv state: the model's precision
            assert all(a.dtype == mx.float32 for a in layer.cache if a is not None)
    together = run(runner, prompts)  # every prompt is now a hit, decoded in one batch
    assert runner.prefix_cache.stats.hits == len(prompts)
    assert together == first


def dequantized(layer):
    import mlx.core as mx

    def one(packs):
        return mx.dequantize(*packs, group_size=layer.group_size, bits=layer.bits)

    return one(layer.keys)[..., : layer.offset, :], one(layer.values)[..., : layer.offset, :]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("model", ["smollm", "qwen3_5", "baichuan_m1"])
@pytest.mark.parametrize("padded", [False, True])
def test_batched_prefill_keeps_each_rows_kv(models, model, bits, padded):
    """Rows prefilled together (quantized caches merged, right padding rolled left, rows
    extracted) hold what each row's own prefill holds. Not bit for bit: a pass over
    several rows runs other matmul shapes (OpenBLAS picks kernels by shape), so a key can
    differ in its last float bit and land one quantization step away, which later layers
    and later layers (SSM state too) carry on; the mean difference stays a few percent of
    the mean value, where a misplaced row or padding would differ by about 100%. Greedy tokens are compared where the math is
    the same path (the test above)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache
    from mlxd.actors.engine.runner.base import Pending
    from mlxd.actors.engine.runner.kv_quant import QuantizedRowCache

    from tests.engine_driver import request

    runner, _ = load(models[model], bits, prefix_cache=None)
    runner.batch_prefill_max_context = 128 if padded else None
    prompts = {k: PROMPTS[k] for k in "abc"}
    rows = [(Pending(request(k, p), runner._make_cache()), len(p) - 1) for k, p in prompts.items()]
    together = runner._prefill_rows(rows)
    for (pending, n), got in zip(rows, together, strict=True):
        own = runner._make_cache()
        runner.model(mx.array([pending.request.prompt_tokens[:n]]), cache=own)
        for mine, theirs in zip(leaves(own), leaves(got), strict=True):
            # Full-precision SSM state. (Not Baichuan-M1's conv state after a right-padded
            # pass: its model code stores the last fed token's, padding or not, at any kv_bits.)
            if isinstance(mine, ArraysCache) and not (padded and model == "baichuan_m1"):
                assert all(close(a, b) for a, b in zip(mine.cache, theirs.cache, strict=True))
            if not isinstance(mine, QuantizedRowCache):
                continue  # (a rotating window's layout differs after one long pass)
            assert theirs.offset == mine.offset == n
            pairs = zip(dequantized(mine), dequantized(theirs), strict=True)
            assert all(close(a, b) for a, b in pairs)


def close(a, b) -> bool:
    """Mean difference under 10% of the mean value (a misplaced row: about 100%)."""
    import mlx.core as mx

    return mx.abs(a - b).mean().item() <= 0.1 * mx.abs(a).mean().item()


SPEC = {
    "lookup": ("llama", {"drafter": "lookup"}),
    "draft_model": ("llama", {"drafter": "draft_model", "draft_model": "llama_near"}),
    "lookup_hybrid": ("qwen3_5", {"drafter": "lookup"}),
    "mtp": ("qwen3_5_mtp", {"drafter": "mtp"}),
}


@pytest.mark.parametrize("kind", list(SPEC))
def test_speculative_equals_plain(models, kind):
    """Drafts verified on quantized KV and rolled back where rejected: greedy output is
    the plain quantized runner's, token for token."""
    from mlxd.actors.engine.runner.kv_quant import quantized_layers
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions

    model, options = SPEC[kind]
    if "draft_model" in options:
        options = {**options, "draft_model": str(models[options["draft_model"]])}
    plain, _ = load(models[model], 8, prefix_cache=None)
    spec, _ = load(models[model], 8, prefix_cache=None, speculative=SpeculativeOptions(**options))
    assert spec.spec_stats.enabled, spec.spec_stats.notes
    assert quantized_layers(spec._make_cache()) == quantized_layers(plain._make_cache()) > 0
    expected = alone(plain, PROMPTS, max_tokens=12)
    assert run(spec, PROMPTS, max_tokens=12) == expected
    stats = spec.spec_stats
    assert stats.accepted < stats.drafted  # some drafts rolled back
    assert stats.accepted > 0 or kind == "lookup_hybrid"  # (its random model never repeats)


def test_memory_gate_counts_quantized_bytes(models):
    """bytes per token = per value bits/8 + a scale and a bias per group, in every
    attention layer; the gate's per-request estimate follows."""
    from mlxd.actors.engine.scheduler.options import MemoryOptions

    memory = MemoryOptions(kv_budget_mb=64, set_mlx_limit=False)
    full = load(models["qwen3_5"], 0, memory=memory)[1].memory
    values = 2 * 2 * 32 * 2  # keys + values, 2 KV heads of 32, 2 attention layers
    assert full.kv_bytes_per_token == values * 4  # float32
    for bits in (8, 4):
        info = load(models["qwen3_5"], bits, memory=memory)[1]
        per_token = values * bits // 8 + values // GROUP * 2 * 4  # packs + scales + biases
        assert info.memory.kv_bytes_per_token == per_token
        assert info.memory.state_bytes == full.state_bytes  # SSM state: full precision
        assert info.memory.request_bytes(1000, 24) < full.request_bytes(1000, 24)


def test_a_group_that_does_not_divide_the_heads_is_a_load_error(tiny_models):
    """The stock tiny llama's heads hold 16 values: no 32-value group fits."""
    with pytest.raises(ValueError, match="kv_group_size 32 does not divide"):
        load(tiny_models("llama"), 8)


@pytest.mark.parametrize(
    ("text", "match"),
    [("kv_bits = 3", "engine.kv_bits: 4 or 8"), ("kv_group_size = 48", "engine.kv_group_size")],
)
def test_bad_settings_are_clear_errors(tmp_path, text, match):
    from mlxd.daemon.settings import SettingsError, load_settings

    path = tmp_path / "c.toml"
    path.write_text(f"[engine]\n{text}\n")
    with pytest.raises(SettingsError, match=match):
        load_settings(path)


def test_a_broken_contract_falls_back_to_full_precision(models, monkeypatch, caplog):
    from mlxd.actors.engine.runner import kv_quant

    monkeypatch.setattr(kv_quant, "_version_ok", lambda: "mlx-vlm 9.9 is outside the range")
    runner, _ = load(models["llama"], 8)
    assert kv_quant.quantized_layers(runner._make_cache()) == 0
    assert "full precision instead: mlx-vlm 9.9" in caplog.text


async def test_status_reports_quantized_bytes_per_token(models, tmp_path):
    """Two models in one daemon, both loaded through ``supervisor.load_options`` with
    ``engine.kv_bits = 4``: /v1/status reports the quantized bytes per token."""
    from mlxd.daemon.app import create_app
    from mlxd.daemon.settings import load_settings
    from mlxd.daemon.supervisor import open_graph, run_actors

    raw = msgspec.to_builtins(load_settings())
    raw["model"]["cache_dir"] = str(tmp_path)
    raw["engine"] |= {"kv_bits": 4, "kv_group_size": GROUP}
    raw["models"] = [{"id": n, "path": str(models[n])} for n in ("llama", "qwen3_5")]
    settings = msgspec.convert(raw, type=type(load_settings()))
    graph = open_graph(settings)
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_actors, graph, settings, None)
            client = create_app(graph.pipeline, settings).test_client()
            for model in ("llama", "qwen3_5"):
                r = await client.post("/v1/completions", json={**body, "model": model})
                assert r.status_code == 200, await r.get_data()
            status = json.loads(await (await client.get("/v1/status")).get_data())
            nursery.cancel_scope.cancel()
    # keys + values of one 32-value KV head per attention layer, at 4 bits + scales, biases
    per_layer = 2 * 32 // 2 + 2 * 32 // GROUP * 2 * 4
    assert status["memory"]["kv_bytes_per_token"] == 4 * per_layer  # the default: llama
    # qwen3_5: 2 attention layers of 2 KV heads
    assert graph.pipeline.model_info("qwen3_5").memory.kv_bytes_per_token == 4 * per_layer
