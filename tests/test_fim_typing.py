"""Completion as one types, on a tiny random-weight model wearing Qwen3.5's real tokenizer:
20 ``/infill`` requests, each a few characters further into the file, are served from the
prefix cache (``tokens_cached``, and ``cached_tokens`` on ``/v1/completions``), and
their middles equal those of the same requests served cold (the prefix cache off)."""

from __future__ import annotations

import json

import pytest
from mlxd.daemon.app import create_app
from mlxd.daemon.supervisor import mlx_runner_factory

from tests.conftest import running_graph, settings_with

pytestmark = pytest.mark.mlx

HEAD = "".join(
    f"def handler_{i}(request, limit={i}):\n"
    f"    items = [x * {i} for x in request.items if x < limit]\n"
    f"    return sum(items) + {i}\n\n"
    for i in range(12)
)
TYPED = "def total(values):\n    result = 0\n    for value in values:\n        result += value"
TAIL = "\n    return result\n\n\nprint(total([1, 2, 3]))\n"


def typing_requests(n: int = 20, step: int = 3) -> list[dict]:
    """The cursor ``step`` characters further each time."""
    return [
        {
            "input_prefix": HEAD + TYPED[: len(TYPED) - (n - 1 - i) * step],
            "input_suffix": TAIL,
            "n_predict": 6,
            "temperature": 0,
        }
        for i in range(n)
    ]


async def served(model_dir, tmp_path, cache: bool) -> tuple[list[dict], list[dict]]:
    settings = settings_with(
        model={"path": str(model_dir), "cache_dir": str(tmp_path)},
        prefix_cache={"enabled": cache},
    )
    async with running_graph(settings, factory=mlx_runner_factory(settings)) as (pipeline, _):
        c = create_app(pipeline, settings).test_client()
        answers = []
        for body in typing_requests():
            r = await c.post("/infill", json=body)
            assert r.status_code == 200
            answers.append(json.loads(await r.get_data()))
        usages = []
        for body in typing_requests(3, 5):
            insertion = {"prompt": body["input_prefix"], "suffix": TAIL, "max_tokens": 6}
            r = await c.post("/v1/completions", json={**insertion, "temperature": 0})
            usages.append(json.loads(await r.get_data())["usage"])
    return answers, usages


async def test_typing_is_served_from_the_prefix_cache_with_cold_output(
    real_tokenizer_model, tmp_path
):
    model = real_tokenizer_model("qwen35")
    warm, warm_usage = await served(model, tmp_path, cache=True)
    cold, cold_usage = await served(model, tmp_path, cache=False)
    assert [a["content"] for a in warm] == [a["content"] for a in cold]
    assert all(a["tokens_cached"] == 0 for a in cold)
    assert warm[0]["tokens_cached"] == 0
    for a in warm[1:]:  # all but the cursor's line and what follows it
        assert a["tokens_cached"] >= 0.8 * a["tokens_evaluated"], a
        assert a["timings"]["cache_n"] == a["tokens_cached"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in warm_usage]
    assert all(c >= 0.8 * u["prompt_tokens"] for c, u in zip(cached, warm_usage, strict=True))
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in cold_usage)
