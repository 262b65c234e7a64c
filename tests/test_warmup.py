"""Warm-up before "ready" (``scheduler/warmup.py``, ``engine.warmup``): the serving shapes
run on a throwaway core before a model's first request, on the fake runner (order, the
shapes, the setting) and on a tiny real model (the prefix cache stays empty, no output
changes)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlxd.actors.engine import actor as engine
from mlxd.actors.engine.backend_policy import for_backend
from mlxd.actors.engine.scheduler import warmup
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.daemon.supervisor import engine_options
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.conftest import chat, collect, running_graph, settings_with, text_of
from tests.fakes import FakeRunner
from tests.test_models_multi import FakeModel, answer, multi_settings, served, states


@dataclass
class WarmingRunner(FakeRunner):
    """A fake runner that can be warmed up: it records what happened, in order."""

    log: list[str] = field(default_factory=list)
    warm: bool = False  # inside ``warming_up``

    @contextlib.contextmanager
    def warming_up(self):
        self.warm = True
        self.log.append("warm-up")
        try:
            yield
        finally:
            self.warm = False
            self.log.append("warmed")

    def start(self, request: TokenizedRequest) -> int:
        assert request.request_id.startswith("warmup-") == self.warm
        if not self.warm:
            self.log.append(request.request_id)
        return super().start(request)


def test_the_plan_follows_the_setting_and_the_backend_table():
    # auto: the CPU's small set (batches of 2 and 1, no full chunk); a GPU's: every size
    assert warmup.plan(for_backend("cpu"), None, 32, None, 512) == warmup.WarmupPlan(batch=2)
    assert warmup.plan(for_backend("cuda"), None, 32, None, 2048) == warmup.WarmupPlan(
        32, 64, 2048 + 64
    )
    assert (
        warmup.plan(for_backend("metal"), None, 8, 4, 2048).batch == 4
    )  # the cap, within max_batch
    # true: every batch size up to the cap (0 or "auto": max_batch) and a full chunk
    assert warmup.plan(for_backend("cpu"), True, 16, None, 512) == warmup.WarmupPlan(16, 64, 576)
    assert warmup.plan(for_backend("cpu"), True, 16, 64, 512).batch == 16
    assert warmup.plan(for_backend("cuda"), False, 32, None, 2048) is None


def test_the_warm_up_meets_every_batch_size_and_leaves_the_core_idle():
    runner = WarmingRunner(step_delay=0)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=100, prefill_unsplit_tokens=128)
    with runner.warming_up():
        done = warmup.run(core, warmup.WarmupPlan(5, short_tokens=20, long_tokens=130), 5000)
    assert set(runner.batch_sizes) == {1, 2, 3, 4, 5}
    assert [rid for rid, _ in runner.prefill_log[:2]] == ["warmup-long"] * 2  # chunk, tail
    assert core.idle and core.reserved_bytes == 0 and not runner.running
    assert (done.max_batch, done.prompt_tokens) == (5, (130, 20))


async def test_ready_comes_after_the_warm_up_and_requests_after_it():
    runner = WarmingRunner()
    async with running_graph(runner=runner) as (pipeline, _):
        assert runner.log == ["warm-up", "warmed"]  # before "ready"
        ran = [rid for rid, _ in runner.prefill_log]
        assert ran and all(rid.startswith("warmup-") for rid in ran)
        assert set(runner.batch_sizes) == {1, 2}  # "auto" on the fake's (the CPU's) row
        stats = pipeline.engine_stats  # the served core saw none of it
        assert (stats.steps, stats.decode_steps, stats.kv_reserved) == (0, 0, 0)
        info = pipeline.models.info(pipeline.models.default)
        assert info.warmup is not None and info.warmup.max_batch == 2
        events = await collect(await pipeline.submit(chat("r1", "hi", max_tokens=8)))
        assert text_of(events) == "HI"
    assert runner.log == ["warm-up", "warmed", "r1"]


async def test_the_setting_turns_it_off():
    runner = WarmingRunner()
    settings = settings_with(engine={"warmup": False})
    async with running_graph(settings, runner=runner) as (pipeline, _):
        info = pipeline.models.info(pipeline.models.default)
        assert runner.log == [] and runner.decode_steps == 0 and info.warmup is None


async def test_a_model_loaded_on_demand_warms_up_before_its_first_request():
    a, b = FakeModel(runner=WarmingRunner()), FakeModel(runner=WarmingRunner())
    settings = multi_settings("a", "b")
    settings.engine.warmup = True
    settings.engine.warmup_max_batch = 3
    async with served(settings, {"a": a, "b": b}) as (c, _):
        assert b.runner.log == []
        assert await answer(c, "b", "hello") == "HELLO"
        status = (await states(c))["b"]
    assert b.runner.log[:2] == ["warm-up", "warmed"] and len(b.runner.log) == 3
    assert set(b.runner.batch_sizes) == {1, 2, 3}  # every size up to the cap
    assert status["model"]["warmup"]["max_batch"] == 3
    assert status["model"]["warmup"]["prompt_tokens"] == [512 + 64, 64]


# ---- a tiny real model -------------------------------------------------------------------


def _requests(salt: str) -> list[TokenizedRequest]:
    prompts = [tuple(range(40 + 7 * i, 100 + 7 * i)) for i in range(3)]
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    return [
        TokenizedRequest(
            request_id=f"{salt}{i}", prompt_tokens=p, sampling=seeded if i == 2 else greedy
        )
        for i, p in enumerate(prompts)
    ]


def _answers(runner, info, salt: str) -> dict[str, list[int]]:
    core = engine.core_for(runner, info, 4, engine_options(settings_with(), None))
    for request in _requests(salt):
        core.submit(request)
    out: dict[str, list[int]] = {}
    while not core.idle:
        for t in core.step().tokens:
            out.setdefault(t.request_id.removeprefix(salt), []).extend(t.tokens)
    return out


@pytest.mark.mlx
def test_a_real_warm_up_keeps_the_cache_empty_and_changes_no_answer(tiny_models):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import PrefixCacheOptions

    def load():
        path = Path(tiny_models("llama"))
        cache = PrefixCacheOptions(block_size=16, max_bytes=64 << 20)
        return load_runner(str(path), path, dequantize_on_cpu=True, max_batch=4, prefix_cache=cache)

    cold_runner, cold_info = load()
    cold = _answers(cold_runner, cold_info, "c")
    del cold_runner
    runner, info = load()
    options = engine_options(settings_with(engine={"warmup": True}), None)
    warmed = engine.warm_up(runner, info, 4, options)
    assert warmed.warmup is not None and warmed.warmup.max_batch == 4
    counters = runner.prefix_cache.counters()
    assert (counters.entries, counters.hits, counters.misses) == (0, 0, 0)
    assert runner.decoding == 0 and runner.prefilling_count == 0 and runner.cache_bytes == 0
    assert _answers(runner, warmed, "w") == cold


@pytest.mark.mlx
async def test_the_real_daemon_is_ready_after_the_warm_up(tiny_models):
    from mlxd.daemon.settings import load_settings
    from mlxd.daemon.supervisor import mlx_runner_factory

    path = str(tiny_models("llama"))
    settings = load_settings(None, {"model": {"path": path}, "engine": {"max_batch": 4}})
    factory = mlx_runner_factory(settings)
    async with running_graph(settings, factory=factory) as (pipeline, runner):
        info = pipeline.models.info(pipeline.models.default)
        assert info.warmup is not None and info.warmup.seconds > 0
        assert info.warmup.max_batch == 2  # "auto" on the CPU backend
        assert runner.prefix_cache.counters().entries == 0
