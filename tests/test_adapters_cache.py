"""Caches that know the adapter (issue 44, item 4), and the resident set (item 5).

The prefix cache and its disk tier key an adapter row's snapshots by the adapter: a
row never reuses a prefix the base or another adapter computed, and reuses its own (a
hit answers as the miss did). Adapters load on first use, at most ``max_adapters``
resident; the least recently used idle one is evicted for a new one; a request waits
while every resident adapter is in use; an unload under a running row waits for it.
"""

from __future__ import annotations

import pytest
from mlxd.protocol.messages import AdapterRef, SamplingParams, TokenizedRequest

pytestmark = pytest.mark.mlx

PROMPT = tuple((7 * i) % 4000 + 10 for i in range(40))


def ask(rid, prompt=PROMPT, adapter=None, max_tokens=6):
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        adapter=adapter,
    )


def ref(name, path):
    from mlxd.actors.engine.adapters.files import fingerprint

    return AdapterRef(name=name, path=str(path), fingerprint=fingerprint(path))


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory):
    from mlxd.scripts import tiny_models as tm

    model_dir = tiny_models("llama")
    root = tmp_path_factory.mktemp("cache-adapters")
    adapters = {
        f"a{i}": tm.build_lora_adapter(model_dir, root / f"a{i}", rank=4, seed=10 + i)
        for i in range(4)
    }
    return model_dir, adapters


def engine(model_dir, tmp_path, *, store=None, max_adapters=8, max_batch=4, memory=1 << 30):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.actors.engine.scheduler.options import DiskTierOptions, PrefixCacheOptions

    disk = DiskTierOptions(store=store, slug="m") if store is not None else None
    runner, _ = load_runner(
        str(model_dir),
        tmp_path,
        dequantize_on_cpu=True,
        max_batch=max_batch,
        prefix_cache=PrefixCacheOptions(block_size=16, max_bytes=256 << 20),
        disk_tier=disk,
        max_adapters=max_adapters,
        adapter_memory_bytes=memory,
    )
    return runner, EngineCore(runner, max_batch=max_batch, prefill_chunk_tokens=64)


def run(core, *requests):
    """Every request's tokens and cached prompt tokens, run to the end together."""
    out, cached = {}, {}
    for r in requests:
        core.submit(r)
    while not core.idle:
        step = core.step()
        assert not step.failed, step.failed
        cached |= {s.request_id: s.cached_tokens for s in step.started}
        for t in step.tokens:
            out.setdefault(t.request_id, []).extend(t.tokens)
    return out, cached


def test_an_adapter_row_reuses_its_own_prefix_only(model, tmp_path):
    model_dir, adapters = model
    a0, a1 = ref("a0", adapters["a0"]), ref("a1", adapters["a1"])
    runner, core = engine(model_dir, tmp_path)
    base, cached = run(core, ask("base"))
    assert cached["base"] == 0
    miss, cached = run(core, ask("a0", adapter=a0))
    assert cached["a0"] == 0  # the base's snapshot of the same prompt is not a0's
    other, cached = run(core, ask("a1", adapter=a1))
    assert cached["a1"] == 0  # nor is a0's a1's
    hit, cached = run(core, ask("a0-again", adapter=a0))
    assert cached["a0-again"] > 16 and hit["a0-again"] == miss["a0"]
    again, cached = run(core, ask("base-again"))
    assert cached["base-again"] > 16 and again["base-again"] == base["base"]
    assert miss["a0"] != base["base"] and other["a1"] != miss["a0"]


def test_the_disk_tier_keeps_each_adapter_in_its_own_space(model, tmp_path):
    """RAM emptied (as after a restart): an adapter row is served from its own space on
    disk and answers as cold; the base's files are not the adapter's."""
    from mlxd.actors.engine.runner.disk_tier import DiskStore

    model_dir, adapters = model
    a0 = ref("a0", adapters["a0"])
    store = DiskStore(
        tmp_path / "disk", 1 << 30, ["m"], write_behind_s=600, block_tokens=16, fsync=False
    )
    runner, core = engine(model_dir, tmp_path, store=store)
    cold, _ = run(core, ask("a0", adapter=a0))
    run(core, ask("base"))
    runner.spill_cache(wait=True)
    spaces = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "disk").iterdir() if p.is_dir())
    assert spaces == ["m", "m.lora.a0"], spaces
    runner.clear_cache(tier="ram")
    warm, cached = run(core, ask("a0-warm", adapter=a0))
    assert cached["a0-warm"] > 16 and warm["a0-warm"] == cold["a0"]
    assert runner.prefix_cache.stats.disk_hits == 1
    runner.clear_cache(tier="ram")
    other, cached = run(core, ask("a1", adapter=ref("a1", adapters["a1"])))
    assert cached["a1"] == 0
    store.close()


def test_lru_eviction_and_waiting_for_a_slot(model, tmp_path):
    """Two resident at most: a third adapter evicts the least recently used idle one;
    with both in use, a request on a third waits (and then runs) instead of failing."""
    model_dir, adapters = model
    refs = [ref(f"a{i}", adapters[f"a{i}"]) for i in range(4)]
    runner, core = engine(model_dir, tmp_path, max_adapters=2)
    bank = runner.adapters
    alone = {}
    for r in refs:
        alone[r.name] = run(core, ask(r.name, adapter=r))[0][r.name]
    assert bank.resident == ["a2", "a3"] and bank.evictions == 2
    run(core, ask("x", adapter=refs[2]))  # a2 is now the most recent
    run(core, ask("y", adapter=refs[0]))
    assert bank.resident == ["a2", "a0"]  # a3, least recently used, went
    # three adapters at once with room for two: the third waits for a slot
    together, _ = run(
        core,
        ask("w0", adapter=refs[1], max_tokens=6),
        ask("w1", adapter=refs[2], max_tokens=6),
        ask("w2", adapter=refs[3], max_tokens=6),
    )
    assert together["w0"] == alone["a1"] and together["w1"] == alone["a2"]
    assert together["w2"] == alone["a3"]
    assert len(bank.resident) <= 2


def test_the_memory_budget_evicts_and_refuses(model, tmp_path):
    """Room for one adapter's tensors: the next evicts it (least recently used, idle);
    an adapter larger than the whole budget fails its own request with the sizes; the
    resident adapters count against the requests' memory (``cache_held``)."""
    from mlxd.actors.engine.adapters import files

    model_dir, adapters = model
    one = files.inspect(adapters["a0"]).elements * 4  # float32 on the CPU
    runner, core = engine(model_dir, tmp_path, memory=one + one // 2)
    run(core, ask("x", adapter=ref("a0", adapters["a0"])))
    assert runner.adapters.resident == ["a0"] and runner.cache_held >= one
    run(core, ask("y", adapter=ref("a1", adapters["a1"])))
    assert runner.adapters.resident == ["a1"] and runner.adapters.evictions == 1
    small, core = engine(model_dir, tmp_path, memory=one // 2)
    core.submit(ask("z", adapter=ref("a0", adapters["a0"])))
    step = core.step()
    assert step.failed and "adapter_memory_mb" in step.failed[0].message
    assert step.failed[0].reason == "invalid_request"


def test_an_unload_waits_for_the_rows_using_the_adapter(model, tmp_path):
    model_dir, adapters = model
    a0 = ref("a0", adapters["a0"])
    runner, core = engine(model_dir, tmp_path)
    want, _ = run(core, ask("first", adapter=a0, max_tokens=10))
    core.submit(ask("long", adapter=a0, max_tokens=10))
    got = []
    for _ in range(3):
        step = core.step()
        got += [x for t in step.tokens for x in t.tokens]
    runner.unload_adapter("a0")
    assert runner.adapters.resident == ["a0"]  # still in use
    while not core.idle:
        got += [x for t in core.step().tokens for x in t.tokens]
    assert got == want["first"]
    assert runner.adapters.resident == []  # gone once its last row ended


@pytest.mark.parametrize("model_name", ["llama", "qwen3_5"])
def test_an_adapter_row_preempted_equals_not_preempted(tiny_models, tmp_path, model_name):
    """Preempted mid-answer and resumed (from its own snapshot, or recomputed where a
    hybrid's state cannot be trimmed), an adapter row writes what it writes alone; its
    slot is held again on the resume and given back at the end."""
    from mlxd.scripts import tiny_models as tm

    from tests.test_preemption_mlx import greedy, preempted_run

    model_dir = tiny_models(model_name)
    a0 = ref("a0", tm.build_lora_adapter(model_dir, tmp_path / "a0", rank=4, seed=5))
    runner, _ = engine(model_dir, tmp_path)
    first, second = greedy("base", 200), greedy("tuned", 900, adapter=a0)
    from tests.engine_driver import alone

    expected = alone(runner, [first, second])
    hits = runner.prefix_cache.stats.hits
    tokens, _ = preempted_run(runner, first, second, 4)
    assert tokens == expected
    if model_name == "llama":
        assert runner.prefix_cache.stats.hits > hits  # resumed from its own snapshot
    assert runner.adapters.resident == ["a0"] and not runner._slots


def test_a_grammar_holds_on_an_adapter_row(model, tmp_path):
    """Structured output on adapter rows: a json_schema answer and a forced tool call,
    in one batch with a free base row, are valid and equal each alone."""
    import json

    from mlxd.actors.grammar import GrammarCompiler
    from mlxd.protocol.messages import Constraint, Tool

    from tests.engine_driver import alone, drive

    model_dir, adapters = model
    a0, a1 = ref("a0", adapters["a0"]), ref("a1", adapters["a1"])
    from mlxd.actors.engine.loading.load import load_runner

    runner, info = load_runner(str(model_dir), tmp_path, dequantize_on_cpu=True, max_batch=4)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = (Tool(name="get_weather", parameters={"type": "object", "properties": {}}),)

    def rows():
        compiler = GrammarCompiler(info.tokenizer)
        json_grammar = compiler.compile(Constraint(kind="json_schema", schema=schema), ())
        call = compiler.compile(Constraint(kind="tool_call", tool_names=("get_weather",)), tools)
        return [
            TokenizedRequest(
                request_id="json",
                prompt_tokens=PROMPT,
                adapter=a0,
                sampling=SamplingParams(max_tokens=60, temperature=0.0),
                grammar=json_grammar,
            ),
            TokenizedRequest(
                request_id="call",
                prompt_tokens=PROMPT[5:],
                adapter=a1,
                sampling=SamplingParams(max_tokens=60, temperature=0.0),
                grammar=call,
            ),
            ask("base", max_tokens=20),
        ]

    tokens, failed = drive(runner, {0: rows()})
    assert not failed
    assert tokens == alone(runner, rows())
    text = info.tokenizer.decode(
        [t for t in tokens["json"] if t not in info.tokenizer.eos_token_ids]
    )
    value = json.loads(text)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)
    assert "get_weather" in info.tokenizer.decode(tokens["call"])


def test_speculative_and_a_broken_contract_refuse_adapters_with_the_reason(
    tiny_models, tmp_path, monkeypatch
):
    from mlxd.actors.engine.adapters import multi_lora
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions

    from tests.engine_driver import drive

    model_dir = tiny_models("llama")
    spec, info = load_runner(
        str(model_dir),
        tmp_path,
        dequantize_on_cpu=True,
        max_batch=4,
        speculative=SpeculativeOptions(drafter="lookup", num_draft_tokens=3),
    )
    assert not info.lora_targets and "speculative" in info.adapters_refused
    a0 = AdapterRef(name="a0", path=str(tmp_path), fingerprint="x")
    _, failed = drive(spec, {0: [ask("tuned", adapter=a0)]})
    assert failed["tuned"].reason == "invalid_request" and failed["tuned"].param == "model"
    monkeypatch.setattr(multi_lora, "TESTED_MLX", ((0, 1), (0, 2)))
    plain, info = load_runner(str(model_dir), tmp_path, dequantize_on_cpu=True, max_batch=4)
    assert plain.adapters is None and "outside the tested range" in info.adapters_refused


def test_configured_adapters_disk_spaces_survive_a_restart(tmp_path):
    """The store deletes at start every space of a model that is not configured: a
    configured adapter's space (``<model>.lora.<id>``) is configured, so it stays."""
    import msgspec
    from mlxd.actors.engine.runner.disk_tier import adapter_slug
    from mlxd.daemon.settings import load_settings
    from mlxd.daemon.supervisor import disk_store

    raw = msgspec.to_builtins(load_settings())
    raw["prefix_cache"]["disk_dir"] = str(tmp_path / "disk")
    raw["models"] = [{"id": "qwen", "path": str(tmp_path), "adapters": {"sql": str(tmp_path)}}]
    store = disk_store(msgspec.convert(raw, type=type(load_settings())))
    try:
        assert store.models == {"qwen", adapter_slug("qwen", "sql")}
        kept = store.space(adapter_slug("qwen", "sql"), {"k": 1})
        kept.spill((1, 2, 3), True, _encoded())
        store.flush()
    finally:
        store.close()
    again = disk_store(msgspec.convert(raw, type=type(load_settings())))
    try:
        again.scanned.result(30)
        assert again.counters().entries == 1  # not deleted as another model's
    finally:
        again.close()


def _encoded():
    from tests.test_disk_tier import _enc

    return _enc((1, 2, 3))
