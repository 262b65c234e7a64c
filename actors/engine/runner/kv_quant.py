"""Quantized KV inside the continuous batch (``engine.kv_bits``, ``engine.kv_group_size``).

The one module that knows how a quantized attention cache joins mlx-lm's
``BatchGenerator``. ``cache_factory`` turns a model's cache list into one whose
plain attention layers (mlx-lm ``KVCache``, inside a ``CacheList`` too) keep their
keys and values as ``mx.quantize`` packs (uint32 words + per-group scales and
biases). Attention then runs on the packs: mlx-lm's model code calls
``scaled_dot_product_attention(..., cache=cache)``, which dispatches on
``hasattr(cache, "bits")`` to ``quantized_scaled_dot_product_attention``
(``mx.quantized_matmul`` for scores and output), exactly as for mlx-lm's own
``QuantizedKVCache``. What stays at the model's precision: SSM / GatedDeltaNet
``ArraysCache`` state, sliding-window ``RotatingKVCache`` layers (bounded by their
window; neither mlx-lm nor mlx-vlm has a quantized rotating cache), and the caches
of a draft model or MTP head.

What is used from where, and why (mlx-vlm 0.7.x, mlx-lm 0.32):

- mlx-lm's ``QuantizedKVCache`` has no batched variant and no ``merge``, so it cannot
  join a batch (``caches.check_batchable`` refuses it).
- mlx-vlm's ``BatchQuantizedKVCache`` has the batch operations a running batch
  needs: ``update_and_fetch``, ``prepare`` / ``finalize`` (right padding rolled to
  the left), ``filter``, ``extend``, ``trim``, ``state``. Those are used as they are.
  It lacks the rest: no ``merge`` (``BatchGenerator`` and mlxd's batched prefill
  merge per-row caches with the row class's ``merge``), its ``extract`` returns
  mlx-vlm's own ``QuantizedKVCache``, which has no ``merge`` either (an extracted
  row, e.g. a prefix-cache snapshot, could never rejoin a batch), no ``nbytes`` (the
  memory gate and ``/v1/status`` count it) and no ``size``; its ``make_mask`` builds
  the mask with mlx-vlm's helper. ``BatchQuantizedCache`` below adds those, with
  mlx-lm's mask as ``BatchKVCache`` makes it; ``QuantizedRowCache`` is mlx-lm's
  ``QuantizedKVCache`` with ``merge``, ``size`` and a serializable ``state`` (arrays
  only) / ``meta_state`` (strings), for snapshots and the disk tier.
- mlx-vlm's TurboQuant caches (``BatchTurboQuantKVCache``) do not fit: their
  attention is dispatched by mlx-vlm's own model code (``mlx_vlm.models.base``);
  mlx-lm's model code would hand TurboQuant's codec states to
  ``quantized_matmul`` as if they were uniform packs.

``contract_holds`` checks at load that mlx-vlm's class is there, in the tested
version range, with the attributes used, and that a merge / decode / filter /
extend / extract round trip gives a row exactly what it gets alone; otherwise
``cache_factory`` returns None and the model keeps full-precision KV (one log line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

log = logging.getLogger("mlxd.kv_quant")

BITS = (4, 8)  # engine.kv_bits: 0 (off) or one of these
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
# mlx-vlm versions whose BatchQuantizedKVCache was checked against this module.
TESTED_MLX_VLM = ((0, 7), (0, 8))  # from (inclusive), to (exclusive)
_USED = ("update_and_fetch", "prepare", "finalize", "filter", "extend", "trim", "state")
_FIELDS = ("keys", "values", "offset", "left_padding", "_idx", "group_size", "bits")


def _base_class() -> type | None:
    try:
        from mlx_vlm.models.cache import BatchQuantizedKVCache
    except ImportError:
        return None
    return BatchQuantizedKVCache


_Base: Any = _base_class() or object


class QuantizedRowCache(QuantizedKVCache):
    """One sequence's quantized KV (prefill, prefix-cache snapshots); joins a batch with
    ``merge``. ``state`` holds arrays only (keys and values packs, cut at ``offset``),
    ``meta_state`` the numbers, as strings: ``from_state(state, meta_state)`` rebuilds it."""

    @property
    def state(self) -> tuple:
        if self.keys is None:
            return (None, None)
        return tuple(tuple(a[..., : self.offset, :] for a in x) for x in (self.keys, self.values))

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values = (tuple(x) if x is not None else None for x in v)
        self.offset = 0 if self.keys is None else int(self.keys[0].shape[2])

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.offset, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        self.offset, self.group_size, self.bits = map(int, v)

    @classmethod
    def from_state(cls, state: tuple, meta_state: Sequence[str] | None = None) -> QuantizedRowCache:
        obj = cls.__new__(cls)
        obj.group_size, obj.bits = 64, 8
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: Sequence[QuantizedRowCache]) -> BatchQuantizedCache:
        return BatchQuantizedCache.merge(caches)


class BatchQuantizedCache(_Base):
    """mlx-vlm's ``BatchQuantizedKVCache`` with what mlxd's batch needs besides (see the
    module docstring): ``merge`` from rows, ``extract`` to a ``QuantizedRowCache``,
    ``size``, ``nbytes`` and mlx-lm's batch mask."""

    @classmethod
    def merge(cls, caches: Sequence[QuantizedRowCache]) -> BatchQuantizedCache:
        """Rows left-padded to the longest, as ``BatchKVCache.merge`` does."""
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return batch
        ref = next(c for c, n in zip(caches, lengths, strict=True) if n)
        batch.keys = _padded([c.keys for c in caches], lengths, ref.keys)
        batch.values = _padded([c.values for c in caches], lengths, ref.values)
        batch.offset = mx.array(lengths)
        batch._idx = longest
        return batch

    def extract(self, idx: int) -> QuantizedRowCache:
        row = QuantizedRowCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None or self._idx == 0:
            return row
        start = self.left_padding.tolist()[idx]
        row.keys = tuple(mx.contiguous(a[idx : idx + 1, :, start : self._idx]) for a in self.keys)
        row.values = tuple(
            mx.contiguous(a[idx : idx + 1, :, start : self._idx]) for a in self.values
        )
        row.offset = self._idx - start
        return row

    def size(self) -> int:
        return self._idx

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def _padded(parts: list[tuple | None], lengths: list[int], ref: tuple) -> tuple:
    """Each row's packs cut at its length and left-padded with zeros to the longest."""
    longest = max(lengths)
    out = []
    for k, like in enumerate(ref):
        rows = []
        for pack, n in zip(parts, lengths, strict=True):
            if n == 0 or pack is None:
                rows.append(mx.zeros((1, like.shape[1], longest, like.shape[3]), like.dtype))
                continue
            rows.append(mx.pad(pack[k][..., :n, :], [(0, 0), (0, 0), (longest - n, 0), (0, 0)]))
        out.append(mx.concatenate(rows, axis=0))
    return tuple(out)


def quantized(cache: list[Any], bits: int, group_size: int) -> list[Any]:
    """``cache`` with every plain ``KVCache`` (inside a ``CacheList`` too) quantized."""

    def convert(c: Any) -> Any:
        if type(c) is KVCache:
            return QuantizedRowCache(group_size=group_size, bits=bits)
        if type(c) is CacheList:
            return CacheList(*(convert(x) for x in c.caches))
        return c

    return [convert(c) for c in cache]


def quantized_layers(cache: Sequence[Any]) -> int:
    """How many layers of ``cache`` hold quantized KV (for logs and tests)."""
    leaves = [x for c in cache for x in (c.caches if type(c) is CacheList else (c,))]
    return sum(isinstance(c, QuantizedRowCache | BatchQuantizedCache) for c in leaves)


def _version_ok() -> str | None:
    try:
        version = metadata.version("mlx-vlm")
    except metadata.PackageNotFoundError:
        return "mlx-vlm is not installed"
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = TESTED_MLX_VLM
    if not low <= parts < high:
        return f"mlx-vlm {version} is outside the tested range {low} to {high}"
    return None


def contract_holds() -> str | None:
    """None if mlx-vlm's ``BatchQuantizedKVCache`` works as this module relies on; else
    why not. The round trip: two rows of different lengths merged, one decode step,
    filtered, extended, extracted: each row must equal the same steps run alone."""
    if _base_class() is None:
        return "mlx-vlm has no BatchQuantizedKVCache"
    if why := _version_ok():
        return why
    missing = [a for a in _USED if not hasattr(_Base, a)]
    probe = _Base([0], group_size=32, bits=8)
    missing += [f for f in _FIELDS if not hasattr(probe, f)]
    if missing:
        return f"mlx-vlm's BatchQuantizedKVCache lacks {', '.join(missing)}"
    try:
        return _round_trip()
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        return f"mlx-vlm's BatchQuantizedKVCache failed its round trip: {exc!r}"


def _round_trip() -> str | None:
    key = mx.random.key(0)
    kv = mx.random.normal((6, 1, 2, 7, 32), key=key)  # [k/v per step, B, H, L, D]
    alone = [QuantizedRowCache(group_size=32, bits=8) for _ in range(2)]
    alone[0].update_and_fetch(kv[0, :, :, :5], kv[1, :, :, :5])
    alone[1].update_and_fetch(kv[0, :, :, :3], kv[1, :, :, :3])
    rows = [QuantizedRowCache.from_state(c.state, c.meta_state) for c in alone]
    batch = QuantizedRowCache.merge(rows)
    step = mx.concatenate([kv[2, :, :, :1], kv[3, :, :, :1]], axis=0)
    batch.update_and_fetch(step, step * 2)
    for i, c in enumerate(alone):
        c.update_and_fetch(step[i : i + 1], step[i : i + 1] * 2)
    batch.filter(mx.array([1]))
    batch.extend(QuantizedRowCache.merge([rows[0]]))  # rows: [1 after the step, 0 before]
    pairs = ((batch.extract(0), alone[1]), (batch.extract(1), rows[0]))
    same = all(
        mx.array_equal(a, b).item()
        for got, want in pairs
        for (_, a), (_, b) in zip(tree_flatten(got.state), tree_flatten(want.state), strict=True)
    )
    return None if same else "a row merged, filtered and extracted differs from the row alone"


def _head_dims(model: Any, make_cache: Callable[[], list[Any]]) -> set[int]:
    """The key and value head sizes of the model's plain attention layers (one token)."""
    cache = make_cache()
    model(mx.array([[0]]), cache=cache)
    leaves = [x for c in cache for x in (c.caches if type(c) is CacheList else (c,))]
    return {a.shape[-1] for c in leaves if type(c) is KVCache for a in (c.keys, c.values)}


def cache_factory(
    model: Any, make_cache: Callable[[], list[Any]], bits: int, group_size: int
) -> Callable[[], list[Any]] | None:
    """A cache factory whose attention layers hold quantized KV; None where nothing is
    quantized (no plain attention layer, or mlx-vlm's class failed its contract: logged).
    Raises ``ValueError`` for settings the model cannot take. Call on the generation
    thread (it runs the model on one token)."""
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ValueError(
            f"engine.kv_bits must be 0, 4 or 8 and engine.kv_group_size one of "
            f"{GROUP_SIZES}; got {bits} and {group_size}"
        )
    if why := contract_holds():
        log.warning("quantized KV is off, full precision instead: %s", why)
        return None
    dims = _head_dims(model, make_cache)
    if not dims:
        log.info("engine.kv_bits: this model has no plain attention layer; nothing is quantized")
        return None
    if bad := sorted(d for d in dims if d % group_size):
        raise ValueError(
            f"engine.kv_group_size {group_size} does not divide this model's attention head "
            f"size {bad[0]}; set engine.kv_group_size to one of "
            f"{[g for g in GROUP_SIZES if all(d % g == 0 for d in dims)] or 'none (kv_bits = 0)'}"
        )

    def make() -> list[Any]:
        return quantized(make_cache(), bits, group_size)

    log.info("KV cache quantized: %d-bit, group size %d", bits, group_size)
    return make
