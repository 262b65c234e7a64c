"""The real default model (SmolLM2-135M from its GGUF) through the whole actor graph."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import mlx_runner_factory
from mlxd.protocol.messages import CompletionRequest, Failed, Finished, SamplingParams

from tests.conftest import chat, collect, real_server, running_graph, text_of

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="session")
def settings(tmp_path_factory):
    base = msgspec.to_builtins(load_settings())
    base["model"]["cache_dir"] = str(tmp_path_factory.mktemp("mlxd-cache"))
    return msgspec.convert(base, type=type(load_settings()))


async def collect_req(pipeline, request):
    return await collect(await pipeline.submit(request))


def completion(rid, prompt, max_tokens=20):
    return CompletionRequest(
        request_id=rid, prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0)
    )


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The three primary colors are red, yellow and",
    "Water boils at a temperature of",
    "My favourite recipe for a quick weeknight dinner with friends and family starts with",
    "Q: What is 2 + 2?\nA:",
]


async def test_paris(settings):
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, runner):
        idle = pipeline.engine_stats.memory_active  # as the engine thread published it
        events = await collect_req(pipeline, chat("paris", "What is the capital of France?", 30))
        more = [chat(f"p{i}", "Name a city in Europe.", 30) for i in range(4)]
        async with trio.open_nursery() as nursery:
            for request in more:
                nursery.start_soon(collect_req, pipeline, request)
    assert "Paris" in text_of(events)
    assert isinstance(events[-1], Finished)
    assert runner.cache_bytes == 0
    assert pipeline.engine_stats.kv_reserved == 0
    # Back to idle plus what the prefix cache deliberately keeps (within its budget),
    # give or take the last step's vocabulary-sized arrays mlx-lm keeps.
    cache = pipeline.engine_stats.counters.prefix_cache
    kept = cache.bytes
    assert kept <= cache.max_bytes
    assert abs(pipeline.engine_stats.memory_active - idle - kept) < 4 << 20


def test_memory_estimate_matches_the_model_config(settings):
    """KV bytes per token = layers × 2 (K, V) × KV heads × head dim × dtype size."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import MemoryOptions
    from mlxd.daemon.supervisor import options_from

    m = settings.model
    runner, info = load_runner(
        m.path,
        Path(m.cache_dir),
        dequantize_on_cpu=m.dequantize_on_cpu,
        max_batch=2,
        memory=options_from(settings.memory, MemoryOptions),
    )
    config = json.loads((info.model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_element = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    memory = info.memory
    assert memory.state_bytes == 0
    assert memory.kv_bytes_per_token // per_element in (2, 4)  # float16/bfloat16 or float32
    assert memory.kv_bytes_per_token % per_element == 0
    assert 0 < memory.budget_bytes


async def test_batched_greedy_equals_alone_and_failure_is_isolated(settings):
    """8 concurrent requests get the tokens each gets alone; a prefill failure harms no one."""
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, runner):
        alone = [
            text_of(await collect_req(pipeline, completion(f"a{i}", p)))
            for i, p in enumerate(PROMPTS)
        ]
        _break_prefill_on(runner, marker=pipeline.info.tokenizer.encode("zebra")[0])
        results: dict[str, list] = {}

        async def one(rid, prompt):
            results[rid] = await collect_req(pipeline, completion(rid, prompt))

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(PROMPTS):
                nursery.start_soon(one, f"b{i}", p)
                if i == 3:
                    nursery.start_soon(one, "bad", "zebra " * 40 + "stripes")
                await trio.sleep(0.05 * i)  # join at different steps
        assert runner.cache_bytes == 0
    batched = [text_of(results[f"b{i}"]) for i in range(len(PROMPTS))]
    assert batched == alone
    assert all(len(t) > 10 for t in alone)
    assert isinstance(results["bad"][-1], Failed)
    assert "prefill" in results["bad"][-1].message


def _break_prefill_on(runner, marker: int) -> None:
    """Make the model raise while prefilling any prompt containing ``marker``."""
    import mlx.core as mx

    model = runner.model

    class Faulty:
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, inputs, cache=None):
            if (inputs == marker).any().item():
                raise RuntimeError("injected fault")
            return model(inputs, cache=cache)

    assert isinstance(marker, int)
    assert mx is not None
    runner.model = Faulty()


async def test_streamed_text_equals_non_streamed(settings):
    factory = mlx_runner_factory(settings)
    body = {
        "messages": [{"role": "user", "content": "Tell me about cats."}],
        "temperature": 0,
        "max_tokens": 40,
    }
    async with real_server(settings, factory) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            full = (await http.post("/v1/chat/completions", json=body)).json()
            raw = (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == full["choices"][0]["message"]["content"]
    assert len(streamed) > 20


def test_default_model_is_found():
    from mlxd.actors.engine.loading.gguf.convert import default_model_path

    assert Path(default_model_path()).suffix == ".gguf"


async def test_seeded_sampling_is_reproducible_and_undisturbed(settings):
    """A seeded request samples from its own key: same output alone or among others."""

    def seeded(rid, seed):
        return CompletionRequest(
            request_id=rid,
            prompt="Once upon a time",
            sampling=SamplingParams(max_tokens=16, temperature=1.0, seed=seed),
        )

    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, _):
        alone = text_of(await collect_req(pipeline, seeded("alone", 7)))
        results = {}

        async def one(rid, request):
            results[rid] = text_of(await collect_req(pipeline, request))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "noise1", completion("noise1", "Tell me a joke", 16))
            nursery.start_soon(one, "seeded", seeded("seeded", 7))
            nursery.start_soon(
                one,
                "unseeded",
                CompletionRequest(
                    request_id="unseeded",
                    prompt="Once upon a time",
                    sampling=SamplingParams(max_tokens=16, temperature=1.0),
                ),
            )
            nursery.start_soon(one, "other", seeded("other", 8))
    assert results["seeded"] == alone
    assert results["other"] != alone  # a different seed gives a different sample
