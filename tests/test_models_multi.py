"""Several models in one daemon (``[[models]]``), over scripted fake runners: selection by
id, load on first use, idle and LRU unloading, fair stepping, load failures and the
bounded wait for a loading model."""

from __future__ import annotations

import json
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.pool import ModelPool, ModelSpec, PoolLimits
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import SettingsError, load_settings
from mlxd.daemon.supervisor import open_graph, run_actors, tokenizer_options
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.conftest import metric, wait_until
from tests.fakes import CharTokenizer, FakeRunner

CHAT = "/v1/chat/completions"


class BTokenizer(CharTokenizer):
    """Model b's own chat template: its replies start with ``B:``."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **extra):
        return "".join(f"<user>b:{m['content']}" for m in messages) + "<assistant>"


@dataclass
class FakeModel:
    """A fake model's factory: a runner, its tokenizer, and a scripted load."""

    runner: FakeRunner = field(default_factory=FakeRunner)
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    gate: threading.Event | None = None  # the load waits for it (at most 10 s)
    error: Exception | None = None
    delay: float = 0.0  # seconds the load takes
    loads: int = 0

    def __call__(self) -> tuple[FakeRunner, ModelInfo]:
        self.loads += 1
        time.sleep(self.delay)
        if self.gate is not None:
            self.gate.wait(10)
        if self.error is not None:
            raise self.error
        info = ModelInfo(
            model_id="fake",
            model_dir=Path("."),
            context_length=4096,
            vocab_size=0x110000,
            tokenizer=self.tokenizer,
            backend="fake",
        )
        return self.runner, info


def multi_settings(*ids: str | dict, **pool):
    """Settings with these ``[[models]]`` entries (an id, or an entry's fields)."""
    raw = msgspec.to_builtins(load_settings())
    raw["models"] = [{"id": i} if isinstance(i, str) else i for i in ids]
    raw["model_pool"].update(pool)
    return msgspec.convert(raw, type=type(load_settings()))


@asynccontextmanager
async def served(settings, models: dict[str, FakeModel]):
    """The app over the actor graph with these fake models; on exit all is idle."""
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, dict(models))
        try:
            yield create_app(graph.pipeline, settings).test_client(), graph.pipeline
            await wait_until(
                lambda: (
                    not (graph.pipeline.sessions or len(graph.pipeline.mailboxes))
                    and not _busy(models)
                )
            )
        finally:
            nursery.cancel_scope.cancel()


def _busy(models: dict[str, FakeModel]) -> bool:
    return any(m.runner.running or m.runner.prefilling for m in models.values())


def ask(model: str, text: str = "hi", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


async def answer(c, model: str, text: str = "hi") -> str:
    r = await c.post(CHAT, json=ask(model, text))
    assert r.status_code == 200, await r.get_data()
    body = json.loads(await r.get_data())
    assert body["model"] == model
    return body["choices"][0]["message"]["content"]


async def states(c) -> dict[str, dict]:
    body = json.loads(await (await c.get("/v1/status")).get_data())
    return {m["id"]: m for m in body["models"]}


async def test_two_models_answer_by_id_with_their_own_template_and_are_listed():
    a, b = FakeModel(), FakeModel(tokenizer=BTokenizer())
    async with served(multi_settings("a", "b"), {"a": a, "b": b}) as (c, _):
        listed = json.loads(await (await c.get("/v1/models")).get_data())
        assert [(m["id"], m["status"]) for m in listed["data"]] == [
            ("a", "unloaded"),
            ("b", "unloaded"),
        ]
        assert await answer(c, "a", "hello") == "HELLO"
        assert await answer(c, "b", "hello") == "B:HELLO"  # b's tokenizer and template
        # No model named: the first entry.
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
        assert json.loads(await r.get_data())["model"] == "a"
        listed = json.loads(await (await c.get("/v1/models")).get_data())
        card = json.loads(await (await c.get("/v1/models/b")).get_data())
        text = (await (await c.get("/metrics")).get_data()).decode()
    assert [m["status"] for m in listed["data"]] == ["loaded", "loaded"]
    assert card == {
        "id": "b",
        "created": 0,
        "owned_by": "mlxd",
        "object": "model",
        "status": "loaded",
    }
    assert (a.loads, b.loads) == (1, 1)
    assert [rid for rid, _ in b.runner.prefill_log] and not set(
        r for r, _ in a.runner.prefill_log
    ) & set(r for r, _ in b.runner.prefill_log)
    assert metric(text, "mlxd_requests_total", 'model="a",status="200"') == 2
    assert metric(text, "mlxd_requests_total", 'model="b",status="200"') == 1
    assert metric(text, "mlxd_model_loaded", 'model="b"') == 1
    assert metric(text, "mlxd_decode_steps_total", 'model="b"') > 0


async def test_a_preloaded_entry_is_loaded_before_the_server_is_ready():
    a, b = FakeModel(), FakeModel(delay=0.05)
    settings = multi_settings("a", {"id": "b", "preload": True})
    async with served(settings, {"a": a, "b": b}) as (c, pipeline):
        assert (a.loads, b.loads) == (0, 1)
        assert pipeline.state.value == "ready"
        now = await states(c)
    assert {m: s["state"] for m, s in now.items()} == {"a": "unloaded", "b": "loaded"}
    assert now["b"]["loads"] == 1 and now["b"]["last_load_s"] >= 0.05


async def test_an_unknown_model_is_a_404_in_each_apis_format():
    async with served(multi_settings("a", "b"), {"a": FakeModel(), "b": FakeModel()}) as (c, _):
        openai = await c.post(CHAT, json=ask("nope"))
        anthropic = await c.post(
            "/v1/messages",
            json={"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        )
        responses = await c.post("/v1/responses", json={"model": "nope", "input": "x"})
        card = await c.get("/v1/models/nope")
    for r in (openai, anthropic, responses, card):
        assert r.status_code == 404
    o = json.loads(await openai.get_data())["error"]
    assert (o["type"], o["code"], o["param"]) == ("not_found_error", "model_not_found", "model")
    assert "'nope' not found" in o["message"] and "'a', 'b'" in o["message"]
    an = json.loads(await anthropic.get_data())
    assert an["type"] == "error" and an["error"]["type"] == "not_found_error"
    assert json.loads(await responses.get_data())["error"]["code"] == "model_not_found"


async def test_first_use_loads_and_the_status_shows_loading_then_loaded():
    b = FakeModel(gate=threading.Event())
    async with served(multi_settings("a", "b"), {"a": FakeModel(), "b": b}) as (c, _):
        assert (await states(c))["b"]["state"] == "unloaded"
        async with trio.open_nursery() as nursery:
            result: list[str] = []

            async def use_b():
                result.append(await answer(c, "b", "late"))

            nursery.start_soon(use_b)
            with trio.fail_after(60):
                while (await states(c))["b"]["state"] != "loading":
                    await trio.sleep(0.01)
            assert (await states(c))["b"]["waiting_for_load"] == 1
            b.gate.set()
        after = (await states(c))["b"]
    assert result == ["LATE"]
    assert (after["state"], after["loads"], after["error"]) == ("loaded", 1, "")
    assert after["model"]["id"] == "b" and after["engine"]["decoding"] == 0


async def test_a_model_idle_past_its_ttl_is_unloaded_and_reloads_on_use():
    a = FakeModel()
    settings = multi_settings("a", "b", idle_unload_s=0.2)
    async with served(settings, {"a": a, "b": FakeModel()}) as (c, pipeline):
        await answer(c, "a")
        with trio.fail_after(60):
            while (await states(c))["a"]["state"] != "unloaded":
                await trio.sleep(0.02)
        gone = (await states(c))["a"]
        assert "a" not in pipeline.model_stats
        assert await answer(c, "a", "again") == "AGAIN"
        back = (await states(c))["a"]
    assert (gone["unloads"], gone["last_unload_reason"], gone["engine"]) == (1, "idle", None)
    assert (back["state"], back["loads"], a.loads) == ("loaded", 2, 2)


async def test_the_least_recently_used_model_is_unloaded_at_max_loaded():
    models = {i: FakeModel() for i in "abc"}
    async with served(multi_settings("a", "b", "c", max_loaded=2), models) as (c, _):
        await answer(c, "a")
        await answer(c, "b")
        await answer(c, "a")  # a is now the most recently used
        await answer(c, "c")
        now = await states(c)
    assert {m: s["state"] for m, s in now.items()} == {
        "a": "loaded",
        "b": "unloaded",
        "c": "loaded",
    }
    assert now["b"]["last_unload_reason"] == "lru"
    assert [m.loads for m in models.values()] == [1, 1, 1]


async def test_two_models_step_in_turn_while_both_have_work():
    """Each step is logged with whether the other model had rows decoding; a model's
    steps emit nothing until both decode, so the overlap does not depend on when each
    request reaches the engine (on a busy machine one used to finish before the other
    began)."""
    order: list[tuple[str, bool]] = []  # (model, the other model had rows decoding)
    together = threading.Event()  # both models have had rows decoding at once

    class Logged(FakeRunner):
        def __init__(self, name):
            super().__init__(step_delay=0.0)
            self.name = name

        def decode(self):
            other = runners["b" if self.name == "a" else "a"]
            if self.running and other.running:
                together.set()
            if armed.is_set() and not together.is_set():
                time.sleep(0.001)  # hold this model's rows until the other's decode too
                return []
            order.append((self.name, bool(other.running)))
            return super().decode()

    armed = threading.Event()
    runners = {"a": Logged("a"), "b": Logged("b")}
    a, b = FakeModel(runner=runners["a"]), FakeModel(runner=runners["b"])
    async with served(multi_settings("a", "b"), {"a": a, "b": b}) as (c, _):
        await answer(c, "a")  # both loaded before the race
        await answer(c, "b")
        order.clear()
        armed.set()
        async with trio.open_nursery() as nursery:
            for model in "ab":
                nursery.start_soon(answer, c, model, model * 120)
    assert [m for m, _ in order].count("a") > 100 and [m for m, _ in order].count("b") > 100
    # While both decode, no model takes two steps in a row.
    shared = [i for i in range(len(order) - 1) if order[i][1]]
    assert len(shared) > 100
    assert all(order[i][0] != order[i + 1][0] for i in shared), order


async def test_a_model_that_fails_to_load_fails_its_requests_only():
    bad = FakeModel(error=OSError("no weights here"))
    settings = multi_settings("a", "bad", failed_retry_s=60)
    async with served(settings, {"a": FakeModel(), "bad": bad}) as (c, _):
        results: dict[str, object] = {}

        async def call(name, model):
            results[name] = await c.post(CHAT, json=ask(model, "ok"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "bad", "bad")
            nursery.start_soon(call, "good", "a")
        again = await c.post(CHAT, json=ask("bad"))  # within failed_retry_s: at once
        status = (await states(c))["bad"]
        assert await answer(c, "a", "still") == "STILL"
    good, failed = results["good"], results["bad"]
    assert good.status_code == 200
    for r in (failed, again):
        assert r.status_code == 500
        error = json.loads(await r.get_data())["error"]
        assert error["code"] == "model_load_failed"
        assert "no weights here" in error["message"] and "'bad'" in error["message"]
    assert bad.loads == 1
    assert status["state"] == "failed" and "no weights here" in status["error"]


async def test_a_retry_of_a_failed_load_unloads_no_healthy_model_until_it_loads():
    models = {"a": FakeModel(), "b": FakeModel(), "broken": FakeModel(error=OSError("gone"))}
    settings = multi_settings("a", "b", "broken", max_loaded=2, failed_retry_s=0)
    async with served(settings, models) as (c, _):
        await answer(c, "a")
        await answer(c, "b")
        first = await c.post(CHAT, json=ask("broken"))  # a first load makes room: a goes,
        assert first.status_code == 500  # and is reloaded once the load failed
        await answer(c, "a")
        for _ in range(3):  # its retries leave a and b loaded
            assert (await c.post(CHAT, json=ask("broken"))).status_code == 500
        loaded = {m for m, s in (await states(c)).items() if s["state"] == "loaded"}
        assert loaded == {"a", "b"}
        models["broken"].error = None  # it loads now: then the least recently used goes
        await answer(c, "broken")
        now = await states(c)
    assert {m: s["state"] for m, s in now.items()} == {
        "a": "loaded",
        "b": "unloaded",
        "broken": "loaded",
    }
    assert now["b"]["last_unload_reason"] == "lru"
    assert [m.loads for m in models.values()] == [2, 1, 5]


async def test_a_broken_models_first_load_leaves_the_healthy_model_loaded():
    """max_loaded 1: the broken entry's first load unloads the idle healthy one to make
    room; once it fails (its request answered first), the healthy one is reloaded, its
    idle time kept, and the next request for it loads nothing."""
    a, broken = FakeModel(), FakeModel(error=OSError("no weights here"))
    settings = multi_settings("a", "broken", max_loaded=1, failed_retry_s=0)
    async with served(settings, {"a": a, "broken": broken}) as (c, pipeline):
        await answer(c, "a")
        a.gate = threading.Event()  # a's reload waits for the test
        failed = await c.post(CHAT, json=ask("broken"))
        during = await states(c)  # a's reload is held: the 500 did not wait for it
        a.gate.set()
        with trio.fail_after(60):
            while (await states(c))["a"]["state"] != "loaded":
                await trio.sleep(0.01)
        assert await answer(c, "a", "again") == "AGAIN"
        now = await states(c)
    assert failed.status_code == 500
    assert json.loads(await failed.get_data())["error"]["code"] == "model_load_failed"
    assert during["a"]["state"] in ("unloaded", "loading") and a.loads <= 2
    assert {m: s["state"] for m, s in now.items()} == {"a": "loaded", "broken": "failed"}
    assert (a.loads, broken.loads) == (2, 1)  # the restore's load, none for the request
    assert (now["a"]["loads"], now["a"]["unloads"]) == (2, 1)


async def test_a_restore_waits_for_a_wanted_model_and_unloads_nothing():
    """A model the failed load unloaded comes back only into room there is: a request
    waiting for another model takes that room first, and the restore is dropped."""
    models = {"a": FakeModel(), "b": FakeModel(), "broken": FakeModel(error=OSError("gone"))}
    settings = multi_settings("a", "b", "broken", max_loaded=1, failed_retry_s=0)
    async with served(settings, models) as (c, _):
        await answer(c, "a")
        models["broken"].gate = threading.Event()
        async with trio.open_nursery() as nursery:
            results: dict = {}

            async def call(model):
                results[model] = await c.post(CHAT, json=ask(model))

            nursery.start_soon(call, "broken")
            with trio.fail_after(60):  # broken is loading (a is gone); then b is asked for
                while (await states(c))["broken"]["state"] != "loading":
                    await trio.sleep(0.01)
            nursery.start_soon(call, "b")
            with trio.fail_after(60):  # b's Load is in the engine's inbox
                while (await states(c))["b"]["waiting_for_load"] != 1:
                    await trio.sleep(0.01)
            models["broken"].gate.set()
        now = await states(c)
    assert results["broken"].status_code == 500 and results["b"].status_code == 200
    assert {m: s["state"] for m, s in now.items()} == {
        "a": "unloaded",
        "b": "loaded",
        "broken": "failed",
    }
    assert [m.loads for m in models.values()] == [1, 1, 1]


async def test_requests_waiting_on_a_loading_model_are_bounded_503_retry_after(mock_clock):
    """On the mock clock, which moves only when the test jumps it: the second request is
    refused with no time passed; the first waits until the clock passes load_timeout_s."""
    b = FakeModel(gate=threading.Event())
    settings = multi_settings("a", "b", max_waiting=1, load_timeout_s=30)
    async with served(settings, {"a": FakeModel(), "b": b}) as (c, _):
        results: dict = {}

        async def call(name):
            results[name] = await c.post(CHAT, json=ask("b"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "timed_out")
            give_up = time.monotonic() + 60
            while (await states(c))["b"]["waiting_for_load"] != 1:
                assert time.monotonic() < give_up
                await trio.testing.wait_all_tasks_blocked(0.01)
            started = trio.current_time()
            await call("full")  # one already waits: refused at once
            refused_in = trio.current_time() - started
            mock_clock.jump(30)  # the first one's load_timeout_s
        b.gate.set()
        # The clock stays still from here on: the loader's and the engine's threads are
        # invisible to it, so an autojumping clock could pass load_timeout_s or
        # queue_timeout_s while they work (it did, on a loaded box).
        give_up = time.monotonic() + 60
        while (await states(c))["b"]["state"] != "loaded":
            assert time.monotonic() < give_up
            await trio.testing.wait_all_tasks_blocked(0.01)
        timed_out = results["timed_out"]
        text = (await (await c.get("/metrics")).get_data()).decode()
        assert await answer(c, "b", "now") == "NOW"
    full = results["full"]
    assert refused_in == 0
    for r in (full, timed_out):
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert json.loads(await r.get_data())["error"]["code"] == "model_loading"
    assert "model_pool.max_waiting" in json.loads(await full.get_data())["error"]["message"]
    assert "model_pool.load_timeout_s" in json.loads(await timed_out.get_data())["error"]["message"]
    assert metric(text, "mlxd_requests_rejected_total", 'model="b",reason="model_loading"') == 2


def test_models_settings_are_checked():
    raw = msgspec.to_builtins(load_settings())
    for models, model, why in (
        ([{"id": "a"}, {"id": "a"}], {}, "same id"),
        ([{"id": ""}], {}, "empty"),
        ([{"id": "a"}], {"path": "/x.gguf"}, "one or the other"),
        ([{"id": i, "preload": True} for i in "abc"], {}, "max_loaded"),
        ([{"id": "a", "tool_format": "xml"}], {}, "models 'a': tool_format: 'xml'"),
        ([{"id": "a", "reasoning_tags": "<t>"}], {}, "models 'a': reasoning_tags"),
    ):
        bad = {**raw, "models": models, "model": {**raw["model"], **model}}
        with pytest.raises(msgspec.ValidationError, match=why):
            msgspec.convert(bad, type=type(load_settings()))
    one = load_settings()
    assert [(e.id, e.preload) for e in one.model_entries()] == [("", True)]
    assert SettingsError  # the CLI reports these as SettingsError (daemon/settings.py)


# ---- the pool alone: the weights cap -----------------------------------------------------


def _request(rid: str, model: str) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid, prompt_tokens=(1, 2, 3), sampling=SamplingParams(max_tokens=2), model=model
    )


def test_a_failed_load_reloads_what_it_unloaded_with_its_idle_time():
    now = [100.0]
    broken = FakeModel(error=OSError("gone"))
    factories = {"a": FakeModel(), "b": FakeModel(), "broken": broken}

    def core(runner, info, max_batch):
        return EngineCore(runner, max_batch=4, prefill_chunk_tokens=64)

    specs = [ModelSpec(m, f, 0) for m, f in factories.items()]
    pool = ModelPool.of(
        specs, PoolLimits(max_loaded=2, idle_unload_s=50), core, clock=lambda: now[0]
    )
    for model in ("a", "b"):
        pool.want(model, f"r-{model}")
        assert pool.next_load() == model
        pool.loading(model)
        assert pool.load(model) is None
        pool.abort(f"r-{model}")
        now[0] += 10
    pool.submit(_request("r-x", "broken"))
    assert pool.next_load() == "broken"
    pool.loading("broken")  # a (least recently used) is unloaded for it
    assert list(pool.loaded) == ["b"]
    failed = pool.load("broken")
    assert failed is not None and [f.reason for f in failed.failed] == ["model_load_failed"]
    assert pool.next_load() == "a" and not pool.idle  # it fits again: reloaded
    pool.loading("a")
    assert pool.load("a") is None
    assert sorted(pool.loaded) == ["a", "b"] and pool.next_load() is None and pool.idle
    assert pool.loaded["a"].last_used == 100.0  # idle since its last use, not since now
    assert pool.next_expiry() == 150.0
    states = [(e.model, e.state) for e in pool.events]
    assert states[-5:] == [
        ("a", "unloaded"),
        ("broken", "loading"),
        ("broken", "failed"),
        ("a", "loading"),
        ("a", "loaded"),
    ]


def test_the_weights_cap_unloads_the_least_recently_used_idle_models():
    device = {"active": 0}
    weights = {"a": 60, "b": 50, "c": 70}

    class Weighted(FakeRunner):
        def memory_stats(self):
            return device["active"], device["active"]

    def factory(model):
        def load():
            device["active"] += weights[model]
            return Weighted(step_delay=0), FakeModel()()[1]

        return load

    def free():
        device["active"] = sum(weights[m] for m in pool.loaded)

    def core(runner, info, max_batch):
        return EngineCore(runner, max_batch=4, prefill_chunk_tokens=64)

    specs = [ModelSpec(m, factory(m), 0) for m in weights]
    limits = PoolLimits(max_loaded=3, max_loaded_bytes=120)
    pool = ModelPool.of(specs, limits, core, free_memory=free, clock=time.monotonic)
    for model in ("a", "b"):
        pool.submit(_request(f"r-{model}", model))
        assert pool.next_load() == model
        pool.loading(model)
        assert pool.load(model) is None
    assert list(pool.loaded) == ["a", "b"] and pool.weights_seen == {"a": 60, "b": 50}
    while not pool.idle:  # both finish their requests
        pool.step()
    pool.want("c", "rc")  # 70 more: a (least recently used) must go; 50 + 70 fits
    assert pool.next_load() == "c"
    pool.loading("c")
    pool.load("c")
    pool.abort("rc")
    assert list(pool.loaded) == ["b", "c"]
    assert [(e.model, e.state, e.reason) for e in pool.events if e.state == "unloaded"] == [
        ("a", "unloaded", "memory")
    ]
    pool.want("b", "keep-b")  # pinned (a request on its way): never unloaded for room
    pool.want("c", "keep-c")
    pool.want("a", "ra")
    assert pool.next_load() is None and pool.idle  # a waits until b or c is free
    pool.abort("keep-c")
    assert pool.next_load() == "a"
    pool.abort("ra")  # nobody waits for a any more: no longer wanted
    assert pool.next_load() is None and not pool.wanted


async def test_count_tokens_and_cache_routes_select_the_model():
    a, b = FakeModel(), FakeModel(tokenizer=BTokenizer())
    bad = FakeModel(error=OSError("gone"))
    models = {"a": a, "b": b, "bad": bad}
    async with served(multi_settings("a", "b", "bad"), models) as (c, pipeline):
        counts = {}
        for model in ("a", "b", "bad", "nope"):
            r = await c.post(
                "/v1/messages/count_tokens",
                json={"model": model, "messages": [{"role": "user", "content": "hey"}]},
            )
            counts[model] = (r.status_code, json.loads(await r.get_data()))
        await answer(c, "a")
        cleared_b = await c.delete("/v1/cache?model=b")
        await c.delete("/v1/cache")
        stats = await c.get("/v1/cache?model=a")
        missing = await c.get("/v1/speculative?model=nope")
        with trio.fail_after(60):
            while (a.runner.cleared, b.runner.cleared) != (1, 2):
                await trio.sleep(0.01)
        assert not pipeline.models.entries["b"].waiting
    # a: "<user>hey<assistant>" (20 characters); b: "<user>b:hey<assistant>" (22)
    assert counts["a"] == (200, {"input_tokens": 20})
    assert counts["b"] == (200, {"input_tokens": 22})
    assert counts["bad"][0] == 500 and "gone" in counts["bad"][1]["error"]["message"]
    assert counts["nope"][0] == 404 and counts["nope"][1]["error"]["type"] == "not_found_error"
    assert cleared_b.status_code == 200 and stats.status_code == 200
    assert missing.status_code == 404


async def test_an_entry_may_have_its_own_chat_template_and_output_formats(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "b.jinja").write_text(template)
    a, b = FakeModel(), FakeModel()
    b_entry = {"id": "b", "chat_template": str(tmp_path / "b.jinja"), "tool_format": "mistral"}
    b_entry["reasoning_tags"] = "<r>,</r>"
    async with served(multi_settings("a", b_entry), {"a": a, "b": b}) as (c, pipeline):
        await answer(c, "a")
        await answer(c, "b")
        traits = {m: e.builder.traits for m, e in pipeline.models.entries.items()}
    assert (traits["b"].tool_format, traits["b"].reasoning) == ("mistral", ("<r>", "</r>"))
    assert traits["a"].tool_format != "mistral" and traits["a"].reasoning != ("<r>", "</r>")
    assert getattr(b.tokenizer, "chat_template", None) == template
    assert getattr(a.tokenizer, "chat_template", None) is None  # the model's own
    missing = multi_settings({"id": "b", "chat_template": str(tmp_path / "nope.jinja")})
    with pytest.raises(ValueError, match="models 'b': chat_template: cannot read"):
        tokenizer_options(missing, missing.models[0])  # run_actors reads them first
