"""The adapters resident over one base model: slots, least-recently-used loading, pins.

An adapter loads on its first request (``acquire``), into a free slot of the wrapped
layers' stacks (``multi_lora``): its tensors are read, checked against the base's
layers, DoRA's factor computed from the base weight, and every layer it touches is
re-stacked. At most ``max_adapters`` are resident, within ``memory_bytes`` of their
tensors; to load one more, the least recently used adapter that no running row uses
is evicted. When every resident adapter is in use and there is no room, ``acquire``
returns None and the request waits (the engine keeps it in its place) until a row
finishes. A row holds its slot from ``acquire`` to ``release``: an adapter is never
evicted or unloaded under a running row (``unload`` of a busy adapter takes effect
when its last row releases it). A broken adapter raises ``AdapterError`` from its own
``acquire``: that request fails, the base and the other adapters go on.

All methods run on the generation thread (MLX).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlxd.actors.engine.adapters import files as adapter_files
from mlxd.actors.engine.adapters import multi_lora
from mlxd.actors.engine.adapters.files import AdapterError, AdapterFiles
from mlxd.actors.engine.adapters.multi_lora import MultiLoRALinear, RowAdapters
from mlxd.protocol.messages import AdapterRef

log = logging.getLogger("mlxd.adapters")

_INSPECTED = 64  # adapters whose checked files are remembered

Factors = tuple[mx.array, mx.array, mx.array | None]  # A [in, r], scaled B [r, out], f [out]


@dataclass
class _Resident:
    """A resident adapter: its factors live only in the wrapped layers' stacks (its
    ``ranks`` say where in the padded rank axis, ``dora`` which layers carry a factor)."""

    ref: AdapterRef
    files: AdapterFiles
    ranks: dict[str, int]
    dora: set[str]
    nbytes: int
    slot: int


class AdapterBank:
    """Resident adapters of one base model, in the base's wrapped linear layers."""

    def __init__(
        self,
        model: nn.Module,
        base_name: str,
        *,
        max_adapters: int,
        memory_bytes: int,
        dtype: mx.Dtype | None = None,
    ):
        self.model, self.base_name = model, base_name
        self.max_adapters, self.memory_bytes = max(1, max_adapters), memory_bytes
        self.targets = multi_lora.targets(model)
        self._dtype = dtype or _model_dtype(model)
        self.rows = RowAdapters(self._dtype)
        self._layers: dict[str, MultiLoRALinear] = {}
        self._top = 0  # the highest slot the stacks hold
        self._inspected: OrderedDict[tuple[str, str], AdapterFiles] = OrderedDict()
        self._resident: OrderedDict[tuple[str, str], _Resident] = OrderedDict()  # LRU first
        self._by_slot: dict[int, _Resident] = {}
        self._users: Counter[int] = Counter()
        self._gone: set[tuple[str, str]] = set()  # unloaded while in use: evicted when idle
        self.loads = self.evictions = 0

    # ---- what the runner asks -------------------------------------------------------

    def acquire(self, ref: AdapterRef) -> int | None:
        """The slot serving ``ref`` for one more row (loading it if it is not resident);
        None when there is no room now (every resident adapter is in use)."""
        key = (ref.name, ref.fingerprint)
        found = self._resident.get(key)
        if found is None:
            for old in [k for k in self._resident if k[0] == ref.name]:  # its files changed
                if not self._users[self._resident[old].slot]:
                    self._evict(old)
            files = self._inspect(ref)
            need = files.elements * self._dtype.size  # held in the model's dtype
            if need > self.memory_bytes:
                raise AdapterError(
                    f"adapter {ref.name!r} needs {need / 2**20:.1f} MiB, more than "
                    f"adapter_memory_mb allows ({self.memory_bytes / 2**20:.0f} MiB)"
                )
            if not self._make_room(need):
                return None
            found = self._load(ref, files)
        self._resident.move_to_end(key)
        self._gone.discard(key)
        self._users[found.slot] += 1
        return found.slot

    def _inspect(self, ref: AdapterRef) -> AdapterFiles:
        """The adapter's files, checked against the base (read once per fingerprint: a
        request waiting for a slot asks again every step)."""
        key = (ref.path, ref.fingerprint)
        found = self._inspected.get(key)
        if found is None:
            found = adapter_files.inspect(Path(ref.path))
            found.check(self.targets, self.base_name)
            self._inspected[key] = found
            while len(self._inspected) > _INSPECTED:
                self._inspected.popitem(last=False)
        self._inspected.move_to_end(key)
        return found

    def release(self, slot: int) -> None:
        if slot <= 0:
            return
        self._users[slot] -= 1
        if self._users[slot] <= 0:
            del self._users[slot]
            found = self._by_slot.get(slot)
            if found is not None and (found.ref.name, found.ref.fingerprint) in self._gone:
                self._evict((found.ref.name, found.ref.fingerprint))

    def unload(self, name: str) -> None:
        """``name`` is no longer served: evicted now if idle, else when its last row ends."""
        for key in [k for k in self._resident if k[0] == name]:
            if self._users[self._resident[key].slot]:
                self._gone.add(key)
            else:
                self._evict(key)

    @property
    def resident(self) -> list[str]:
        return [k[0] for k in self._resident]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._resident.values())

    # ---- loading and eviction ----------------------------------------------------------

    def _make_room(self, nbytes: int) -> bool:
        while len(self._resident) >= self.max_adapters or self.nbytes + nbytes > self.memory_bytes:
            idle = [k for k, r in self._resident.items() if not self._users[r.slot]]
            if not idle:
                return False
            self._evict(idle[0])
        return True

    def _free_slot(self) -> int:
        used = set(self._by_slot)
        return next(s for s in range(1, self.max_adapters + 2) if s not in used)

    def _load(self, ref: AdapterRef, files: AdapterFiles) -> _Resident:
        try:
            tensors = mx.load(str(files.weights))
        except Exception as exc:  # noqa: BLE001 - any unreadable file: this adapter's error
            raise AdapterError(
                f"adapter {ref.name!r}: {files.weights} cannot be read: {exc}"
            ) from None
        found = dict(self.model.named_modules())
        factors: dict[str, Factors] = {}
        for m in files.modules:
            a, b = tensors[m.a], tensors[m.b]
            if m.a_transposed:
                a, b = a.T, b.T
            a = a.astype(mx.float32)
            b = b.astype(mx.float32) * m.scale
            f = None
            if m.magnitude is not None:
                layer = found[m.module]
                base = layer.base if isinstance(layer, MultiLoRALinear) else layer
                w = multi_lora.base_weight(base).astype(mx.float32)
                adapted = w + (a @ b).T
                f = tensors[m.magnitude].astype(mx.float32) / mx.linalg.norm(adapted, axis=1)
            factors[m.module] = (a.astype(self._dtype), b.astype(self._dtype), f)
        mx.eval([x for fs in factors.values() for x in fs if x is not None])
        if not all(
            mx.isfinite(x).all().item() for fs in factors.values() for x in fs if x is not None
        ):
            raise AdapterError(f"adapter {ref.name!r}: its tensors hold NaN or infinite values")
        nbytes = sum(x.nbytes for fs in factors.values() for x in fs if x is not None)
        slot = self._free_slot()
        ranks = {name: fs[0].shape[1] for name, fs in factors.items()}
        dora = {name for name, fs in factors.items() if fs[2] is not None}
        resident = _Resident(ref, files, ranks, dora, nbytes, slot)
        self._resident[(ref.name, ref.fingerprint)] = resident
        self._by_slot[slot] = resident
        self._layers = multi_lora.wrap(self.model, sorted(factors), self.rows)
        self._restack(set(factors), (slot, factors))
        self.loads += 1
        log.info(
            "adapter %s loaded in slot %d (%s, %s, %.1f MiB)",
            ref.name,
            slot,
            files.layout,
            files.kind,
            nbytes / 2**20,
        )
        return resident

    def _evict(self, key: tuple[str, str]) -> None:
        resident = self._resident.pop(key)
        del self._by_slot[resident.slot]
        self._gone.discard(key)
        self._restack(set(resident.ranks))
        self.evictions += 1
        log.info("adapter %s evicted from slot %d", key[0], resident.slot)

    def _restack(
        self, modules: set[str], fresh: tuple[int, dict[str, Factors]] | None = None
    ) -> None:
        """Re-stack the layers ``modules`` name; every wrapped layer when the highest
        slot in use changed (each stack holds slots 1..top: a row's slot is an index
        into every wrapped layer's stack, and MLX checks no bounds). A resident slot's
        factors are sliced back out of the layer's current stack (no second copy is
        kept); ``fresh``: the slot just loaded, with its factors."""
        top = max(self._by_slot, default=0)
        if top != self._top:
            modules, self._top = set(self._layers), top
        for name in modules:
            layer = self._layers[name]
            old = layer.stacks
            slots: list[Factors | None] = []  # slot s at index s - 1
            for s in range(1, top + 1):
                resident = self._by_slot.get(s)
                if fresh is not None and s == fresh[0]:
                    slots.append(fresh[1].get(name))
                elif resident is None or name not in resident.ranks or old.a is None:
                    slots.append(None)
                else:
                    r = resident.ranks[name]
                    i = s - 1
                    f = old.f[i, 0] if name in resident.dora and old.f is not None else None
                    slots.append((old.a[i, :, :r], old.b[i, :r, :], f))
            multi_lora.stack(layer, slots, self._dtype)


def _model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: its first floating-point linear weight's, or
    a quantized layer's scales'."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            return module.scales.dtype
        if isinstance(module, nn.Linear):
            return module.weight.dtype
    return mx.float32
