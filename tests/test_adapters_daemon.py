"""LoRA adapters through the whole daemon (issue 44, items 1 and 3), on a real tiny model.

One daemon serves a tiny random llama as ``base`` with adapter ``a`` chosen per request,
and the same llama as ``tuned``, a second entry with the same adapter applied at load
(mlx-lm's own LoRA layers: today's one-entry-per-adapter layout). In every API the
request naming ``a`` answers what ``tuned`` answers, while base rows run beside it; a
tool call made on an adapter row is a valid, ended call.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import trio
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors

pytestmark = pytest.mark.mlx

TEXT = "Name three colours of the sea."


def bodies(model: str) -> dict[str, dict]:
    """One greedy request per API, 8 tokens, naming ``model``."""
    chat = [{"role": "user", "content": TEXT}]
    return {
        "/v1/chat/completions": {
            "model": model,
            "messages": chat,
            "max_tokens": 8,
            "temperature": 0,
        },
        "/v1/completions": {"model": model, "prompt": TEXT, "max_tokens": 8, "temperature": 0},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 8, "temperature": 0},
        "/v1/responses": {"model": model, "input": TEXT, "max_output_tokens": 8, "temperature": 0},
        "/api/chat": {
            "model": model,
            "messages": chat,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 8},
        },
        "/api/generate": {
            "model": model,
            "prompt": TEXT,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 8},
        },
    }


def text_of(route: str, body: dict) -> str:
    if route == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if route == "/v1/completions":
        return body["choices"][0]["text"]
    if route == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    if route == "/v1/responses":
        return "".join(
            c.get("text", "") for o in body["output"] for c in o.get("content", []) or []
        )
    if route == "/api/chat":
        return body["message"]["content"]
    return body["response"]


def model_of(route: str, body: dict) -> str:
    return body["model"]


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    from mlxd.scripts import tiny_models as tm

    model_dir = tiny_models("llama")
    return model_dir, tm.build_lora_adapter(
        model_dir, tmp_path_factory.mktemp("daemon-adapter") / "a", rank=8, seed=21, spread=0.5
    )


def settings_for(model_dir, adapter, tmp_path):
    raw = msgspec.to_builtins(load_settings())
    raw["model"]["cache_dir"] = str(tmp_path)
    raw["model_pool"]["max_loaded"] = 2
    raw["models"] = [
        {"id": "base", "path": str(model_dir), "adapters": {"a": str(adapter)}},
        {"id": "tuned", "path": str(model_dir), "adapter_path": str(adapter)},
    ]
    return msgspec.convert(raw, type=type(load_settings()))


async def test_every_api_serves_the_adapter_as_its_fused_at_load_twin(adapter, tmp_path):
    model_dir, path = adapter
    s = settings_for(model_dir, path, tmp_path)
    graph = open_graph(s)
    got: dict[tuple[str, str], tuple[int, dict]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, s, None)
        c = create_app(graph.pipeline, s).test_client()

        async def post(route: str, model: str, body: dict) -> None:
            r = await c.post(route, json=body)
            got[(route, model)] = (r.status_code, json.loads(await r.get_data()))

        for model in ("tuned", "base"):  # load both first
            await post("/v1/completions", model, bodies(model)["/v1/completions"])
        async with trio.open_nursery() as requests:  # adapter and base rows together
            for model in ("a", "base"):
                for route, body in bodies(model).items():
                    requests.start_soon(post, route, model, body)
        for route, body in bodies("tuned").items():
            await post(route, "tuned", body)
        nursery.cancel_scope.cancel()
    for route in bodies("a"):
        for model in ("a", "base", "tuned"):
            status, body = got[(route, model)]
            assert status == 200, (route, model, body)
            assert model_of(route, body) == model, (route, body)
        adapted, twin = (
            text_of(route, got[(route, "a")][1]),
            text_of(route, got[(route, "tuned")][1]),
        )
        assert adapted == twin, route
        assert adapted != text_of(route, got[(route, "base")][1]), route


async def test_a_tool_call_on_an_adapter_row_is_valid_and_ended(adapter, tmp_path):
    model_dir, path = adapter
    s = settings_for(model_dir, path, tmp_path)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
    }
    graph = open_graph(s)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, s, None)
        c = create_app(graph.pipeline, s).test_client()
        r = await c.post("/v1/chat/completions", json=body)
        answer = json.loads(await r.get_data())
        nursery.cancel_scope.cancel()
    assert r.status_code == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and answer["model"] == "a"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
