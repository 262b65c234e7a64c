"""LoRA adapters per served model: an mlx-lm adapter directory applied at load.

The adapter is made here: LoRA layers on a tiny random llama with nonzero ``lora_b``,
saved as mlx-lm saves one. The adapted model must differ from the base and equal the
base with the adapter fused by hand (W + scale · (A B)ᵀ); through the daemon, the base
and the adapted model are two ``[[models]]`` entries of one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import trio
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors

pytestmark = pytest.mark.mlx

KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
LORA = {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": KEYS}
PROMPT = [1, 42, 7, 300, 99, 5]


def make_adapter(model_dir: Path, out: Path) -> Path:
    """An mlx-lm adapter directory (LoRA on the last 2 layers, nonzero A and B)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    linear_to_lora_layers(model, 2, LORA)
    mx.random.seed(7)
    weights = {
        name: mx.random.normal(w.shape) * 0.2
        for name, w in tree_flatten(model.parameters())
        if name.endswith(("lora_a", "lora_b"))
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": LORA}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def fused_by_hand(model_dir: Path, adapter: Path):
    """The base model with every adapted weight replaced by W + scale · (A B)ᵀ."""
    import mlx.core as mx
    from mlxd.actors.engine.loading.load import load_model

    model = load_model(model_dir, dequantize_on_cpu=True)[0]
    lora = mx.load(str(adapter / "adapters.safetensors"))
    updates = []
    for name in {n.rsplit(".", 1)[0] for n in lora}:
        a, b = lora[f"{name}.lora_a"], lora[f"{name}.lora_b"]
        layer = model
        for part in name.split("."):
            layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
        updates.append((f"{name}.weight", layer.weight + LORA["scale"] * (a @ b).T))
    assert len(updates) == 2 * len(KEYS)
    model.load_weights(updates, strict=False)
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    import mlx.core as mx

    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def adapted(tiny_models, tmp_path_factory):
    model_dir = tiny_models("llama")
    return model_dir, make_adapter(model_dir, tmp_path_factory.mktemp("lora") / "adapter")


def test_the_adapter_changes_the_model_as_its_fused_weights_do(adapted):
    import mlx.core as mx
    from mlxd.actors.engine.loading.load import load_model

    model_dir, adapter = adapted
    base = load_model(model_dir, dequantize_on_cpu=True)[0]
    tuned = load_model(model_dir, dequantize_on_cpu=True, adapter_path=adapter)[0]
    fused = fused_by_hand(model_dir, adapter)
    x = mx.array([PROMPT])
    base_logits, tuned_logits, fused_logits = base(x), tuned(x), fused(x)
    assert mx.abs(tuned_logits - base_logits).max().item() > 0.1
    assert mx.allclose(tuned_logits, fused_logits, atol=1e-4).item()


def test_a_missing_adapter_file_is_a_clear_error(adapted, tmp_path):
    from mlxd.actors.engine.loading.load import load_model

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="adapters.safetensors not found"):
        load_model(adapted[0], dequantize_on_cpu=True, adapter_path=tmp_path)


async def test_base_and_adapted_model_served_side_by_side(adapted, tmp_path):
    """Two real models in one daemon, loaded on first use, one at a time: each answers as
    it should, and the one unloaded for the other gives its memory back."""
    from mlxd.actors.engine.loading.load import load_model

    model_dir, adapter = adapted
    raw = msgspec.to_builtins(load_settings())
    raw["model"]["cache_dir"] = str(tmp_path)
    raw["prefix_cache"]["enabled"] = False
    raw["model_pool"]["max_loaded"] = 1  # each switch unloads the other model
    raw["models"] = [
        {"id": "base", "path": str(model_dir)},
        {"id": "tuned", "path": str(model_dir), "adapter_path": str(adapter)},
    ]
    settings = msgspec.convert(raw, type=type(load_settings()))
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, None)
        c = create_app(graph.pipeline, settings).test_client()
        texts = {}
        for model in ("base", "tuned"):
            r = await c.post("/v1/completions", json={**body, "model": model})
            assert r.status_code == 200, await r.get_data()
            texts[model] = json.loads(await r.get_data())["choices"][0]["text"]
        status = json.loads(await (await c.get("/v1/status")).get_data())
        again = await c.post("/v1/completions", json={**body, "model": "base"})
        assert json.loads(await again.get_data())["choices"][0]["text"] == texts["base"]
        nursery.cancel_scope.cancel()
    tokenizer = graph.pipeline.model_info("tuned").tokenizer
    fused = fused_by_hand(model_dir, adapter)
    base = load_model(model_dir, dequantize_on_cpu=True)[0]
    assert texts["tuned"] == tokenizer.decode(greedy(fused, PROMPT, 6))
    assert texts["base"] == tokenizer.decode(greedy(base, PROMPT, 6))
    assert texts["tuned"] != texts["base"]
    base_row, tuned_row = status["models"]
    assert (base_row["state"], base_row["last_unload_reason"]) == ("unloaded", "lru")
    assert (tuned_row["state"], tuned_row["loads"]) == ("loaded", 1)
    # The unloaded model's weights were given back: only the loaded one's remain.
    assert status["memory"]["active_bytes"] < 1.5 * tuned_row["weights_bytes"]
    assert graph.pipeline.models.entries["base"].loads == 2  # reloaded for the last request
