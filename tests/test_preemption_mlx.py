"""A preempted row gives exactly the output it gives when never preempted, on real models.

Two rows run together; at a random step (seeded, so a failure reproduces) the newer one
is preempted (``EngineCore._preempt``: the step the memory gate takes when growth would
not fit) and resumes on the next step, from its prefix-cache snapshot or, where the
snapshot cannot serve (hybrid and sliding-window state is kept only at exact lengths)
or was lost, by recomputing its tokens. Its tokens must equal those it gets running
alone: greedy and seeded, on SmolLM2, the GatedDeltaNet hybrid, a sliding-window model,
with 8-bit KV, with speculative decoding, and with a grammar (strict JSON and a forced
tool call).
"""

from __future__ import annotations

import random

import pytest
from mlxd.actors.engine.runner.disk_tier import DiskStore
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.options import DiskTierOptions, PrefixCacheOptions
from mlxd.actors.grammar import GrammarCompiler
from mlxd.protocol.messages import Constraint, SamplingParams, TokenizedRequest, Tool

from tests.engine_driver import alone
from tests.test_lookup import lookup_runner

pytestmark = pytest.mark.mlx

MAX_TOKENS = 14
PICK = random.Random(31)


def load(model_dir, **options):
    from mlxd.actors.engine.loading.load import load_runner

    cache = PrefixCacheOptions(block_size=16, max_bytes=256 << 20)
    return load_runner(
        str(model_dir),
        model_dir,
        dequantize_on_cpu=True,
        max_batch=4,
        prefix_cache=options.pop("prefix_cache", cache),
        **options,
    )


def greedy(rid: str, start: int, **extra) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(range(start, start + 40)),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        **extra,
    )


def seeded(rid: str, start: int) -> TokenizedRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=5)
    return TokenizedRequest(
        request_id=rid, prompt_tokens=tuple(range(start, start + 40)), sampling=sampling
    )


def preempted_run(runner, first, second, at: int, lose=None):
    """Both rows together; ``second`` preempted once it has ``at`` tokens, resumed the next
    step (``lose``: called in between, on the runner). Returns its tokens and the core."""
    core = EngineCore(runner, max_batch=4, prefill_chunk_tokens=64)
    core.submit(first)
    core.submit(second)
    tokens: dict[str, list[int]] = {first.request_id: [], second.request_id: []}
    out = False
    while not core.idle:
        step = core.step()
        assert not step.failed, step.failed
        assert not [s for s in step.started if out]  # a resume sends no second Started
        for t in step.tokens:
            tokens[t.request_id].extend(t.tokens)
        if not out and len(tokens[second.request_id]) >= at:
            core._preempt(second.request_id)  # what the memory gate does before a step
            out = True
            if lose is not None:
                lose(runner)
    assert out and core.stats().resumes == 1
    assert runner.decoding == 0 and runner.prefilling_count == 0
    return tokens, core


def check(runner, first, second, lose=None) -> int:
    """Preempted output == alone; returns the prefix-cache hits of the resume (None: none)."""
    expected = alone(runner, [first, second])
    at = PICK.randint(1, MAX_TOKENS - 3)
    cache = runner.prefix_cache
    hits: list[int] = []

    def between(r) -> None:
        if lose is not None:
            lose(r)
        hits.append(cache.stats.hits if cache is not None else 0)

    tokens, _ = preempted_run(runner, first, second, at, between)
    assert tokens == expected, f"preempted after {at} tokens"
    return (cache.stats.hits if cache is not None else 0) - hits[0]


@pytest.fixture(scope="module")
def smollm(smollm_tokenizer):
    return load(smollm_tokenizer)[0]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_smollm_preempted_equals_not_preempted(smollm, kind):
    make = greedy if kind == "greedy" else seeded
    assert check(smollm, make("a", 200), make("b", 900)) == 1  # the resume: a snapshot hit


@pytest.mark.parametrize("model", ["qwen3_5", "baichuan_m1"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_hybrid_and_sliding_window_preempted_equals_not_preempted(tiny_models, model, kind):
    runner = load(tiny_models(model))[0]
    make = greedy if kind == "greedy" else seeded
    check(runner, make("a", 200), make("b", 900))


def test_8_bit_kv_preempted_equals_not_preempted(smollm_tokenizer):
    runner = load(smollm_tokenizer, kv_bits=8)[0]
    check(runner, greedy("a", 200), seeded("b", 900))


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_speculative_preempted_equals_not_preempted(tiny_models, kind):
    _, runner, _ = lookup_runner(tiny_models("llama"))
    # a repetitive prompt, so that lookup drafts are proposed and accepted; seeded: the
    # verifier splits the row's key a varying number of times per token, so the resume
    # must take the key where the row left it
    sampling = (
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        if kind == "greedy"
        else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=5)
    )
    loop = TokenizedRequest(
        request_id="b", prompt_tokens=tuple(range(300, 310)) * 4, sampling=sampling
    )
    check(runner, greedy("a", 200), loop)


def _grammar(tokenizer, constraint: Constraint, tools=()):
    return GrammarCompiler(tokenizer).compile(constraint, tools)


@pytest.mark.parametrize("kind", ["json", "tool_call"])
def test_constrained_preempted_equals_not_preempted(smollm_tokenizer, kind):
    runner, info = load(smollm_tokenizer)
    if kind == "json":
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        }
        constraint = Constraint(kind="json_schema", schema=schema)
        tools: tuple[Tool, ...] = ()
    else:
        tools = (Tool(name="get_weather", parameters={"type": "object", "properties": {}}),)
        constraint = Constraint(kind="tool_call", tool_names=("get_weather",))

    def row(rid: str, start: int) -> TokenizedRequest:
        grammar = _grammar(info.tokenizer, constraint, tools)  # a matcher per run
        return greedy(rid, start, grammar=grammar)

    expected = alone(runner, [row("a", 200), row("b", 900)])
    at = PICK.randint(2, 8)
    tokens, _ = preempted_run(runner, row("a", 200), row("b", 900), at)
    assert tokens == expected, f"preempted after {at} tokens"


def test_a_lost_snapshot_is_recomputed_with_the_same_output(smollm):
    """The snapshot is gone before the resume (evicted and dropped): a recompute."""
    check(smollm, greedy("a", 300), greedy("b", 1000), lose=lambda r: r.prefix_cache.clear())


def test_a_corrupt_spilled_snapshot_is_recomputed_with_the_same_output(smollm_tokenizer, tmp_path):
    """The snapshot went to the disk tier and its files were damaged before the resume:
    the read fails its check, the resume recomputes, and the output is the same."""
    store = DiskStore(tmp_path / "disk", 1 << 30, ["smollm"], fsync=False)
    tier = DiskTierOptions(store=store, slug="smollm")
    runner = load(smollm_tokenizer, disk_tier=tier)[0]

    def spill_and_corrupt(r) -> None:
        r.spill_cache(wait=True)  # every snapshot to disk, none left in RAM
        for path in (tmp_path / "disk").rglob("*"):
            if path.is_file() and path.stat().st_size > 64:
                data = bytearray(path.read_bytes())
                for i in range(32, len(data), 97):
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))

    try:
        check(runner, greedy("a", 300), greedy("b", 1000), lose=spill_and_corrupt)
    finally:
        store.close()
