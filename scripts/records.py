"""Benchmark records: each benchmark script appends what it measured to ``docs/results/NAME.jsonl``.

A record is one JSON object a line: ``name`` (the benchmark), ``command`` (how to run it
again), ``date`` (UTC, ISO 8601), ``machine`` (what it ran on), ``peer`` (what mlxd was
compared against, or null), ``figures`` (a flat ``{label: number}`` map, or a list of such
rows under ``rows`` for a per-workload table) and ``notes`` (a sentence or two that explain
the numbers). ``scripts/render_benchmarks.py`` draws ``docs/benchmarks.md`` from the newest
record of each benchmark per machine. No trio, no mlx.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def machine() -> str:
    """A short description of this machine: OS, CPU architecture and cores; ``MLXD_MACHINE``
    (e.g. ``"NVIDIA H100 80GB, CUDA"``) overrides it where the accelerator matters."""
    named = os.environ.get("MLXD_MACHINE")
    if named:
        return named
    cores, system = os.cpu_count(), platform.system()
    flags, cpu = _cpuinfo()
    if system == "Linux" and "hypervisor" in flags:  # one name for the VM every record ran on
        blas = ", OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else ""
        brand = f" ({cpu})" if cpu else ""
        return f"shared {cores}-core Linux VM{brand}, CPU backend{blas}"
    return f"{system} {platform.machine()}, {cores} cores, CPU backend"


def _cpuinfo() -> tuple[set[str], str]:
    """Linux: the CPU's flags and its brand's first two words (``AMD EPYC``); else empty."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), ""
    flags: set[str] = set()
    brand = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name" and not brand:
            brand = " ".join(value.split()[:2])
    return flags, brand


def command(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command line that ran this benchmark (``python -m MODULE ARGS`` when given a module)."""
    args = sys.argv[1:] if argv is None else argv
    head = f"python -m {module}" if module else shlex.quote(sys.argv[0])
    return " ".join([head, *(shlex.quote(a) for a in args)])


def write(
    name: str,
    *,
    command: str,
    figures: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
    peer: str | None = None,
    notes: str = "",
    machine_name: str | None = None,
    results: Path | None = None,
    against: str | None = None,
    model: str = "",
    weights: str = "",
    samples: str = "",
    spread: str = "",
) -> Path:
    """Append one record for benchmark ``name``; returns the results file.

    ``against``: ``"peer"`` (another server or library) or ``"itself"`` (mlxd with another
    setting); the page keeps the two apart. ``model``, ``weights`` (``"real"`` or
    ``"random"``), ``samples`` (how many requests, runs or cases) and ``spread`` (over the
    runs, or a p95 beside a p50) say what the figures rest on."""
    record = {
        "name": name,
        "command": command,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_name or machine(),
        "peer": peer,
        "figures": figures or {},
        "rows": rows or [],
        "notes": notes,
        **({"against": against or "peer"} if peer else {}),
        **{
            k: v
            for k, v in (
                ("model", model),
                ("weights", weights),
                ("samples", samples),
                ("spread", spread),
            )
            if v
        },  # fmt: skip
    }
    folder = results or Path(os.environ.get("MLXD_RESULTS_DIR", RESULTS))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    return path


def compared(
    workload: str,
    metric: str,
    *,
    better: str,
    mlxd: float | None = None,
    peer: float | None = None,
    ratio: float | None = None,
    unit: str = "",
) -> dict[str, Any]:
    """A row comparing mlxd with the record's peer on one metric of one workload: both
    values, or only ``ratio`` (mlxd's over the peer's); ``better`` is "lower" or "higher".
    ``scripts/render_benchmarks.py`` charts these rows and lists their ratios."""
    row: dict[str, Any] = {"workload": workload, "metric": metric, "better": better}
    if unit:
        row["unit"] = unit
    if ratio is not None:
        row["ratio"] = ratio
    else:
        row["mlxd"], row["peer"] = mlxd, peer
    return row


_LABELS = ("model", "run", "server", "name", "label")


def numbers(tree: Any, prefix: str = "") -> dict[str, float]:
    """Every number in a benchmark's result (nested dicts and lists) as flat figures,
    labelled by its path: a list item by its ``model`` / ``run`` / ``server`` / ``name``
    where it has one, else by its index. Strings and booleans are left out."""
    if isinstance(tree, bool):
        return {}
    if isinstance(tree, int | float):
        return {prefix or "value": tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = ((_label(item, i), item) for i, item in enumerate(tree))
    else:
        return {}
    out: dict[str, float] = {}
    for key, value in items:
        out |= numbers(value, f"{prefix} {key}".strip())
    return out


def _label(item: Any, index: int) -> str:
    if isinstance(item, dict):
        return next((str(item[k]) for k in _LABELS if isinstance(item.get(k), str)), str(index))
    return str(index)


def read(path: Path) -> list[dict[str, Any]]:
    """Every record in one results file, oldest first."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
