"""Adapter directories as people have them (issue 44, item 2): mlx-lm's and PEFT's, LoRA
and DoRA, read from their config and safetensors header without MLX; an adapter for
another base, or one that is not a low-rank update of linear layers, is refused with
the module and the shapes named."""

from __future__ import annotations

import json
import math
import struct

import pytest
from mlxd.actors.engine.adapters import files
from mlxd.actors.engine.adapters.files import AdapterError, AdapterMismatch

TARGETS = {
    "model.layers.0.self_attn.q_proj": (64, 64),
    "model.layers.0.self_attn.v_proj": (64, 32),
    "model.layers.0.mlp.down_proj": (128, 64),
}


def safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with zeroed tensors of these dtypes and shapes."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * {"F32": 4, "F16": 2, "BF16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def mlx_dir(tmp_path, kind="lora", extra=None, shapes=None):
    d = tmp_path / "mlx"
    d.mkdir(exist_ok=True)
    config = {"fine_tune_type": kind, "num_layers": 1, "lora_parameters": {"rank": 4, "scale": 3.0}}
    (d / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for module, (n_in, n_out) in (shapes or TARGETS).items():
        tensors[f"{module}.lora_a"] = ("F32", [n_in, 4])
        tensors[f"{module}.lora_b"] = ("F32", [4, n_out])
        if kind == "dora":
            tensors[f"{module}.m"] = ("F32", [n_out])
    safetensors(d / "adapters.safetensors", {**tensors, **(extra or {})})
    return d


def peft_dir(tmp_path, config=None, extra=None, dora=False):
    d = tmp_path / "peft"
    d.mkdir(exist_ok=True)
    base = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "use_dora": dora,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    }
    (d / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    tensors = {}
    for module, (n_in, n_out) in TARGETS.items():
        r = 4 if module.endswith("v_proj") and config and "rank_pattern" in config else 8
        stem = f"base_model.model.{module}"
        tensors[f"{stem}.lora_A.weight"] = ("BF16", [r, n_in])
        tensors[f"{stem}.lora_B.weight"] = ("BF16", [n_out, r])
        if dora:
            tensors[f"{stem}.lora_magnitude_vector"] = ("BF16", [n_out])
    safetensors(d / "adapter_model.safetensors", {**tensors, **(extra or {})})
    return d


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_mlx_lm_adapter_is_read_and_matches_its_base(tmp_path, kind):
    found = files.inspect(mlx_dir(tmp_path, kind))
    assert (found.layout, found.kind, found.max_rank) == ("mlx-lm", kind, 4)
    assert {m.module for m in found.modules} == set(TARGETS)
    assert all(
        m.scale == 3.0 and (m.magnitude is not None) == (kind == "dora") for m in found.modules
    )
    found.check(TARGETS, "base")


@pytest.mark.parametrize("dora", [False, True])
def test_a_peft_adapter_is_read_with_its_scales(tmp_path, dora):
    found = files.inspect(peft_dir(tmp_path, dora=dora))
    assert (found.layout, found.kind) == ("peft", "dora" if dora else "lora")
    assert {m.module for m in found.modules} == set(TARGETS)  # base_model.model. dropped
    assert all(m.scale == 2.0 and m.a_transposed for m in found.modules)  # alpha / r
    found.check(TARGETS, "base")


def test_peft_rslora_and_per_module_patterns(tmp_path):
    config = {"use_rslora": True, "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"v_proj": 8}}
    found = files.inspect(peft_dir(tmp_path, config))
    scales = {m.module.rsplit(".", 1)[1]: (m.rank, m.scale) for m in found.modules}
    assert scales["q_proj"] == (8, 16 / math.sqrt(8))
    assert scales["v_proj"] == (4, 8 / math.sqrt(4))


def test_an_adapter_for_another_base_is_refused_naming_module_and_shapes(tmp_path):
    other = {**TARGETS, "model.layers.0.self_attn.q_proj": (64, 96)}
    with pytest.raises(AdapterMismatch, match=r"q_proj.*64 → 96.*A 64×4, B 4×96.*64 → 64"):
        files.inspect(mlx_dir(tmp_path, shapes=other)).check(TARGETS, "base")
    extra = {"model.layers.9.self_attn.q_proj": (64, 64)}
    (tmp_path / "other").mkdir()
    found = files.inspect(mlx_dir(tmp_path / "other", shapes={**TARGETS, **extra}))
    with pytest.raises(AdapterMismatch, match=r"layers\.9\.self_attn\.q_proj.*not a linear layer"):
        found.check(TARGETS, "base")


@pytest.mark.parametrize(
    ("where", "change", "message"),
    [
        ("mlx", {"fine_tune_type": "full"}, "full fine-tune"),
        ("peft", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("peft", {"fan_in_fan_out": True}, "fan_in_fan_out"),
        ("peft", {"peft_type": "IA3"}, "only LORA"),
        ("peft", {"r": "eight"}, "r must be a number"),
    ],
)
def test_what_is_not_a_per_request_low_rank_update_is_refused(tmp_path, where, change, message):
    d = mlx_dir(tmp_path) if where == "mlx" else peft_dir(tmp_path)
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterError, match=message):
        files.inspect(d)


def test_trained_embeddings_and_broken_files_are_clear_errors(tmp_path):
    with pytest.raises(AdapterError, match="not LoRA updates.*embed_tokens"):
        files.inspect(mlx_dir(tmp_path, extra={"model.embed_tokens.weight": ("F32", [10, 64])}))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        files.inspect(empty)
    (empty / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="neither adapters.safetensors"):
        files.inspect(empty)
    (empty / "adapter_config.json").write_text(json.dumps({"lora_parameters": {"scale": 1}}))
    (empty / "adapters.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        files.inspect(empty)
    with pytest.raises(AdapterError, match="not a directory"):
        files.inspect(tmp_path / "missing")


def test_the_fingerprint_follows_the_files(tmp_path):
    d = mlx_dir(tmp_path)
    before = files.fingerprint(d)
    assert files.fingerprint(d) == before
    (d / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "lora_parameters": {"scale": 1.0}})
    )
    assert files.fingerprint(d) != before
