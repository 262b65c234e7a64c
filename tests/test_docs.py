"""The documentation is tested like code: the site under ``docs/`` builds in strict mode
(a broken link or anchor fails), every setting, ``mlxd`` subcommand and HTTP route has
its entry on its page, the README stays a front door, the benchmarks page is the one
its records render, and the command line's help points at the pages."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trio

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = (
    "index.md", "start-macos.md", "start-linux.md", "start-cuda.md", "choosing.md",
    "clients.md", "deploying.md", "changelog.md", "api/index.md", "api/openai.md", "api/anthropic.md",
    "api/ollama.md", "api/llamacpp.md", "api/mlxd.md", "families.md", "tools.md", "models.md", "caching.md", "speculative.md",
    "completion.md", "operations.md", "scaling.md", "troubleshooting.md", "benchmarks.md",
    "development.md",
)  # fmt: skip


def _page(name: str) -> str:
    path = DOCS / name
    assert path.is_file(), f"docs/{name} is missing"
    return path.read_text(encoding="utf-8")


def _missing(what: str, page: str, missing: list[str]) -> str:
    return f"{len(missing)} {what} not documented on docs/{page}: " + ", ".join(missing)


# ---- the site -----------------------------------------------------------------------------------


def test_every_page_is_in_the_nav():
    config = _page("mkdocs.yml")
    nav = re.findall(r"^\s+- [^:\n]+: (\S+\.md)\s*$", config, flags=re.M)
    assert sorted(nav) == sorted(PAGES), f"nav: {nav}"
    for name in PAGES:
        _page(name)


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (scripts/install --test)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    pytest.importorskip("mkdocs_same_dir", reason="mkdocs-same-dir is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml")]
    done = subprocess.run(
        [*command, "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-3000:]
    for name in PAGES:
        built = name[:-3] + ".html" if name.endswith("index.md") else f"{name[:-3]}/index.html"
        assert (tmp_path / "site" / built).is_file(), built


# ---- coverage: settings, subcommands, routes ----------------------------------------------------


def _setting_paths(table: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            paths += _setting_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def test_every_setting_is_on_the_operations_page():
    defaults = tomllib.loads((ROOT / "config" / "default.toml").read_text(encoding="utf-8"))
    paths = _setting_paths(defaults)
    assert len(paths) > 100  # every table of config/default.toml, not a few
    page = _page("operations.md")
    missing = [p for p in paths if f"`{p}`" not in page]
    assert not missing, _missing("settings", "operations.md", missing)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from mlxd.daemon import cli

    parser = cli._parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_is_on_the_operations_page():
    names = list(_subcommands())
    assert {"serve", "config", "bench", "status", "parse"} <= set(names)
    page = _page("operations.md")
    missing = [f"mlxd {n}" for n in names if f"`mlxd {n}" not in page]
    assert not missing, _missing("subcommands", "operations.md", missing)


def _app():
    """The daemon's app over a pipeline that runs nothing: its routes, not its answers."""
    from mlxd.actors.mailbox import Mailboxes
    from mlxd.daemon.app import create_app
    from mlxd.daemon.history import History
    from mlxd.daemon.pipeline import Pipeline
    from mlxd.daemon.settings import load_settings

    admission, _ = trio.open_memory_channel(1)
    engine, _ = trio.open_memory_channel(1)
    pipeline = Pipeline(admission, engine, Mailboxes(), history=History())
    return create_app(pipeline, load_settings(None, None, {}))


def _routes() -> list[tuple[str, frozenset[str]]]:
    return [
        (rule.rule, frozenset(rule.methods - {"HEAD", "OPTIONS"}))
        for rule in _app().url_map.iter_rules()
        if rule.endpoint != "static"  # Quart's own static folder, which mlxd does not use
    ]


def _route_pattern(rule: str) -> re.Pattern[str]:
    """``/v1/models/<path:model_id>/load`` matches ``/v1/models/{id}/load`` in the page."""
    parts = re.split(r"<[^>]+>", rule)
    body = r"\{[^}/]+\}".join(re.escape(p) for p in parts)
    return re.compile(body + r"(?![\w/{-])")


def test_every_route_is_on_the_api_pages():
    """A row of the overview's route table per route (with its methods), and the page it
    links to, the route's API's, has the route too."""
    routes = _routes()
    assert len(routes) > 25
    lines = _page("api/index.md").splitlines()
    missing, unlinked = [], []
    for rule, methods in sorted(routes, key=lambda r: r[0]):
        pattern = _route_pattern(rule)
        rows = [line for line in lines if pattern.search(line)]
        rows = [row for row in rows if all(re.search(rf"\b{m}\b", row) for m in methods)]
        name = f"{'/'.join(sorted(methods))} {rule}"
        if not rows:
            missing.append(name)
            continue
        linked = re.search(r"\]\((\w+\.md)(#[\w-]+)?\)", rows[0])
        if not linked or not pattern.search(_page(f"api/{linked.group(1)}")):
            unlinked.append(f"{name} ({linked.group(0) if linked else 'no link'})")
    assert not missing, _missing("routes", "api/index.md", missing)
    assert not unlinked, f"routes not on the API page their row links to: {', '.join(unlinked)}"


def test_a_route_pattern_matches_only_its_own_path():
    pattern = _route_pattern("/v1/models")
    assert pattern.search("| `GET /v1/models` | every model |")
    assert not pattern.search("| `GET /v1/models/{id}` | one model |")
    assert _route_pattern("/v1/models/<path:model_id>/load").search("`POST /v1/models/{id}/load`")


# ---- the README ---------------------------------------------------------------------------------


def test_the_readme_is_a_front_door_of_at_most_400_lines():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 400, f"README.md has {len(readme.splitlines())} lines"
    # the two set-up commands CI runs, and links into the site
    assert "./scripts/install && .venv/bin/mlxd serve" in readme
    assert "./scripts/install --test && ./scripts/test" in readme
    linked = set(re.findall(r"\]\(docs/([a-z_/-]+\.md)", readme))
    assert set(PAGES) - {"index.md"} <= linked, set(PAGES) - linked


def test_the_readme_s_client_configurations_are_the_clients_page_s():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use with") : readme.index("## Headline numbers")]
    blocks = re.findall(r"```\w*\n.*?```", section, flags=re.S)
    assert len(blocks) >= 10
    page = _page("clients.md")
    missing = [b.splitlines()[1] for b in blocks if b not in page]
    assert not missing, f"README client blocks not on docs/clients.md: {missing}"


# ---- benchmarks ---------------------------------------------------------------------------------


def test_the_benchmarks_page_is_rendered_from_the_records():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/install --test)")
    from mlxd.scripts import render_benchmarks

    wrong = render_benchmarks.up_to_date(DOCS / "results", DOCS)
    hint = "re-render with `python -m mlxd.scripts.render_benchmarks`"
    assert not wrong, f"{hint}: {', '.join(wrong)}"


def test_the_renderer_takes_compared_rows_other_rows_and_flat_figures(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/install --test)")
    from mlxd.scripts import records, render_benchmarks

    results = tmp_path / "results"
    rows = [
        records.compared("chat, 8 at once", "tok/s", better="higher", mlxd=120.0, peer=100.0),
        records.compared("chat, 32 at once", "TTFT p50", better="lower", ratio=0.5, unit="s"),
    ]
    records.write("bench_a", command="a", peer="mlx_lm.server", rows=rows, results=results)
    arms = [
        {"model": "m", "category": "simple", "arm": arm, "ast_accuracy": share, "errors": 0}
        for arm, share in (("mlxd", 0.9), ("mlx_lm.server", 0.6))
    ]
    records.write("bench_tools", command="t", peer="mlx_lm.server", rows=arms, results=results)
    records.write("bench_b", command="b", figures={"loads (s)": 1.5}, notes="Why.", results=results)
    page = render_benchmarks.render(results, tmp_path / "out").read_text()
    head = "| [bench_a](#bench_a) | mlx_lm.server |"
    assert f"{head} tok/s | chat, 8 at once | **×1.20** |" in page
    assert f"{head} TTFT p50 | chat, 32 at once | **×2.00** |" in page  # from the ratio
    assert "| arm | category | model | ast_accuracy | errors |" in page  # labels first
    assert "| mlxd | simple | m | 0.9 | 0 |" in page
    assert "| loads (s) | 1.5 |" in page
    assert page.index("![bench_tools") < page.index("| arm | category |")
    charts = sorted(p.name for p in (tmp_path / "out" / "charts").glob("*.svg"))
    assert len(charts) == 2 and all(f"charts/{c}" in page for c in charts)  # bench_b: no chart


def test_the_page_keeps_peers_and_mlxd_against_itself_apart_and_bolds_only_wins(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/install --test)")
    from mlxd.scripts import records, render_benchmarks

    results = tmp_path / "results"
    lose = records.compared("chat", "tok/s", better="higher", mlxd=85.0, peer=100.0)
    win = records.compared("agents", "tok/s", better="higher", mlxd=200.0, peer=100.0)
    records.write("bench_p", command="p", peer="mlx_lm.server", rows=[lose, win],
                  results=results, model="m", weights="random", samples="6 requests")  # fmt: skip
    records.write("bench_s", command="s", peer="plain decoding", against="itself",
                  rows=[lose], results=results)  # fmt: skip
    records.write("bench_f", command="f", figures={"|Δ log-prob|": 0.123456}, results=results)
    page = render_benchmarks.render(results, tmp_path / "out").read_text()
    peers, itself = page.split("## mlxd against itself")[0], page.split("## mlxd against itself")[1]
    assert "[bench_p]" in peers and "[bench_s]" not in peers
    assert "| [bench_s](#bench_s) | plain decoding |" in itself.split("## bench_f")[0]
    assert "×0.85 – **×2.00**" in page  # the loss plain, the win bold
    assert "**×0.85**" not in page
    assert "| \\|Δ log-prob\\| | 0.123 |" in page  # a pipe escaped, a value rounded
    assert "weights: random; sample: 6 requests; spread: not recorded" in page
    assert '!!! warning "Where these figures come from"' in page
    records.write("bench_g", command="g", figures={"x": 1}, machine_name="NVIDIA H200, CUDA",
                  results=results)  # fmt: skip
    assert "!!! warning" not in render_benchmarks.render(results, tmp_path / "o2").read_text()


def test_the_newest_record_of_a_benchmark_and_machine_is_the_one_shown(tmp_path):
    from mlxd.scripts import render_benchmarks

    results = tmp_path / "results"
    results.mkdir()
    old = {"name": "x", "command": "c", "machine": "m", "peer": None, "rows": [], "notes": ""}
    lines = [
        {**old, "date": "2026-01-02T00:00:00+00:00", "figures": {"v": 2}},
        {**old, "date": "2026-01-01T00:00:00+00:00", "figures": {"v": 1}},
        {**old, "machine": "n", "date": "2026-01-01T00:00:00+00:00", "figures": {"v": 3}},
    ]
    (results / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    shown = render_benchmarks.newest(results)
    assert [(r["machine"], r["figures"]["v"]) for r in shown] == [("m", 2), ("n", 3)]


# ---- help ---------------------------------------------------------------------------------------


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help().rstrip()


def test_every_help_ends_with_the_page_to_read():
    from mlxd.daemon import bench, cli

    helps = {"mlxd": _help(cli._parser()), "mlxd bench": _help(bench._parser())}
    helps |= {f"mlxd {name}": _help(p) for name, p in _subcommands().items() if name != "bench"}
    for command, text in helps.items():
        last = text.splitlines()[-1]
        match = re.search(r"docs/([a-z_]+\.md)(#[\w-]+)?", last)
        assert match, f"`{command} --help` does not end with a docs page: {last!r}"
        assert match.group(1) in PAGES, f"{command}: {match.group(1)} is not a page"
        if match.group(2):
            assert f'id="{match.group(2)[1:]}"' in _anchors(match.group(1)), match.group(0)


def _anchors(page: str) -> str:
    """The page's headings as Python-Markdown's table of contents names them."""
    from mlxd.scripts.render_benchmarks import anchor

    headings = re.findall(r"^#+ (.+)$", _page(page), flags=re.M)
    return " ".join(f'id="{anchor(h)}"' for h in headings)
