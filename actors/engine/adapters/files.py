"""LoRA adapter directories as people have them, read without MLX and without fusing.

Two layouts, told apart by their weights file:

- mlx-lm's (``mlx_lm.lora``): ``adapter_config.json`` (``fine_tune_type`` "lora" or
  "dora", ``lora_parameters.scale``) and ``adapters.safetensors`` with, per adapted
  linear layer at module path ``P``, ``P.lora_a`` [in, r], ``P.lora_b`` [r, out] and,
  for DoRA, the magnitude ``P.m`` [out]. The update is ``scale · (x A) B``.
- PEFT's (Hugging Face): ``adapter_config.json`` (``r``, ``lora_alpha``,
  ``use_rslora``, ``use_dora``, ``rank_pattern``, ``alpha_pattern``) and
  ``adapter_model.safetensors`` with ``base_model.model.P.lora_A.weight`` [r, in],
  ``P.lora_B.weight`` [out, r] and, for DoRA, ``P.lora_magnitude_vector`` [out]. The
  scale is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), per module where the
  patterns say so.

``inspect`` reads the config and the safetensors header only (names, dtypes, shapes),
so the trio side can check an adapter against its base before any request uses it;
``AdapterFiles.check`` refuses one made for another base, naming the module and the
shapes. ``load`` (on the generation thread, where MLX runs) reads the tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

# safetensors dtypes → bytes per element (the header's names)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_MAX_HEADER = 100 << 20  # a header larger than this is not an adapter's


class AdapterError(ValueError):
    """An adapter directory that cannot be served (missing, malformed, unsupported)."""


class AdapterMismatch(AdapterError):
    """An adapter made for another base: a module it adapts is not the base's, or its
    shapes are not the base layer's."""


@dataclass(frozen=True)
class ModuleUpdate:
    """One adapted linear layer: tensor names in the weights file and the update's form."""

    module: str  # the module path in the base model
    a: str  # tensor name of A
    b: str  # tensor name of B
    magnitude: str | None  # DoRA's magnitude vector (None: plain LoRA)
    in_dims: int
    out_dims: int
    rank: int
    scale: float
    a_transposed: bool  # PEFT stores A as [r, in] and B as [out, r]


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter directory's contents as read from its config and header."""

    path: Path
    layout: str  # "mlx-lm" or "peft"
    kind: str  # "lora" or "dora"
    weights: Path
    modules: tuple[ModuleUpdate, ...]
    elements: int  # numbers in its factors (and DoRA magnitudes)
    dtypes: frozenset[str] = field(default_factory=frozenset)

    @property
    def nbytes(self) -> int:
        """What its factors take held in float32 (the most a base computes in)."""
        return self.elements * 4

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    def check(self, targets: Mapping[str, tuple[int, int]], base: str) -> None:
        """``AdapterMismatch`` unless every adapted module is one of the base's linear
        layers (``targets``: module path → (in, out)) with the same shapes."""
        for m in self.modules:
            have = targets.get(m.module)
            if have is None:
                raise AdapterMismatch(
                    f"adapter {self.path}: module {m.module!r} is not a linear layer of "
                    f"{base!r} (made for another base?)"
                )
            if have != (m.in_dims, m.out_dims):
                raise AdapterMismatch(
                    f"adapter {self.path}: module {m.module!r} maps {m.in_dims} → "
                    f"{m.out_dims} (A {_shape(m, 'a')}, B {_shape(m, 'b')}), but {base!r}'s "
                    f"layer maps {have[0]} → {have[1]}"
                )


def _shape(m: ModuleUpdate, which: str) -> str:
    if which == "a":
        dims = (m.rank, m.in_dims) if m.a_transposed else (m.in_dims, m.rank)
    else:
        dims = (m.out_dims, m.rank) if m.a_transposed else (m.rank, m.out_dims)
    return f"{dims[0]}×{dims[1]}"


def fingerprint(path: Path) -> str:
    """Names, sizes and modification times of the directory's files, hashed: it changes
    when the adapter's files do."""
    path = Path(path)
    items = []
    for name in (CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS):
        p = path / name
        if p.is_file():
            st = p.stat()
            items.append([name, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps([str(path.resolve()), items]).encode()).hexdigest()[:24]


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name → {dtype, shape, data_offsets}."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise AdapterError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise AdapterError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    for name, t in header.items():
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list)):
            raise AdapterError(f"{path}: tensor {name!r} has no shape")
    return header


def inspect(path: Path) -> AdapterFiles:
    """The adapter directory at ``path``, or ``AdapterError`` saying what is wrong."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterError(f"adapter {path}: not a directory")
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter {path}: {CONFIG} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {path}: {CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {path}: {CONFIG} is not a JSON object")
    if (path / MLX_WEIGHTS).is_file():
        return _mlx_lm(path, config)
    if (path / PEFT_WEIGHTS).is_file():
        return _peft(path, config)
    raise AdapterError(f"adapter {path}: neither {MLX_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT)")


def _number(config: Mapping[str, Any], key: str, where: str, default: Any = None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterError(f"{where}: {key} must be a number, not {value!r}")
    return float(value)


def _mlx_lm(path: Path, config: dict[str, Any]) -> AdapterFiles:
    where = f"adapter {path}: {CONFIG}"
    kind = config.get("fine_tune_type") or ("dora" if config.get("use_dora") else "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(
            f"{where}: fine_tune_type {kind!r} is not served per request (only lora and dora; "
            "a full fine-tune is a model of its own)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{where}: lora_parameters missing")
    scale = _number(params, "scale", where, 20.0)
    weights = path / MLX_WEIGHTS
    header = read_header(weights)
    modules = []
    for name in sorted(n for n in header if n.endswith(".lora_a")):
        module = name[: -len(".lora_a")]
        b_name = f"{module}.lora_b"
        if b_name not in header:
            raise AdapterError(f"adapter {path}: {name} has no {b_name}")
        a, b = header[name]["shape"], header[b_name]["shape"]
        if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise AdapterError(
                f"adapter {path}: module {module!r}: A {a} and B {b} are not [in, r] and "
                "[r, out] (a switch / mixture-of-experts adapter is not served per request)"
            )
        m_name = f"{module}.m"
        magnitude = m_name if kind == "dora" else None
        if magnitude is not None and header.get(m_name, {}).get("shape") != [b[1]]:
            raise AdapterError(f"adapter {path}: DoRA module {module!r} has no magnitude [{b[1]}]")
        modules.append(
            ModuleUpdate(module, name, b_name, magnitude, a[0], b[1], a[1], scale, False)
        )
    _leftovers(path, header, modules, ("lora_a", "lora_b", "m"))
    return _files(path, "mlx-lm", kind, weights, header, modules)


def _peft(path: Path, config: dict[str, Any]) -> AdapterFiles:
    where = f"adapter {path}: {CONFIG}"
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not served (only LORA)")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out (GPT-2 Conv1D layers) is not served")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where}: modules_to_save {config['modules_to_save']!r} replaces whole modules; "
            "only low-rank updates are served per request"
        )
    rank = _number(config, "r", where, 8)
    alpha = _number(config, "lora_alpha", where, 8)
    rslora = bool(config.get("use_rslora"))
    kind = "dora" if config.get("use_dora") else "lora"
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    weights = path / PEFT_WEIGHTS
    header = read_header(weights)
    modules = []
    for name in sorted(n for n in header if n.endswith(".lora_A.weight")):
        stem = name[: -len(".lora_A.weight")]
        b_name = f"{stem}.lora_B.weight"
        if b_name not in header:
            raise AdapterError(f"adapter {path}: {name} has no {b_name}")
        a, b = header[name]["shape"], header[b_name]["shape"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterError(
                f"adapter {path}: module {stem!r}: A {a} and B {b} are not [r, in] and [out, r]"
            )
        module = stem.removeprefix("base_model.model.")
        r = _pattern(rank_pattern, module, rank)
        al = _pattern(alpha_pattern, module, alpha)
        if int(r) != a[0]:
            raise AdapterError(
                f"adapter {path}: module {module!r} has rank {a[0]}, config says {r:g}"
            )
        scale = al / math.sqrt(r) if rslora else al / r
        magnitude = None
        if kind == "dora":
            magnitude = next(
                (
                    m
                    for m in (
                        f"{stem}.lora_magnitude_vector",
                        f"{stem}.lora_magnitude_vector.weight",
                    )
                    if header.get(m, {}).get("shape") == [b[0]]
                ),
                None,
            )
            if magnitude is None:
                raise AdapterError(
                    f"adapter {path}: DoRA module {module!r} has no magnitude vector"
                )
        modules.append(ModuleUpdate(module, name, b_name, magnitude, a[1], b[0], a[0], scale, True))
    _leftovers(
        path,
        header,
        modules,
        ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector", "lora_magnitude_vector.weight"),
    )
    return _files(path, "peft", kind, weights, header, modules)


def _pattern(patterns: Mapping[str, Any], module: str, default: float) -> float:
    """PEFT's per-module override: a key matches the module path's end (or as a regex)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module) or module.endswith(f".{key}") or module == key:
            return float(value)
    return default


def _leftovers(path: Path, header: Mapping[str, Any], modules: list[ModuleUpdate], ends) -> None:
    """Tensors that are no part of a low-rank update (trained embeddings, biases, a
    whole head) change the model in ways the per-request path does not apply: refused."""
    if not modules:
        raise AdapterError(f"adapter {path}: no LoRA layers in its weights file")
    used = {n for m in modules for n in (m.a, m.b, m.magnitude) if n}
    other = sorted(n for n in header if n not in used)
    if other:
        shown = ", ".join(other[:3]) + (" ..." if len(other) > 3 else "")
        raise AdapterError(
            f"adapter {path}: tensors that are not LoRA updates of linear layers ({shown}); "
            "embedding and full-module adapters are not served per request"
        )


def _files(
    path: Path, layout: str, kind: str, weights: Path, header: Mapping[str, Any], modules
) -> AdapterFiles:
    elements = 0
    dtypes = set()
    for m in modules:
        for n in (m.a, m.b, m.magnitude):
            if n is None:
                continue
            t = header[n]
            dtypes.add(t.get("dtype", ""))
            elements += math.prod(t["shape"])
    bad = dtypes - set(_DTYPE_BYTES)
    if bad:
        raise AdapterError(f"adapter {path}: tensor dtypes {sorted(bad)} are not served")
    return AdapterFiles(path, layout, kind, weights, tuple(modules), elements, frozenset(dtypes))
