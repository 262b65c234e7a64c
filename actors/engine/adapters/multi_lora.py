"""Per-row LoRA updates inside one batch: the one wrapper over MLX's linear layers.

mlx-lm applies an adapter by replacing a model's linear layers with ``LoRALinear`` /
``DoRALinear``, one adapter for every row. To serve many adapters in one batch, each
adapted linear layer of the base is replaced (``nn.Module.update_modules``, MLX's
public API) by a ``MultiLoRALinear`` that keeps the base layer and, per adapter slot,
its low-rank factors stacked on a leading axis: ``A`` [slots, in, R], ``B`` [slots, R,
out] with the scale folded into ``B``, and for DoRA the magnitude over the adapted
weight's row norms ``f`` [slots, out]. A forward pass reads the rows' slots from a
``RowAdapters`` shared by every wrapped layer and computes, per row ``i`` of slot ``s``,

    y_i = f_s ⊙ (base(x_i) + (x_i A_s) B_s) + g_s     (g_s = bias ⊙ (1 − f_s))

with two ``mx.gather_mm`` calls (each row's matrices picked by index, no copy per row).
Slot 0 is the base and has no factors (the stacks hold slots 1..top at index s − 1):
a base row in a batch with adapter rows takes any index and a ``keep`` of 0, so its
output is the base layer's exactly. Every slot's ``f`` is 1 and ``g`` 0 unless it is DoRA; layers no
loaded DoRA adapter touches skip that multiply. When no row of the pass has an adapter
(``RowAdapters.ids`` is None) the layer is the base layer and nothing else runs.

The contract this leans on (``check_contract``): ``mx.gather_mm``; ``nn.Linear``'s
``weight`` [out, in] and optional ``bias``; ``nn.QuantizedLinear``'s ``weight``,
``scales``, ``biases``, ``group_size``, ``bits`` (and ``mode``) for the dequantized
weight DoRA's norm needs; ``nn.Module.named_modules`` / ``update_modules``. Where it does
not hold, no layer is replaced: the model serves no per-request adapter (its
``ModelInfo.adapters_refused`` says why), and an adapter fused at load
(``adapter_path``, mlx-lm's own path) still works.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

# versions the wrapper was tested with (mlx's gather_mm signature, the layers' fields)
TESTED_MLX = ((0, 29), (0, 40))


def check_contract() -> str:
    """ "" when MLX has what the wrapper uses, else why not (one line)."""
    try:
        version = tuple(int(p) for p in mx.__version__.split(".")[:2])
    except ValueError:
        return f"mlx {mx.__version__}: version not understood"
    low, high = TESTED_MLX
    if not low <= version < high:
        return f"mlx {mx.__version__} is outside the tested range {low} to {high}"
    if not hasattr(mx, "gather_mm"):
        return "mlx has no gather_mm"
    probe = nn.Linear(4, 2)
    if getattr(probe, "weight", None) is None or tuple(probe.weight.shape) != (2, 4):
        return "nn.Linear's weight is not [out, in]"
    q = nn.QuantizedLinear(64, 2, bias=False)
    if not all(hasattr(q, k) for k in ("weight", "scales", "group_size", "bits")):
        return "nn.QuantizedLinear lacks weight / scales / group_size / bits"
    if not hasattr(nn.Module, "update_modules") or not hasattr(nn.Module, "named_modules"):
        return "nn.Module lacks update_modules / named_modules"
    return ""


def dims(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear layer the wrapper can adapt; None for anything else."""
    if isinstance(layer, MultiLoRALinear):
        return layer.in_dims, layer.out_dims
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer.weight.shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, n_in = layer.weight.shape
        return n_in, out
    return None


def targets(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every linear layer of the model an adapter may target: module path → (in, out)."""
    out = {}
    for name, module in model.named_modules():
        d = dims(module)
        if d is not None and name:
            out[name] = d
    return out


def base_weight(layer: nn.Module) -> mx.array:
    """The layer's weight [out, in], dequantized if it is quantized."""
    if isinstance(layer, nn.QuantizedLinear):
        kwargs = {"mode": layer.mode} if hasattr(layer, "mode") else {}
        return mx.dequantize(
            layer.weight,
            layer.scales,
            getattr(layer, "biases", None),
            group_size=layer.group_size,
            bits=layer.bits,
            **kwargs,
        )
    return layer.weight


class RowAdapters:
    """The current forward pass's rows, shared by every wrapped layer of one model:
    ``ids``, each row's index in the stacks (slot − 1; a base row's is 0, any valid
    one), None when every row is on the base; ``keep``, [rows, 1, 1] of 1 for adapter
    rows and 0 for base rows, None when every row has an adapter."""

    def __init__(self, dtype: mx.Dtype = mx.float32) -> None:
        self.dtype = dtype  # the model's: ``keep`` multiplies its outputs uncast
        self.ids: mx.array | None = None
        self.keep: mx.array | None = None

    @contextlib.contextmanager
    def using(self, slots: Sequence[int]) -> Iterator[None]:
        """Rows ``slots`` (one per batch row, 0 = the base) for the passes run inside."""
        before = self.ids, self.keep
        if any(slots):
            self.ids = mx.array([max(s - 1, 0) for s in slots], dtype=mx.uint32)
            on_base = not all(slots)
            keep = [float(s > 0) for s in slots]
            self.keep = mx.array(keep, dtype=self.dtype)[:, None, None] if on_base else None
        else:
            self.ids = self.keep = None
        try:
            yield
        finally:
            self.ids, self.keep = before


class _Stacks:
    """One wrapped layer's per-slot factors (plain attributes: no model parameters)."""

    def __init__(self) -> None:
        # index s − 1 holds slot s (slot 0, the base, has none)
        self.a: mx.array | None = None  # [slots, in, R]
        self.b: mx.array | None = None  # [slots, R, out], scale folded in
        self.f: mx.array | None = None  # [slots, 1, out] DoRA's factor (None: no DoRA)
        self.g: mx.array | None = None  # [slots, 1, out] bias · (1 − f)


class MultiLoRALinear(nn.Module):
    """A base linear layer plus every loaded adapter's update for it, chosen per row."""

    def __init__(self, base: nn.Module, rows: RowAdapters):
        super().__init__()
        d = dims(base)
        assert d is not None, "only linear layers are wrapped"
        self.base = base
        self.in_dims, self.out_dims = d
        self._rows = rows
        self._stacks = _Stacks()

    def set_stacks(self, a: mx.array | None, b, f=None, g=None) -> None:
        s = self._stacks
        s.a, s.b, s.f, s.g = a, b, f, g

    @property
    def stacks(self) -> _Stacks:
        return self._stacks

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        ids, keep, s = self._rows.ids, self._rows.keep, self._stacks
        if ids is None or s.a is None:
            return y
        squeeze = x.ndim == 2  # [rows, in] (no sequence axis)
        if squeeze:
            x = x[:, None]
        z = mx.gather_mm(
            mx.gather_mm(x.astype(s.a.dtype), s.a, rhs_indices=ids), s.b, rhs_indices=ids
        ).astype(y.dtype)
        if squeeze:
            z = z[:, 0]
            keep = keep[:, 0] if keep is not None else None
        if s.f is None:
            return y + (z if keep is None else z * keep)
        f, g = s.f[ids], s.g[ids]
        if squeeze:
            f, g = f[:, 0], g[:, 0]
        adapted = (y + z) * f + g
        return adapted if keep is None else y + keep * (adapted - y)


def wrap(model: nn.Module, modules: Sequence[str], rows: RowAdapters) -> dict[str, MultiLoRALinear]:
    """Replace the named linear layers (those not wrapped yet) by ``MultiLoRALinear``s;
    returns every wrapped layer of the model by path."""
    found = dict(model.named_modules())
    new = []
    for name in modules:
        layer = found[name]
        if not isinstance(layer, MultiLoRALinear):
            new.append((name, MultiLoRALinear(layer, rows)))
    if new:
        model.update_modules(tree_unflatten(new))
    return {n: m for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)}


def stack(layer: MultiLoRALinear, slots: Sequence[Any | None], dtype: mx.Dtype) -> None:
    """Set ``layer``'s stacks from each slot's factors for it (None: the slot does not
    adapt this layer, or is empty): ``(A [in, r], B [r, out] scaled, f [out] or None)``."""
    parts = [p for p in slots if p is not None]
    if not parts:
        layer.set_stacks(None, None)
        return
    rank = max(p[0].shape[1] for p in parts)
    zeros_a = mx.zeros((layer.in_dims, rank), dtype)
    zeros_b = mx.zeros((rank, layer.out_dims), dtype)
    a_rows, b_rows = [], []
    for p in slots:
        if p is None:
            a_rows.append(zeros_a)
            b_rows.append(zeros_b)
            continue
        a, b = p[0].astype(dtype), p[1].astype(dtype)
        pad = rank - a.shape[1]
        if pad:
            a = mx.concatenate([a, mx.zeros((a.shape[0], pad), dtype)], axis=1)
            b = mx.concatenate([b, mx.zeros((pad, b.shape[1]), dtype)], axis=0)
        a_rows.append(a)
        b_rows.append(b)
    f = g = None
    if any(p is not None and p[2] is not None for p in slots):
        ones = mx.ones((layer.out_dims,), mx.float32)
        fs = [p[2] if p is not None and p[2] is not None else ones for p in slots]
        f32 = mx.stack(fs)[:, None, :]
        bias = getattr(layer.base, "bias", None) if "bias" in layer.base else None
        g32 = (bias.astype(mx.float32) * (1 - f32)) if bias is not None else mx.zeros_like(f32)
        f, g = f32.astype(dtype), g32.astype(dtype)  # the model's dtype, as mlx-lm's DoRA casts
    layer.set_stacks(mx.stack(a_rows), mx.stack(b_rows), f, g)
    mx.eval([x for x in (layer.stacks.a, layer.stacks.b, f, g) if x is not None])
