"""``python -m mlxd.scripts.bench``: the benchmark ``mlxd bench`` runs (``daemon/bench.py``),
with the same flags, e.g. ``--url http://127.0.0.1:8000 --concurrency 1,8,32``; it also
appends the run to ``docs/results`` as a record (``scripts/records.py``)."""

from __future__ import annotations

import sys

from mlxd.daemon.bench import LevelResult, main, ratios
from mlxd.scripts import records


def record(results: list[LevelResult], both: bool, argv: list[str]) -> None:
    """The run as a record (docs/benchmarks.md is rendered from them): ``--both`` compares
    the server with the engine in-process; one mode alone has figures only."""
    rows = [
        records.compared(f"{c} at once", "tok/s", better="higher", ratio=ratio)
        for c, ratio in ratios(results).items()
    ]
    figures = {
        f"{r.mode}, {r.concurrency} at once, {key}": r.summary()[key]
        for r in results
        for key in ("tok_s", "wall_s")
    }
    name = "mlxd_bench" if both else f"mlxd_bench_{results[0].mode if results else 'server'}"
    peer = "the same engine in-process" if both else None
    command = records.command(argv, module="mlxd.scripts.bench")
    records.write(name, command=command, peer=peer, rows=rows, figures=figures)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], record=record))
