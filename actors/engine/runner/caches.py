"""Per-layer caches of any kind in one continuous batch, decided by capability.

Hybrid models mix cache kinds layer by layer: KVCache (attention), RotatingKVCache
(sliding-window attention), ArraysCache (SSM / GatedDeltaNet state) and CacheList
(several of those in one layer). mlx-lm's ``BatchGenerator`` batches a request's
cache by calling each layer's ``merge`` and then ``filter`` / ``extend`` / ``extract``
on the merged batch cache, so a model can join the batch only if every layer has
them. This module checks that once at start-up (mlx-lm's QuantizedKVCache or a
ChunkedKVCache layer is refused with a clear message instead of failing mid-batch;
quantized KV joins the batch as ``kv_quant.QuantizedRowCache``), and trims a
cache only when every layer can trim. Nothing here asks "what type is layer 0".

``RowDeltas`` rides along a batch's cache list to carry one small array per
sequence (the M-RoPE position delta of a vision-language model): merging, filtering,
extending and extracting it keep it aligned with its sequence's other layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

BATCH_OPS = ("filter", "extend", "extract")


class UnbatchableCache(ValueError):
    """A model whose per-layer caches cannot join a continuous batch."""


def layer_kinds(cache: Sequence[Any]) -> str:
    """``"ArraysCache×2, KVCache×2"``: the cache layout, for logs and errors."""
    counts = Counter(_name(c) for c in cache)
    return ", ".join(f"{name}×{n}" for name, n in sorted(counts.items()))


def _name(c: Any) -> str:
    inner = getattr(c, "caches", None)
    if inner is not None:
        return f"CacheList({'+'.join(type(x).__name__ for x in inner)})"
    return type(c).__name__


def missing_batch_ops(layer: Any, spare: Any) -> list[str]:
    """What ``layer`` lacks to be batched; ``spare`` is a second empty cache like it."""
    if not callable(getattr(layer, "merge", None)):
        return ["merge"]
    try:
        merged = layer.merge([layer, spare])
    except (AttributeError, TypeError, ValueError, NotImplementedError) as exc:
        return [f"merge ({exc})"]
    return [op for op in BATCH_OPS if not callable(getattr(merged, op, None))]


def check_batchable(cache: Sequence[Any], spare: Sequence[Any]) -> None:
    """Raise ``UnbatchableCache`` unless every layer can merge, filter, extend and extract.

    ``cache`` and ``spare`` are two fresh (empty) caches for the same model.
    """
    problems = []
    for i, (layer, other) in enumerate(zip(cache, spare, strict=True)):
        missing = missing_batch_ops(layer, other)
        if missing:
            problems.append(f"layer {i} ({_name(layer)}) lacks {', '.join(missing)}")
    if problems:
        raise UnbatchableCache(
            "this model's cache cannot join a continuous batch: "
            + "; ".join(problems[:4])
            + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
        )


def can_trim(cache: Sequence[Any]) -> bool:
    """True only if every layer can drop its last tokens (SSM state cannot)."""
    return all(callable(getattr(c, "is_trimmable", None)) and c.is_trimmable() for c in cache)


def trim(cache: Sequence[Any], n: int) -> int:
    """Drop the last ``n`` tokens from every layer; 0 (and nothing changed) if any cannot."""
    if n <= 0 or not can_trim(cache):
        return 0
    return min(c.trim(n) for c in cache)


def nbytes(cache: Sequence[Any]) -> int:
    return sum(c.nbytes for c in cache)


class _PerRow:
    """A cache-list entry that carries per-sequence values, not tokens: the cache methods
    ``BatchGenerator`` calls on every entry that concern tokens (prepare, finalize,
    trimming, size) are no-ops; subclasses keep their values in step with the batch's
    rows (merge, filter, extend, extract, state, nbytes)."""

    def prepare(self, **kwargs) -> None:
        pass

    def finalize(self) -> None:
        pass

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n

    def empty(self) -> bool:
        return False

    def size(self) -> int:
        return 0


class RowDeltas(_PerRow):
    """One ``[1, 1]`` array per sequence, kept in step with the batch's rows; it holds
    no tokens, so it is empty for trimming and never the model's business."""

    def __init__(self, values: mx.array):
        self.values = values  # [batch, 1]

    @classmethod
    def merge(cls, rows: Sequence[RowDeltas]) -> RowDeltas:
        return cls(mx.concatenate([r.values for r in rows], axis=0))

    def filter(self, batch_indices) -> None:
        self.values = self.values[mx.array(batch_indices)]

    def extend(self, other: RowDeltas) -> None:
        self.values = mx.concatenate([self.values, other.values], axis=0)

    def extract(self, idx: int) -> RowDeltas:
        return RowDeltas(self.values[idx : idx + 1])

    @property
    def state(self) -> mx.array:
        return self.values

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


class RowSlots(_PerRow):
    """Each sequence's adapter slot (``actors/engine/adapters``; 0: the base), kept in
    step with the batch's rows like ``RowDeltas``: BatchGenerator's merge / filter /
    extend / extract order it as they order the cache, so the decode step reads the
    rows' slots in the batch's own row order. Host-side numbers only: no array, no
    tokens, no bytes."""

    def __init__(self, slots: Sequence[int]):
        self.slots = list(slots)

    @classmethod
    def merge(cls, rows: Sequence[RowSlots]) -> RowSlots:
        return cls([s for r in rows for s in r.slots])

    def filter(self, batch_indices) -> None:
        keep = batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices
        self.slots = [self.slots[i] for i in keep]

    def extend(self, other: RowSlots) -> None:
        self.slots = self.slots + other.slots

    def extract(self, idx: int) -> RowSlots:
        return RowSlots([self.slots[idx]])

    @property
    def state(self) -> list[Any]:
        return []

    @property
    def nbytes(self) -> int:
        return 0


def _contiguous(x: Any) -> Any:
    return mx.contiguous(x) if isinstance(x, mx.array) else x


def compact(cache: Sequence[Any]) -> list[Any]:
    """Give every array of ``cache`` its own buffer, in place, and return it.

    A sequence extracted from a batch holds slices of the batch's arrays, and a
    slice keeps its whole parent buffer alive: a snapshot kept for the prefix
    cache would pin every row of the batch it came from.
    """
    for layer in cache:
        if hasattr(layer, "caches"):  # CacheList: compact the layers inside it
            compact(layer.caches)
        else:
            layer.state = tree_map(_contiguous, layer.state)
    return list(cache)
