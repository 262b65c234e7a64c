"""One mapping of the settings onto the loader (``supervisor.load_options``).

``serve``, the ranks of ``serve --parallel`` and ``bench --engine`` each load with the
options it builds from one Settings: every loader, feature and engine option reaches
every path (the ranks leave out drafting and scoring, and use one prefill stream, on
purpose), and ``bench`` builds its engine core with the options ``serve`` gives it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from mlxd.actors.engine.scheduler.options import (
    EmbeddingOptions,
    LoadOptions,
    MemoryOptions,
    PrefixCacheOptions,
    SpecPrefillOptions,
    SpeculativeOptions,
)
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import engine_options, load_options, mlx_runner_factory

# Every setting the loader takes, each away from its default.
SETTINGS = {
    "model": {
        "path": "/models/m",
        "cache_dir": "/tmp/mlxd-cache",
        "dequantize_on_cpu": False,
        "kind": "text",
        "max_adapters": 3,
        "adapter_memory_mb": 64,
    },
    "engine": {
        "max_batch": 5,
        "prefill_chunk_tokens": 77,
        "batch_prefill": True,
        "prefill_streams": 3,
        "chunked_linear_attention": False,
        "kv_bits": 4,
        "kv_group_size": 32,
    },
    "prefix_cache": {
        "enabled": True,
        "block_size": 32,
        "max_bytes": 12345,
        "memory_fraction": 0.2,
        "affinity_keys": 3,
    },
    "memory": {
        "device_fraction": 0.5,
        "headroom_mb": 7,
        "kv_budget_mb": 9,
        "set_mlx_limit": False,
        "cache_limit_mb": 11,
    },
    "speculative": {"enabled": True, "drafter": "lookup", "num_draft_tokens": 4, "max_batch": 2},
    "spec_prefill": {"enabled": True, "threshold_tokens": 99, "keep_fraction": 0.5},
    "embeddings": {
        "normalize": False,
        "max_input_tokens": 321,
        "max_batch_inputs": 6,
        "max_batch_tokens": 999,
        "max_queued_inputs": 44,
    },
}

EXPECTED = LoadOptions(
    path="/models/m",
    cache_dir=Path("/tmp/mlxd-cache"),
    dequantize_on_cpu=False,
    max_batch=5,
    kind="text",
    max_adapters=3,
    adapter_memory_bytes=64 << 20,
    prefill_streams=3,
    chunked_linear_attention=False,
    batch_prefill=True,
    kv_bits=4,
    kv_group_size=32,
    prefix_cache=PrefixCacheOptions(
        block_size=32, max_bytes=12345, memory_fraction=0.2, affinity_keys=3
    ),
    memory=MemoryOptions(
        device_fraction=0.5, headroom_mb=7, kv_budget_mb=9, set_mlx_limit=False, cache_limit_mb=11
    ),
    speculative=SpeculativeOptions(drafter="lookup", num_draft_tokens=4, max_batch=2),
    spec_prefill=SpecPrefillOptions(threshold_tokens=99, keep_fraction=0.5),
    embedding=EmbeddingOptions(
        normalize=False,
        max_input_tokens=321,
        max_batch_inputs=6,
        max_batch_tokens=999,
        max_queued_inputs=44,
    ),
)


class Loaded(Exception):
    """Raised by the stand-in loader once it has seen the options."""


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_bytes(msgspec.toml.encode(SETTINGS))
    return path


@pytest.fixture
def loads(monkeypatch) -> list[tuple[LoadOptions, object]]:
    """What each load was asked for (options, shard); the load itself stops there."""
    from mlxd.actors.engine.loading import load as loading

    seen: list[tuple[LoadOptions, object]] = []

    def load_served(options, shard=None):
        seen.append((options, shard))
        raise Loaded

    monkeypatch.setattr(loading, "load_served", load_served)
    return seen


def test_load_options_map_every_setting(config):
    options = load_options(load_settings(config))
    assert options == EXPECTED
    defaults = LoadOptions(path="", cache_dir=Path(), dequantize_on_cpu=True, max_batch=32)
    unset = [
        f.name
        for f in dataclasses.fields(LoadOptions)
        if getattr(options, f.name) == getattr(defaults, f.name)
    ]
    # [model] has no adapter: see the [[models]] test; the context limit is auto's, below;
    # the disk tier comes with the daemon's store (test_disk_tier: the loader's key)
    assert unset == ["adapter_path", "batch_prefill_max_context", "disk_tier"]


@pytest.mark.parametrize(("batch_prefill", "limit"), [("auto", 99), (True, None), (False, None)])
def test_the_batched_prefill_context_limit_goes_with_auto_only(batch_prefill, limit):
    engine = {"batch_prefill": batch_prefill, "batch_prefill_max_context": 99}
    options = load_options(load_settings(None, {"engine": engine}))
    assert options.batch_prefill_max_context == limit


def test_serve_ranks_and_bench_load_with_the_same_options(config, loads, monkeypatch, tmp_path):
    from mlxd.actors.engine.distributed import replica
    from mlxd.actors.engine.loading import load as loading
    from mlxd.daemon import bench, ranks

    settings = load_settings(config)
    with pytest.raises(Loaded):
        mlx_runner_factory(settings)()
    with pytest.raises(Loaded):
        bench.run_engine([1], 4, config)
    monkeypatch.setattr(loading, "resolve_model_dir", lambda *a, **k: ("m", tmp_path))
    monkeypatch.setattr(replica, "model_fingerprint", lambda model_dir: b"")
    monkeypatch.setattr(replica, "check_same", lambda group, parts: None)
    monkeypatch.setattr(replica, "sharder", lambda parallel, group: "this rank's shard")
    with pytest.raises(Loaded):
        ranks._load(settings, None, leader=True)
    (serve, _), (benched, _), (rank, shard) = loads
    assert serve == benched == EXPECTED
    # every rank drafts and scores nothing, and prefills on one stream; all else is serve's
    assert rank == dataclasses.replace(
        serve, speculative=None, spec_prefill=None, prefill_streams=1
    )
    assert rank.chunked_linear_attention is False and shard == "this rank's shard"


def test_bench_builds_the_engine_core_serve_builds(config, monkeypatch):
    from mlxd.actors.engine import actor
    from mlxd.actors.engine.loading import load as loading
    from mlxd.daemon import bench

    info = SimpleNamespace(memory=None, vocab_size=10, tokenizer=None)
    monkeypatch.setattr(loading, "load_served", lambda options, shard=None: ("runner", info))
    cores = []

    def core_for(runner, info, max_batch, options):
        cores.append((runner, max_batch, options))
        raise Loaded

    monkeypatch.setattr(actor, "core_for", core_for)
    with pytest.raises(Loaded):
        bench.run_engine([1], 4, config)
    ((runner, max_batch, options),) = cores
    assert runner == "runner" and max_batch == 0  # 0: the engine's max_batch
    assert options == engine_options(load_settings(config), None)
    assert (options.max_batch, options.prefill_chunk_tokens, options.batch_prefill) == (5, 77, True)


def test_a_models_entry_brings_its_own_path_batch_adapter_and_features(tmp_path):
    entry = {
        "id": "a",
        "path": "/models/a",
        "kind": "vision",
        "adapter_path": str(tmp_path / "lora"),
        "max_adapters": 2,
        "max_batch": 3,
        "speculative": {"enabled": True, "drafter": "mtp", "num_draft_tokens": 2},
        "spec_prefill": {"enabled": False},
    }
    model = {k: v for k, v in SETTINGS["model"].items() if k != "path"}  # entries name theirs
    overrides = {**SETTINGS, "model": model, "models": [entry, {"id": "b"}]}
    settings = load_settings(overrides=overrides)
    a, b = (load_options(settings, e) for e in settings.model_entries())
    assert (a.path, a.kind, a.max_batch, a.adapter_path) == (
        "/models/a",
        "vision",
        3,
        tmp_path / "lora",
    )
    assert a.speculative == SpeculativeOptions(drafter="mtp", num_draft_tokens=2)
    assert a.spec_prefill is None
    assert (b.path, b.max_batch, b.adapter_path) == ("", 5, None)
    # an entry's adapter limits, else [model]'s
    assert (a.max_adapters, a.adapter_memory_bytes) == (2, 64 << 20)
    assert (b.max_adapters, b.adapter_memory_bytes) == (3, 64 << 20)
    assert b.speculative == EXPECTED.speculative
    rest = ("prefill_streams", "chunked_linear_attention", "prefix_cache", "memory")
    assert all(getattr(a, k) == getattr(b, k) == getattr(EXPECTED, k) for k in rest)
