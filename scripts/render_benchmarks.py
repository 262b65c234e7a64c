"""Render ``docs/benchmarks.md`` and its charts (``docs/charts/*.svg``) from the benchmark
records in ``docs/results/*.jsonl`` (``scripts/records.py``).

    python -m mlxd.scripts.render_benchmarks            # after a benchmark wrote a record
    python -m mlxd.scripts.render_benchmarks --check    # exit 1 if the page is out of date

The page shows the newest record of each benchmark on each machine: first a table of
mlxd's ratio against its peer for every compared workload, then per benchmark its
command, date and machine, a chart, the record's notes under the chart, and its figures.

A record's ``rows`` take one of two shapes:

- **compared rows**: ``workload``, ``metric``, ``better`` (``"lower"`` or ``"higher"``),
  optional ``unit``, and either ``mlxd`` and ``peer`` (the two values) or ``ratio``
  (mlxd's value over the peer's, as measured). They make the ratio table and a chart of
  mlxd against the peer per workload (peer = 1 where only the ratio is recorded).
- **any other rows** (e.g. ``bench_tools``: ``model``, ``category``, ``arm`` and shares):
  a table of their columns; rows with an ``arm`` column get a chart of every share
  (a number in [0, 1]) per workload, one bar per arm.

Flat ``figures`` (``{label: number}``) are a table. No trio, no mlx.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlxd.scripts import records

DOCS = records.RESULTS.parent
PAGE = "benchmarks.md"
CHARTS = "charts"
MLXD_COLOR, PEER_COLOR = "#1f6fb4", "#9a9a9a"
ARM_COLORS = ("#1f6fb4", "#9a9a9a", "#e08a2c", "#3a9a5b", "#8e5bb5")

HEADER = """# Benchmarks

<!-- Rendered by scripts/render_benchmarks.py from docs/results/*.jsonl: change the
records or the script, never this page (tests/test_docs.py checks it is up to date). -->

Each benchmark script appends a record of what it measured (the command, the date, the
machine, the peer it was measured against in the same run, and the figures) to
`docs/results/NAME.jsonl`; this page shows the newest record of each benchmark on each
machine. How to run them and what is still owed: [Development](development.md#benchmarks).
"""


# ---- records --------------------------------------------------------------------------


def newest(results: Path) -> list[dict[str, Any]]:
    """The newest record of each benchmark on each machine, by benchmark name then machine."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(results.glob("*.jsonl")):
        for record in records.read(path):
            key = (record["name"], record["machine"])
            if key not in best or record["date"] >= best[key]["date"]:
                best[key] = record
    return [best[key] for key in sorted(best)]


def is_compared(row: dict[str, Any]) -> bool:
    has_values = "ratio" in row or ("mlxd" in row and "peer" in row)
    return {"workload", "metric", "better"} <= row.keys() and has_values


def raw_ratio(row: dict[str, Any]) -> float:
    """mlxd's value over the peer's."""
    return float(row["ratio"]) if "ratio" in row else row["mlxd"] / row["peer"]


def advantage(row: dict[str, Any]) -> float:
    """How many times better mlxd did: above 1, mlxd was better (faster, more)."""
    ratio = raw_ratio(row)
    return ratio if row["better"] == "higher" else 1 / ratio


def compared(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in record.get("rows") or [] if is_compared(row)]


def other_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in record.get("rows") or [] if not is_compared(row)]


# ---- formatting -----------------------------------------------------------------------


def number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "–" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN: nothing measured
            return "–"
        if abs(value) >= 1_000:
            return f"{value:,.0f}"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def _cell(text: str) -> str:
    """A table cell: a pipe in it (``|Δ log-prob|``) would end the cell."""
    return text.replace("\\|", "|").replace("|", "\\|")


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, cells)) + " |" for cells in rows]
    return "\n".join(lines)


def ratio(value: float) -> str:
    """mlxd's advantage, bold only where mlxd is ahead (above ×1.00)."""
    text = f"×{value:.2f}"
    return f"**{text}**" if round(value, 2) > 1 else text


def against_itself(record: dict[str, Any]) -> bool:
    """Whether the record compares mlxd with itself (another setting, the page closed)
    rather than with a peer (another server or library)."""
    return record.get("against") == "itself"


def slug(text: str) -> str:
    """A file-name-safe form of ``text``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def anchor(heading: str) -> str:
    """The id Python-Markdown's table of contents gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _metric(row: dict[str, Any]) -> str:
    unit = row.get("unit") or ""
    return f"{row['metric']} ({unit})" if unit and unit != row["metric"] else str(row["metric"])


def _date(record: dict[str, Any]) -> str:
    """The day the figures were measured (``measured``, where a record carries an earlier
    run's figures), else the record's own date."""
    recorded = str(record["date"])[:10]
    measured = record.get("measured")
    return f"{measured} (recorded {recorded})" if measured else recorded


# ---- the page -------------------------------------------------------------------------


def ratio_table(recs: list[dict[str, Any]], itself: bool = False) -> str:
    """One line per benchmark, machine and metric: mlxd's advantage over the peer (or, with
    ``itself``, over mlxd in another setting), the lowest to the highest over the workloads."""
    recs = [r for r in recs if against_itself(r) == itself]
    machines = len({r["machine"] for r in recs}) > 1
    body = []
    for record in recs:
        by_metric: dict[str, list[dict[str, Any]]] = {}
        for row in compared(record):
            by_metric.setdefault(str(row["metric"]), []).append(row)
        for metric, rows in by_metric.items():
            low, high = min(map(advantage, rows)), max(map(advantage, rows))
            same = f"{low:.2f}" == f"{high:.2f}"
            span = ratio(low) if same else f"{ratio(low)} – {ratio(high)}"
            cells = [f"[{record['name']}](#{anchor(record['name'])})"]
            cells += [number(record["machine"])] if machines else []
            cells += [number(record.get("peer") or "–"), number(metric),
                      _workloads(rows), span]  # fmt: skip
            body.append(cells)
    peer = "compared with" if itself else "peer"
    header = ["benchmark", *(["machine"] if machines else []), peer, "metric", "workloads"]
    intro = (
        "## Against the peer\n\nThe newest records' workloads measured against another "
        "server or library in the same run. The advantage is how many times better mlxd did "
        "(faster, or more): above ×1 mlxd was ahead, and only that is bold; a range spans the "
        "workloads.\n\n"
        if not itself
        else "## mlxd against itself\n\nWhat a feature or setting costs or gains, measured "
        "against mlxd without it in the same run; not a comparison with another server.\n\n"
    )
    return intro + table([*header, "mlxd's advantage"], body) if body else ""


def _workloads(rows: list[dict[str, Any]]) -> str:
    if len(rows) > 3:
        return f"{len(rows)} workloads"
    return "; ".join(number(r["workload"]) for r in rows)


def figures_table(record: dict[str, Any]) -> str:
    figures = record.get("figures") or {}
    if not figures:
        return ""
    return table(["figure", "value"], ([number(k), number(v)] for k, v in figures.items()))


def rows_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    # the labels (text) first, then the numbers (a record's keys come back sorted)
    columns.sort(key=lambda c: not all(isinstance(r.get(c), str) for r in rows))
    return table(columns, ([number(row.get(c)) for c in columns] for row in rows))


def compared_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    body = (
        [number(r["workload"]) + (f" (measured {r['measured']})" if r.get("measured") else ""),
         _metric(r), number(r.get("mlxd", "–")),
         number(r.get("peer", "–")), ratio(advantage(r))]
        for r in rows
    )  # fmt: skip
    return table(["workload", "metric", "mlxd", "peer", "mlxd's advantage"], body)


def section(record: dict[str, Any], chart: str | None, subheading: bool) -> str:
    parts = [f"### {record['machine']}"] if subheading else []
    peer = record.get("peer")
    parts.append(
        f"Measured {_date(record)} on {record['machine']}"
        + (f", against {peer}" if peer else "")
        + f":\n\n```sh\n{record['command']}\n```"
    )
    parts.append(provenance(record))
    if chart:
        parts.append(f"![{record['name']}: mlxd against its peer]({chart})")
    if record.get("notes"):
        parts.append(record["notes"].strip())
    for block in (
        compared_table(compared(record)),
        rows_table(other_rows(record)),
        figures_table(record),
    ):
        if block:
            parts.append(block)
    return "\n\n".join(parts)


PROVENANCE = (
    ("model", "model"),
    ("weights", "weights"),
    ("samples", "sample"),
    ("spread", "spread"),
)


def provenance(record: dict[str, Any]) -> str:
    """What the figures rest on: the model, whether its weights are real or random, the
    sample size and the spread; "not recorded" where an older record does not say."""
    cells = [f"{label}: {record.get(key) or 'not recorded'}" for key, label in PROVENANCE]
    return "*" + "; ".join(cells) + ".*"


def banner(recs: list[dict[str, Any]]) -> str:
    """Where the figures come from, while no record is from a GPU or a Mac."""
    machines = sorted({r["machine"] for r in recs})
    if any(re.search(r"cuda|metal|gpu|apple|nvidia|h100|h200", m, re.I) for m in machines):
        return ""
    return (
        '!!! warning "Where these figures come from"\n'
        f"    Every figure on this page comes from {'; '.join(machines)}: MLX's CPU backend, "
        "with small models. They compare implementations on that machine and say nothing of "
        "the speed on a GPU or a Mac; GPU (CUDA) and Metal figures are owed "
        "([Development](development.md#benchmarks))."
    )


def render(results: Path, out: Path) -> Path:
    """Write ``out/benchmarks.md`` and ``out/charts/*.svg``; returns the page."""
    recs = newest(results)
    charts = out / CHARTS
    charts.mkdir(parents=True, exist_ok=True)
    for stale in charts.glob("*.svg"):
        stale.unlink()
    parts = [HEADER.strip()]
    if warning := banner(recs):
        parts.append(warning)
    for itself in (False, True):
        if table_md := ratio_table(recs, itself):
            parts.append(table_md)
    names = sorted({r["name"] for r in recs})
    for name in names:
        mine = [r for r in recs if r["name"] == name]
        parts.append(f"## {name}")
        for record in mine:
            chart = draw(record, charts)
            parts.append(section(record, chart and f"{CHARTS}/{chart}", len(mine) > 1))
    page = out / PAGE
    page.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return page


# ---- charts ---------------------------------------------------------------------------


def draw(record: dict[str, Any], charts: Path) -> str | None:
    """The record's chart as an SVG in ``charts``; its file name, or None if it has none."""
    panels = _compared_panels(compared(record)) or _arm_panels(other_rows(record))
    if not panels:
        return None
    name = f"{slug(record['name'])}-{slug(record['machine'])}.svg"
    _plot(panels, record, charts / name)
    return name


def _compared_panels(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One panel per metric: per workload, mlxd's bar beside the peer's."""
    panels: dict[str, dict[str, Any]] = {}
    for row in rows:
        relative = "mlxd" not in row
        title = f"{row['metric']} (peer = 1)" if relative else _metric(row)
        title += ", lower is better" if row["better"] == "lower" else ", higher is better"
        panel = panels.setdefault(title, {"title": title, "labels": [], "series": {}})
        panel["labels"].append(str(row["workload"]))
        mlxd, peer = (raw_ratio(row), 1.0) if relative else (row["mlxd"], row["peer"])
        panel["series"].setdefault("mlxd", []).append(mlxd)
        panel["series"].setdefault("peer", []).append(peer)
    return list(panels.values())


def _arm_panels(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with an ``arm``: one panel per share column, per workload one bar per arm."""
    if not rows or not all("arm" in row for row in rows):
        return []
    keys = list(dict.fromkeys(k for r in rows for k in r))
    shares = [
        key
        for key in keys
        if any(isinstance(r.get(key), float) for r in rows)
        and all(
            r.get(key) is None or (isinstance(r[key], float) and 0 <= r[key] <= 1) for r in rows
        )
    ]
    labels_of = [k for k in rows[0] if k != "arm" and isinstance(rows[0][k], str)]
    arms = list(dict.fromkeys(str(r["arm"]) for r in rows))
    workloads = list(dict.fromkeys(" / ".join(str(r[k]) for k in labels_of) for r in rows))
    panels = []
    for key in shares:
        series = {arm: [float("nan")] * len(workloads) for arm in arms}
        for r in rows:
            where = workloads.index(" / ".join(str(r[k]) for k in labels_of))
            value = r.get(key)  # None: the arm made no call to share over; no bar, a dash
            series[str(r["arm"])][where] = float("nan") if value is None else value
        better = "lower" if key in LOWER_IS_BETTER else "higher"
        panels.append({"title": f"{key} (share, {better} is better)", "labels": workloads,
                       "series": series})  # fmt: skip
    return panels


# Shares in a per-arm table where less is the better result (markup left in the answer).
LOWER_IS_BETTER = frozenset({"call_in_content"})


def _plot(panels: list[dict[str, Any]], record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "mlxd", "svg.fonttype": "none", "font.size": 9})
    height = sum(0.9 + 0.32 * len(p["labels"]) * len(p["series"]) for p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, height), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _bars(ax, panel, record.get("peer") or "peer")
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def _bars(ax, panel: dict[str, Any], peer: str) -> None:
    labels, series = panel["labels"], panel["series"]
    width = 0.8 / len(series)
    for i, (arm, values) in enumerate(series.items()):
        color = {"mlxd": MLXD_COLOR, "peer": PEER_COLOR}.get(arm, ARM_COLORS[i % len(ARM_COLORS)])
        label = peer if arm == "peer" else arm
        ys = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.barh(ys, values, height=width, color=color, label=label)
        ax.bar_label(bars, labels=[number(v) for v in values], padding=3, fontsize=8)
    ax.set_yticks(range(len(labels)), labels=labels)
    ax.invert_yaxis()
    ax.set_title(panel["title"], fontsize=9, loc="left")
    ax.margins(x=0.18)
    # beside the axes, never over a bar
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# ---- command line ---------------------------------------------------------------------


def up_to_date(results: Path, docs: Path) -> list[str]:
    """What differs between the committed page and charts and a fresh rendering."""
    with tempfile.TemporaryDirectory(prefix="mlxd-benchmarks-") as tmp:
        fresh = render(results, Path(tmp))
        wrong = [] if _same(fresh, docs / PAGE) else [str(docs / PAGE)]
        new = {p.name for p in (Path(tmp) / CHARTS).glob("*.svg")}
        old = {p.name for p in (docs / CHARTS).glob("*.svg")}
        wrong += [f"{docs / CHARTS / n} (missing)" for n in sorted(new - old)]
        wrong += [f"{docs / CHARTS / n} (no record draws it)" for n in sorted(old - new)]
    return wrong


def _same(a: Path, b: Path) -> bool:
    return b.is_file() and filecmp.cmp(a, b, shallow=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=records.RESULTS)
    p.add_argument("--out", type=Path, default=DOCS, help="where benchmarks.md and charts/ go")
    p.add_argument("--check", action="store_true", help="render elsewhere and compare; no writes")
    args = p.parse_args(argv)
    if args.check:
        wrong = up_to_date(args.results, args.out)
        for item in wrong:
            print(f"out of date: {item}", file=sys.stderr)
        return 1 if wrong else 0
    print(render(args.results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
