"""What each GGUF architecture is in mlx-lm terms: config.json, tensor names, tensor fixes.

One ``Architecture`` per supported ``general.architecture``: a function from the file's metadata
(llama.cpp key names, ``{arch}.block_count`` ...) to an mlx-lm ``config.json``, the GGUF -> mlx-lm
tensor renames, and the undoing of what llama.cpp's ``convert_hf_to_gguf.py`` did to the
Hugging Face weights: it permutes llama's Q/K rows for its interleaved RoPE, stores Gemma's
RMSNorm weights with the +1 already added, and replaces Llama 3.1's rope_scaling by a
``rope_freqs`` tensor. Mistral files say ``llama``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER = {
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
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_LAYER = _LLAMA_LAYER | _QK_NORM
_GEMMA3_LAYER |= {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    # Phi-3 keeps Q/K/V and gate/up fused, in GGUF and in mlx-lm alike (gate rows first).
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors that only carry RoPE parameters; the config states them instead.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


class UnsupportedModel(ValueError):
    """The GGUF file describes a model this converter cannot express in mlx-lm."""


Meta = dict[str, Any]


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm model type."""

    config: Callable[[Meta, dict[str, tuple[int, ...]]], dict[str, Any]]
    layer_names: dict[str, str]
    permute_qk: bool = False  # llama.cpp's rows for interleaved RoPE (llama, mistral)
    norm_offset: float = 0.0  # subtracted from every *norm.weight (Gemma stores 1 + w)

    def mlx_name(self, gguf_name: str) -> str:
        if match := _LAYER_RE.fullmatch(gguf_name):
            layer, kind, part = match.groups()
            if kind in self.layer_names:
                return f"model.layers.{layer}.{self.layer_names[kind]}.{part}"
        elif (match := _GLOBAL_RE.fullmatch(gguf_name)) and match[1] in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}"
        raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no mlx-lm equivalent")

    def fix(self, gguf_name: str, value: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        """The tensor as Hugging Face (and so mlx-lm) stores it."""
        if self.norm_offset and gguf_name.endswith("norm.weight"):
            return value - np.float32(self.norm_offset)
        kind = _LAYER_RE.fullmatch(gguf_name)
        if self.permute_qk and kind and kind[2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if kind[2] == "attn_q" else "num_key_value_heads"]
            return unpermute_rows(value, heads)
        return value


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (axis 0) back to HF's half-split RoPE order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Keys:
    """``meta["{arch}.{key}"]``, with a one-line error naming a missing key."""

    def __init__(self, meta: Meta):
        self.meta, self.arch = meta, meta["general.architecture"]

    def __call__(self, key: str, default: Any = ...) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is ...:
            raise UnsupportedModel(f"GGUF metadata has no {full!r}")
        return default


def _uniform(value: Any, name: str) -> Any:
    """A per-layer list (some files write head counts per layer) that is one value, or error."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModel(f"GGUF {name} differs between layers: {sorted(set(value))}")
        return value[0]
    return value


def _heads(key: _Keys) -> int:
    return _uniform(key("attention.head_count"), "attention.head_count")


def _base_config(meta: Meta, shapes: dict[str, tuple[int, ...]], model_type: str) -> dict:
    key = _Keys(meta)
    if "token_embd.weight" not in shapes:
        raise UnsupportedModel("GGUF file has no token_embd.weight")
    hidden = key("embedding_length")
    heads = _heads(key)
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(key("attention.head_count_kv", heads), "head_count_kv"),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        # The embedding's rows, not the token list: llama.cpp pads one to the other.
        "vocab_size": shapes["token_embd.weight"][0],
        # llama.cpp writes no output matrix when the LM head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
    }


def _head_dim(meta: Meta) -> int:
    key = _Keys(meta)
    return key("attention.key_length", key("embedding_length") // _heads(key))


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    """llama.cpp's ``rope.scaling.*`` keys as an HF ``rope_scaling`` (linear or yarn)."""
    key = _Keys(meta)
    kind = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor", 1.0)
    if kind in ("none", "") or factor == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = key("rope.scaling.original_context_length")
        return {
            "type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
        }
    raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported")


def _llama_config(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    config = _base_config(meta, shapes, "llama")
    config["head_dim"] = _head_dim(meta)
    config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config


def _qwen2_config(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    config = _base_config(meta, shapes, "qwen2")
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config


def _qwen3_config(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    config = _qwen2_config(meta, shapes)
    return config | {"model_type": "qwen3", "head_dim": _head_dim(meta)}


def _gemma3_config(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    key = _Keys(meta)
    config = _base_config(meta, shapes, "gemma3_text")
    head_dim = _head_dim(meta)
    config |= {
        "head_dim": head_dim,
        "query_pre_attn_scalar": _gemma3_query_scalar(meta, head_dim),
        "sliding_window": key("attention.sliding_window"),
        # llama.cpp hard-codes both for gemma3 (every 6th layer global, local base 10000).
        "sliding_window_pattern": key("attention.sliding_window_pattern", 6),
        "rope_local_base_freq": key("rope.freq_base_swa", 10000.0),
    }
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config


def _gemma3_query_scalar(meta: Meta, head_dim: int) -> float:
    """llama.cpp's gemma3 attention scale: 1/sqrt(hidden/heads) for the 27B (62 layers),
    1/sqrt(head_dim) for every other size (HF's query_pre_attn_scalar)."""
    key = _Keys(meta)
    if key("block_count") == 62:
        return key("embedding_length") // _heads(key)
    return head_dim


def _phi3_config(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    key = _Keys(meta)
    config = _base_config(meta, shapes, "phi3")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
    if "rope_factors_long.weight" in shapes:
        config["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return config


def rope_config(
    arch: Architecture, config: dict[str, Any], rope: dict[str, np.ndarray]
) -> dict[str, Any]:
    """The config entries that replace the file's RoPE tensors (``ROPE_TENSORS``)."""
    if "rope_freqs.weight" in rope:
        if arch is not ARCHITECTURES["llama"]:
            raise UnsupportedModel("GGUF tensor 'rope_freqs.weight' outside a llama model")
        head_dim = config["head_dim"]
        scaling = llama3_rope_scaling(rope["rope_freqs.weight"], config["rope_theta"], head_dim)
        return {"rope_scaling": scaling}
    if "rope_factors_long.weight" in rope:
        short = rope.get("rope_factors_short.weight", rope["rope_factors_long.weight"])
        return {
            "rope_scaling": {
                "type": "longrope",
                "long_factor": rope["rope_factors_long.weight"].tolist(),
                "short_factor": short.tolist(),
            }
        }
    return {}


def llama3_rope_scaling(factors: np.ndarray, base: float, dims: int) -> dict[str, Any]:
    """Llama 3.1's ``rope_scaling`` recovered from llama.cpp's per-frequency ``rope_freqs``.

    The file keeps only the factors. Their largest is ``factor``; the smooth ramp between
    1 and ``factor`` fixes low/high_freq_factor relative to the original context (only their
    ratio to it matters). Tried: Meta's published values (1, 4, 8192), then the ramp's fit.
    The result must reproduce every factor through mlx-lm's own ``Llama3RoPE``, else error.
    """
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    candidates = [(1.0, 4.0, 8192)]
    if (fitted := _fit_llama3_ramp(factors, factor, base, dims)) is not None:
        candidates.append(fitted)
    for low, high, original in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if _reproduces(scaling, factors, base, dims):
            return scaling
    raise UnsupportedModel("GGUF rope_freqs does not match any llama3 rope scaling")


def _fit_llama3_ramp(
    factors: np.ndarray, factor: float, base: float, dims: int
) -> tuple[float, float, int] | None:
    # Between the bands: 1/f = (1 - s)/factor + s with s = (orig/wavelen - low)/(high - low).
    ramp = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    if ramp.sum() < 2:
        return None
    wavelen = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    s = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[ramp], s, 1)
    original = 8192
    width = original / slope  # high - low
    low = -intercept * width
    return float(low), float(low + width), original


def _reproduces(scaling: dict[str, Any], factors: np.ndarray, base: float, dims: int) -> bool:
    from mlx_lm.models.rope_utils import Llama3RoPE

    rope = Llama3RoPE(dims, base=base, scaling_config=scaling)
    expected = base ** (np.arange(0, dims, 2) / dims) * factors
    return bool(np.allclose(np.array(rope._freqs), expected, rtol=1e-3))


ARCHITECTURES = {
    "llama": Architecture(_llama_config, _LLAMA_LAYER, permute_qk=True),
    "qwen2": Architecture(_qwen2_config, _LLAMA_LAYER),
    "qwen3": Architecture(_qwen3_config, _LLAMA_LAYER | _QK_NORM),
    "gemma3": Architecture(_gemma3_config, _GEMMA3_LAYER, norm_offset=1.0),
    "phi3": Architecture(_phi3_config, _PHI3_LAYER),
}


def architecture(meta: Meta) -> Architecture:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    return ARCHITECTURES[arch]
