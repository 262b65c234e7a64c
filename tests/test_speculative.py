"""Speculative decoding inside the continuous batch (``actors/engine/speculative/batch.py``).

Tiny random-weight targets and drafts sharing SmolLM2's vocabulary: greedy tokens
with speculation equal greedy tokens without it, for 8 requests joining and
leaving at different steps, with a draft that agrees sometimes (rows accept
different counts, so caches are rewound by different amounts), never, or always.
"""

from __future__ import annotations

import msgspec
import pytest

from tests.engine_driver import alone, drive, request, speculative_runner

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
MAX_TOKENS = (12, 5, 9, 16, 3, 12, 7, 10)
JOINS = (0, 0, 1, 2, 3, 5, 8, 13)


def speculative(target_dir, draft_dir, *, k=3, spec_max_batch=8, max_batch=8):
    from mlxd.actors.engine.loading.load import load_model

    def draft(target):
        if draft_dir == target_dir:
            return target
        return load_model(draft_dir, dequantize_on_cpu=True)[0]

    return speculative_runner(
        target_dir, draft, k=k, spec_max_batch=spec_max_batch, max_batch=max_batch
    )


def _requests(info):
    encode = info.tokenizer.encode
    return [
        request(f"r{i}", encode(p), m)
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]


def _schedule(requests):
    schedule: dict[int, list] = {}
    for step, r in zip(JOINS, requests, strict=True):
        schedule.setdefault(step, []).append(r)
    return schedule


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("target", "draft", "spec_max_batch"),
    [
        ("llama", "llama_near", 8),  # rows accept different counts: per-row rollback
        ("llama", "llama_draft", 8),  # a smaller draft that almost never agrees
        ("llama", "llama_near", 3),  # off above 3 rows, back on below: the draft catches up
        ("qwen3_5", "qwen3_5_near", 8),  # hybrid target and draft: SSM state restored
        ("qwen3_5", "llama_draft", 3),
    ],
)
def test_greedy_speculation_equals_plain_decoding(tiny_models, target, draft, spec_max_batch):
    plain, runner, info = speculative(
        tiny_models(target), tiny_models(draft), spec_max_batch=spec_max_batch
    )
    requests = _requests(info)
    expected = alone(plain, requests)
    got, failed = drive(runner, _schedule(requests), prefill_chunk_tokens=8)
    assert not failed
    assert got == expected
    stats = runner.spec_stats
    print(target, draft, stats)
    assert stats.steps > 0 and stats.drafted > 0
    if spec_max_batch < 8:
        assert stats.plain_steps > 0
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


@pytest.mark.mlx
@pytest.mark.parametrize("target", ["llama", "qwen3_5"])
def test_draft_equal_to_target_accepts_everything(tiny_models, target):
    plain, runner, info = speculative(tiny_models(target), tiny_models(target))
    requests = _requests(info)
    expected = alone(plain, requests)
    got, failed = drive(runner, _schedule(requests), prefill_chunk_tokens=8)
    assert not failed
    assert got == expected
    assert runner.spec_stats.acceptance_rate == 1.0


async def _chat_all(settings, prompts):
    """Greedy replies over HTTP (whole actor graph, real default model) and the stats body."""
    import json

    import trio
    from mlxd.daemon.app import create_app
    from mlxd.daemon.supervisor import mlx_runner_factory

    from tests.conftest import running_graph

    replies: dict[int, str] = {}
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, _):
        client = create_app(pipeline, settings).test_client()

        async def ask(i, text):
            body = {"messages": [{"role": "user", "content": text}], "temperature": 0}
            r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 24})
            replies[i] = json.loads(await r.get_data())["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            for i, text in enumerate(prompts):
                nursery.start_soon(ask, i, text)
        stats = json.loads(await (await client.get("/v1/speculative")).get_data())
    return replies, stats


@pytest.mark.mlx
async def test_default_model_drafting_for_itself_over_http(tmp_path_factory):
    """SmolLM2 as its own draft: same replies as without speculation, every draft accepted."""
    from tests.conftest import settings_with

    cache_dir = str(tmp_path_factory.getbasetemp() / "mlxd-cache")
    prompts = PROMPTS[:4]
    off = settings_with(model={"cache_dir": cache_dir})
    on = settings_with(model={"cache_dir": cache_dir}, speculative={"enabled": True})
    plain, plain_stats = await _chat_all(off, prompts)
    spec, stats = await _chat_all(on, prompts)
    assert spec == plain
    assert plain_stats == {"enabled": False}
    assert stats["enabled"] and stats["steps"] > 0
    assert stats["acceptance_rate"] == 1.0


@pytest.mark.mlx
def test_rejection_sampling_follows_the_target_distribution():
    """The first token out of ``accept_sampled`` is distributed as the target's ``p``."""
    import mlx.core as mx
    from mlxd.actors.engine.speculative.batch import accept_sampled

    p = mx.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.1, 0.2, 0.3, 0.4]])  # a poor draft: mass where p has little
    key = [mx.random.key(7)]

    def next_key():
        key[0], sub = mx.random.split(key[0])
        return sub

    n, counts = 3000, [0] * 4
    for _ in range(n):
        d = int(mx.random.categorical(mx.log(q[0]), key=next_key()).item())
        accepted, token = accept_sampled(p, q, [d], next_key)
        counts[d if accepted else token] += 1
    freq = [c / n for c in counts]
    assert all(abs(f - t) < 0.03 for f, t in zip(freq, p[0].tolist(), strict=True)), freq


@pytest.mark.mlx
def test_sampled_requests_with_the_target_as_draft(tiny_models):
    """Temperature > 0: p == q, so every draft is accepted; a seed makes a request repeatable."""
    _, runner, info = speculative(tiny_models("llama"), tiny_models("llama"))
    assert_sampled_runs_repeat(runner, info)
    assert runner.spec_stats.acceptance_rate == 1.0


def assert_sampled_runs_repeat(runner, info) -> None:
    """Three seeded, sampled requests run twice: same tokens, all 8 of each."""
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    requests = [
        TokenizedRequest(
            request_id=f"s{i}", prompt_tokens=tuple(info.tokenizer.encode(p)), sampling=sampling
        )
        for i, p in enumerate(PROMPTS[:3])
    ]
    first, failed = drive(runner, {0: requests})
    again, _ = drive(runner, {0: requests})
    assert not failed and first == again
    assert all(len(t) == 8 for t in first.values())


@pytest.mark.mlx
def test_requests_opted_out_decode_without_drafts(tiny_models):
    """``"speculative": false`` rows verify no drafts (and are not counted), in a mixed batch."""
    import msgspec

    plain, runner, info = speculative(tiny_models("llama"), tiny_models("llama_near"))
    requests = _requests(info)
    expected = alone(plain, requests)
    mixed = [
        msgspec.structs.replace(
            r, sampling=msgspec.structs.replace(r.sampling, speculative=i % 2 == 0)
        )
        for i, r in enumerate(requests)
    ]
    got, failed = drive(runner, _schedule(mixed), prefill_chunk_tokens=8)
    assert not failed and got == expected
    drafted = runner.spec_stats.drafted
    assert drafted > 0
    off = [
        msgspec.structs.replace(r, sampling=msgspec.structs.replace(r.sampling, speculative=False))
        for r in requests
    ]
    got, failed = drive(runner, _schedule(off), prefill_chunk_tokens=8)
    assert not failed and got == expected
    assert runner.spec_stats.drafted == drafted  # nobody drafted
    assert runner.spec_stats.plain_steps > 0


async def test_status_and_metrics_report_acceptance_per_drafter():
    """``/v1/status`` and ``/metrics`` read the drafter's counters from the engine's
    published snapshot; the wire field ``"speculative": false`` reaches the engine as
    ``SamplingParams.speculative``."""
    import json

    from mlxd.daemon.api.common import Validator
    from mlxd.daemon.api.openai import sampling_from
    from mlxd.daemon.app import create_app
    from mlxd.daemon.settings import load_settings
    from mlxd.protocol import openai
    from mlxd.protocol.messages import SpeculativeCounters

    from tests.conftest import metric, running_graph
    from tests.fakes import FakeRunner

    # what a runner with a drafter copies into each published EngineStats
    stats = SpeculativeCounters(
        drafter="tiny", enabled=True, num_draft_tokens=3, drafted=10, accepted=7, steps=4
    )
    stats = msgspec.structs.replace(stats, acceptance_rate=0.7)
    settings = load_settings()
    async with running_graph(settings, FakeRunner(speculative=stats)) as (pipeline, _):
        c = create_app(pipeline, settings).test_client()
        status = json.loads(await (await c.get("/v1/status")).get_data())
        text = (await (await c.get("/metrics")).get_data()).decode()
    assert status["spec_prefill"] is None
    (row,) = status["speculative"]
    assert row["drafter"] == "tiny" and row["enabled"] and row["acceptance_rate"] == 0.7
    assert metric(text, "mlxd_spec_acceptance_rate", 'drafter="tiny"') == 0.7
    assert metric(text, "mlxd_spec_drafted_tokens_total", 'drafter="tiny"') == 10
    assert metric(text, "mlxd_spec_accepted_tokens_total", 'drafter="tiny"') == 7
    body = openai.chat_decoder.decode(b'{"messages": [], "speculative": false}')
    assert not sampling_from(body, None, Validator(settings), "top_logprobs").speculative
    body = openai.chat_decoder.decode(b'{"messages": []}')
    assert sampling_from(body, None, Validator(settings), "top_logprobs").speculative


def test_grammar_and_logprobs_are_a_400_while_speculating():
    from types import SimpleNamespace

    from mlxd.daemon.api.common import ApiError, _check_speculation
    from mlxd.protocol.messages import (
        CompletionRequest,
        Constraint,
        EngineStats,
        RunnerCounters,
        SamplingParams,
        SpeculativeCounters,
    )

    def pipeline(enabled, loaded=True):
        """The model "m" loaded (its engine's counters say), or not yet (its settings say)."""
        spec = RunnerCounters(speculative=SpeculativeCounters(enabled=enabled))
        info = SimpleNamespace(kind="text") if loaded else None
        return SimpleNamespace(
            model_info=lambda model: info,
            model_stats={"m": EngineStats(counters=spec)} if loaded else {},
            speculative={"m": enabled},
        )

    plain = CompletionRequest(request_id="p", prompt="x", sampling=SamplingParams())
    schema = msgspec.structs.replace(
        plain, constraint=Constraint(kind="json_object", param="response_format")
    )
    logprobs = msgspec.structs.replace(plain, sampling=SamplingParams(logprobs=True))
    _check_speculation(pipeline(True), [plain], "m")
    _check_speculation(pipeline(False), [schema, logprobs], "m")
    _check_speculation(pipeline(False, loaded=False), [schema, logprobs], "m")
    for refused, param in [(schema, "response_format"), (logprobs, "logprobs")]:
        for loaded in (True, False):
            with pytest.raises(ApiError) as err:
                _check_speculation(pipeline(True, loaded), [refused], "m")
            assert err.value.status == 400
            assert err.value.param == param
