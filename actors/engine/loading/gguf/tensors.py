"""GGUF tensor data to MLX arrays: dequantized by the `gguf` package, re-quantized by MLX.

Every ggml type is first dequantized to float32 with ``gguf.quants.dequantize`` (ggml-org's
numpy reference, so F16, BF16, Q4_0 ... Q8_0 and the K-quants all take one path). What the
model directory then stores depends on the backend:

- ``float32``: every tensor as float32. The CPU backend computes in float32 anyway (the
  ``model.dequantize_on_cpu`` path), and converting once here avoids a lossy re-quantization.
- ``affine``: Metal and CUDA gain from quantized matmuls, so each 2-D weight that was quantized
  in the file is re-quantized to MLX's affine format, 4 bits (group 32) when the source had 4
  bits or fewer, 8 bits (group 64) for 5 to 8 bits; float tensors stay float (``float_dtype``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, quants
from mlxd.actors.engine.loading.gguf.arch import UnsupportedModel
from mlxd.actors.engine.loading.gguf.header import TensorInfo

T = GGMLQuantizationType
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
# Bits per weight of the source type, rounded to the MLX width that keeps its precision.
_BITS_8 = frozenset({T.Q8_0, T.Q8_1, T.Q8_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q5_K})
# Group sizes: GGUF's 4-bit types scale every 32 weights; 8 bits at 64 is finer than any 5-8 bit
# source already.
GROUP_SIZE = {4: 32, 8: 64}


class UnsupportedTensor(UnsupportedModel):
    """A tensor whose ggml type the `gguf` package cannot dequantize."""


def dequantize(path: Path, info: TensorInfo) -> np.ndarray:
    """The tensor as float32 numpy, in numpy shape order (rows, columns)."""
    return np.asarray(_dequantize(_raw(path, info), info), dtype=np.float32).reshape(info.shape)


def check_readable(info: TensorInfo) -> None:
    """``UnsupportedTensor`` unless `gguf` can dequantize the tensor's type (tried on one
    zero block)."""
    _, block = quants.GGML_QUANT_SIZES[T(info.ggml_type)]
    if T(info.ggml_type) not in FLOAT_TYPES:
        _dequantize(np.zeros((1, block), np.uint8), info)


def _dequantize(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    try:
        return quants.dequantize(raw, T(info.ggml_type))
    except NotImplementedError:
        raise UnsupportedTensor(
            f"GGUF tensor {info.name!r} has type {info.type_name}, which cannot be dequantized"
        ) from None


def _raw(path: Path, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes (a read-only map of the file), shaped as `gguf.quants` expects."""
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    rows = info.shape[:-1] if info.shape else ()
    return data.reshape(*rows, -1) if rows else data


def source_bits(ggml_type: int) -> int | None:
    """The MLX bit width a quantized source maps to; None for float sources."""
    qtype = T(ggml_type)
    if qtype in FLOAT_TYPES:
        return None
    return 8 if qtype in _BITS_8 else 4


@dataclass(frozen=True)
class Storage:
    """How converted weights are stored: all float32, or affine-quantized where the source was."""

    kind: str  # "float32" or "affine"
    float_dtype: Any = mx.float32

    def store(self, name: str, value: np.ndarray, ggml_type: int) -> dict[str, mx.array]:
        """mlx-lm weights for one tensor: ``name`` itself, plus ``.scales``/``.biases`` when
        quantized (name must end in ``.weight``)."""
        array = mx.array(value)
        bits = source_bits(ggml_type) if self.kind == "affine" else None
        if bits is None or not quantizable(name, value.shape, GROUP_SIZE[bits]):
            return {name: array.astype(self.float_dtype if self.kind == "affine" else mx.float32)}
        return quantize(name, array.astype(self.float_dtype), bits)


def quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """2-D ``.weight`` tensors (Linear and Embedding in mlx-lm) whose rows split into groups."""
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % group_size == 0


def quantize(name: str, array: mx.array, bits: int) -> dict[str, mx.array]:
    group_size = GROUP_SIZE[bits]
    weight, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    prefix = name.removesuffix(".weight")
    return {name: weight, f"{prefix}.scales": scales, f"{prefix}.biases": biases}


def quantization_config(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """config.json's ``quantization`` block for weights of these shapes: the most common
    (group, bits) as the default and a per-layer entry for each exception; empty when nothing is
    quantized. mlx-lm quantizes exactly the layers that have ``.scales``."""
    layers = {
        name.removesuffix(".scales"): _group_and_bits(shapes, name.removesuffix(".scales"))
        for name in shapes
        if name.endswith(".scales")
    }
    if not layers:
        return {}
    group_size, bits = Counter(layers.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for layer, (layer_group, layer_bits) in sorted(layers.items()):
        if (layer_group, layer_bits) != (group_size, bits):
            quant[layer] = {"group_size": layer_group, "bits": layer_bits}
    return {"quantization": quant}


def _group_and_bits(shapes: dict[str, tuple[int, ...]], layer: str) -> tuple[int, int]:
    """Recovered from shapes: packed uint32 columns * 32 / bits = scales columns * group."""
    packed = shapes[f"{layer}.weight"][-1]
    groups = shapes[f"{layer}.scales"][-1]
    for bits, group_size in GROUP_SIZE.items():
        if packed * 32 // bits == groups * group_size:
            return group_size, bits
    raise ValueError(f"{layer}: scales do not match any of {GROUP_SIZE}")
