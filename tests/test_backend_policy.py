"""The backend table (``actors/engine/backend_policy.py``): each backend's prefill defaults
reach the engine core and the loaded runner, and an explicit setting overrides them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlxd.actors.engine import actor, backend_policy
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import engine_options, load_options

from tests.fakes import FakeRunner


def _core(backend: str, **engine):
    options = engine_options(load_settings(None, {"engine": engine}), None)
    info = SimpleNamespace(kind="text", backend=backend, memory=None, vocab_size=10)
    return actor.core_for(FakeRunner(), info, 0, options)


@pytest.mark.parametrize(("backend", "chunk"), [("cpu", 512), ("cuda", 2048), ("metal", 2048)])
def test_the_chunk_comes_from_the_backend_row(backend, chunk):
    core = _core(backend)
    assert (core.prefill_chunk_tokens, core.prefill_unsplit_tokens) == (chunk, 128)


def test_an_explicit_chunk_overrides_the_table():
    core = _core("cuda", prefill_chunk_tokens=300, prefill_unsplit_tokens=0)
    assert (core.prefill_chunk_tokens, core.prefill_unsplit_tokens) == (300, 0)


def test_an_unknown_backend_gets_the_measured_cpu_row():
    assert backend_policy.for_backend("fake") == backend_policy.BACKENDS["cpu"]


@pytest.mark.parametrize(
    ("engine", "backend", "expected"),
    [
        ({}, "cpu", (False, 128)),  # only short rows share passes
        ({}, "cuda", (True, 0)),  # every row
        ({"batch_prefill_max_context": 64}, "cpu", (False, 64)),
        ({"batch_prefill_max_context": 64}, "metal", (True, 0)),  # the limit is the CPU's
        ({"batch_prefill": False}, "cuda", (False, 0)),
        ({"batch_prefill": True}, "cpu", (True, 0)),
    ],
)
def test_batched_prefill_follows_the_table_unless_set(engine, backend, expected):
    o = load_options(load_settings(None, {"engine": engine}))
    choice = backend_policy.prefill(
        backend,
        streams=o.prefill_streams,
        batch_prefill=o.batch_prefill,
        max_context=o.batch_prefill_max_context,
    )
    assert (choice.batch_every, choice.max_context) == expected


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("backend", "engine", "expected"),
    [
        ("cpu", {}, (2, 128, True)),
        ("cuda", {}, (1, None, True)),
        ("cuda", {"prefill_streams": 2, "batch_prefill": False}, (2, None, True)),
        ("cpu", {"batch_prefill_max_context": 0}, (2, None, False)),
    ],
)
def test_the_loaded_runner_takes_the_detected_backends_row(
    backend, engine, expected, tiny_models, monkeypatch
):
    from mlxd.actors.engine.loading.load import load_served

    monkeypatch.setattr(backend_policy, "detect", lambda: backend)
    monkeypatch.setattr(backend_policy.os, "cpu_count", lambda: 2)
    path = str(tiny_models("llama"))
    settings = load_settings(None, {"model": {"path": path}, "engine": engine})
    options = load_options(settings)
    runner, info = load_served(dataclasses.replace(options, cache_dir=Path(path)))
    got = (runner.prefill_streams, runner.batch_prefill_max_context, runner.batch_prefill_pays)
    assert info.backend == backend and got == expected
