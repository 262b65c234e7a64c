"""Settings that cannot drift: the settings reference on ``docs/operations.md`` is rendered
from ``config/default.toml`` (its comments are the one source) and the code's types and
registries (``scripts/render_settings.py``); every value it lists is one the settings
accept, and a default, a value or a setting any page names is one the code holds."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
from mlxd.actors.engine.backend_policy import BACKENDS
from mlxd.actors.families import fim, formats
from mlxd.daemon.settings import Settings, SettingsError, load_settings
from mlxd.scripts import render_settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TOML = ROOT / "config" / "default.toml"


def _rows() -> list[tuple[str, render_settings.Row]]:
    sections = render_settings.parse(TOML.read_text(encoding="utf-8"))
    return [(f"{s.name}.{row.key}", row) for s in sections for row in s.rows]


def _accepts(path: str, value: object) -> bool:
    section, key = path.split(".")
    try:
        load_settings(None, {section: {key: value}})
    except SettingsError:
        return False
    return True


def test_the_pages_are_rendered_from_default_toml_and_the_registries():
    stale = [p.name for p, text in render_settings.pages().items() if p.read_text("utf-8") != text]
    assert not stale, f"re-render with `python -m mlxd.scripts.render_settings`: {stale}"


def test_every_setting_of_the_code_is_in_default_toml_with_the_code_s_default():
    rows = dict(_rows())
    code = msgspec.to_builtins(Settings())
    code.pop("models")
    paths = {f"{s}.{k}" for s, table in code.items() for k in table}
    assert paths == set(rows), paths ^ set(rows)
    loaded = msgspec.to_builtins(load_settings())
    for path in paths:
        section, key = path.split(".")
        assert loaded[section][key] == code[section][key], f"{path}: file and code differ"


def _probes(path: str, v: render_settings.Values) -> list[tuple[object, bool]]:
    """Values the page says a setting takes (True) and values just outside (False)."""
    if v.kind == "choices":
        wrong = "no-such-value" if any(isinstance(c, str) for c in v.choices) else 3
        return [(c, True) for c in v.choices] + [(wrong, False)]
    if v.kind not in ("int", "float"):
        return []
    step = 1 if v.kind == "int" else 0.01
    out: list[tuple[object, bool]] = [(c, True) for c in v.also]
    if v.low is not None:
        out += [(v.low, not v.low_open), (v.low - step, False)]
        if v.low_open:
            out.append((v.low + step, True))
    if v.high is not None:
        out += [(v.high, True), (v.high + step, False)]
    return out


def test_every_value_the_page_lists_is_accepted_and_none_past_it():
    types = render_settings._field_types()
    wrong = []
    for path, _ in _rows():
        if path.startswith("speculative.lookup_"):  # min <= max: probed apart below
            continue
        for value, ok in _probes(path, render_settings.values(path, types[path])):
            if _accepts(path, value) != ok:
                wrong.append(f"{path} = {value!r} {'refused' if ok else 'accepted'}")
    assert not wrong, wrong
    assert _accepts("speculative.lookup_min_ngram", 1)
    assert not _accepts("speculative.lookup_min_ngram", 0)


def test_the_tool_formats_are_the_registry_s_and_a_name_outside_it_is_refused():
    types = render_settings._field_types()
    listed = render_settings.values("tokenizer.tool_format", types["tokenizer.tool_format"])
    assert listed.choices == ("auto", *formats.TOOL_FORMATS)
    assert len(formats.TOOL_FORMATS) > 20  # the registry, not the five an old comment named


def _enumeration(comment: str) -> list[str] | None:
    """``a (why) | b | c`` in a comment: the words a setting is said to take."""
    if " | " not in comment:
        return None
    parts = re.split(r"\s\|\s", comment)
    first = parts[0].rsplit(": ", 1)[-1]
    return [re.match(r'"?([^\s"(]+)', p.strip()).group(1) for p in [first, *parts[1:]]]


def test_a_comment_lists_only_values_the_code_takes():
    types = render_settings._field_types()
    checked = 0
    for path, row in _rows():
        words = _enumeration(" ".join(row.comment))
        if words is None:
            continue
        v = render_settings.values(path, types[path])
        takes = {str(c).lower() for c in (*v.choices, *v.also)}
        extra = [w for w in words if w.lower() not in takes and not w.startswith("<")]
        assert not extra, f"{path}: the comment names {extra}, the code takes {sorted(takes)}"
        checked += 1
    assert checked >= 5


def test_an_auto_value_a_comment_states_is_the_backend_table_s():
    for path, row in _rows():
        for number in re.findall(r"auto: (\d+)", " ".join(row.comment)):
            key = path.split(".")[1]
            held = {getattr(p, key, None) for p in BACKENDS.values()}
            assert int(number) in held, f"{path}: auto {number}, the table holds {held}"


# ---- other pages --------------------------------------------------------------------------

PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
SECTIONS = {f.name for f in msgspec.structs.fields(Settings)} - {"models"}
SETTINGS = {
    f"{s}.{k}" for s, t in msgspec.to_builtins(Settings()).items() if s in SECTIONS for k in t
}
NAMED = re.compile(r"`(" + "|".join(sorted(SECTIONS)) + r")\.([a-z_]+)\b")


# Names that look like settings and are not: /v1/status fields, a GGUF metadata key.
NOT_SETTINGS = {
    "model.fim", "admission.running", "memory.kv_reserved_bytes", "tokenizer.chat_template",
}  # fmt: skip


def test_every_setting_a_page_names_exists():
    paths = dict(_rows())
    missing = []
    for page in PAGES:
        for section, key in NAMED.findall(page.read_text("utf-8")):
            path = f"{section}.{key}"
            if path in paths or path in NOT_SETTINGS or key in ("py", "json", "model"):
                continue  # a setting, a status field, or a file (tokenizer.py, tokenizer.json)
            missing.append(f"{page.name}: {path}")
    assert not missing, missing


def _number(text: str) -> float:
    return float(text.replace(",", "").replace("_", ""))


# `table.key` (512 ...  /  `table.key`, 512 s  /  `table.key` (default 4  /  `table.key`, default 4
STATED = re.compile(
    r"`((?:" + "|".join(sorted(SECTIONS)) + r")\.[a-z_]+)`,? \(?(?:default |by default )?"
    r"([0-9][0-9_,]*(?:\.[0-9]+)?)(?= s\b| by default|,|\)| tokens| =|:)"
)


def _held(path: str) -> set[float]:
    """The numbers a setting holds by default: its default, or its backends' auto values."""
    section, key = path.split(".")
    default = msgspec.to_builtins(Settings())[section][key]
    if default == "auto":
        return {float(getattr(p, key)) for p in BACKENDS.values() if hasattr(p, key)}
    return {float(default)} if isinstance(default, (int, float)) else set()


def test_a_default_a_page_states_is_the_code_s():
    wrong, seen = [], 0
    for page in PAGES:
        text = page.read_text("utf-8")
        for match in STATED.finditer(text):
            path, stated = match.group(1), _number(match.group(2))
            if path not in SETTINGS:
                continue
            after = text[match.end() : match.end() + 30]
            if re.match(r"[ ,)]*(?:=|turns|is off|for )", after) or (
                stated == 0 and after.startswith(":")
            ):
                continue  # a value's meaning ("(0: no limit)"), not a default
            seen += 1
            if stated not in _held(path):
                wrong.append(f"{page.name}: {match.group(0)!r}, the code holds {_held(path)}")
    assert not wrong, wrong
    assert seen >= 10


ASSIGNED = re.compile(r"`((?:" + "|".join(sorted(SECTIONS)) + r")\.[a-z_]+) = ([^`]+)`")


def test_a_value_a_page_sets_is_one_the_settings_accept():
    import tomllib

    wrong = []
    for page in PAGES:
        for path, value in ASSIGNED.findall(page.read_text("utf-8")):
            parsed = tomllib.loads(f"v = {value}")["v"]
            if not _accepts(path, parsed):
                wrong.append(f"{page.name}: {path} = {value}")
    assert not wrong, wrong


def test_the_backend_defaults_table_is_the_backend_policy_s():
    page = (DOCS / "operations.md").read_text("utf-8")
    section = page[page.index("## Backend defaults") : page.index("## Robustness")]
    for key in ("prefill_chunk_tokens", "prefill_unsplit_tokens", "batch_prefill_max_context"):
        (row,) = re.findall(rf"^\| `{key}` \| ([^|]+) \| ([^|]+) \|", section, flags=re.M)
        cpu, gpu = (re.match(r"\(?(\w+)", cell.strip()).group(1) for cell in row)
        assert int(cpu) == getattr(BACKENDS["cpu"], key), key
        if gpu.isdigit():
            assert int(gpu) == getattr(BACKENDS["cuda"], key) == getattr(BACKENDS["metal"], key)


def test_the_fim_formats_on_the_completion_page_are_the_registry_s():
    page = (DOCS / "completion.md").read_text("utf-8")
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| .*$", page, flags=re.M)
    names = [r for r in rows if r in fim.BY_NAME or r.isidentifier() and "_" not in r]
    table = [line for line in page.splitlines() if re.match(r"^\| `[a-z0-9]+` \| [A-Z]", line)]
    listed = [re.match(r"^\| `([a-z0-9]+)`", line).group(1) for line in table]
    assert sorted(listed) == sorted(fim.BY_NAME), (listed, names)
    for line, name in zip(table, listed, strict=True):
        for token in fim.BY_NAME[name].ends:
            assert token in line, f"{name}: {token} ends the middle, the page does not say so"


@pytest.mark.parametrize("name", ["operations.md", "families.md"])
def test_a_rendered_part_is_marked_as_rendered(name):
    text = (DOCS / name).read_text("utf-8")
    assert "Rendered by scripts/render_settings.py" in text and render_settings.END in text


def test_the_gguf_architectures_troubleshooting_lists_are_the_loader_s():
    from mlxd.actors.engine.loading.gguf.arch import ARCHITECTURES

    page = (DOCS / "troubleshooting.md").read_text("utf-8")
    (listed,) = re.findall(r"\(supported: ([a-z0-9,\s]+)\)", page)
    assert re.split(r",\s+", listed) == list(ARCHITECTURES)


def test_the_compatibility_table_requires_what_pyproject_requires():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    bounds = {}
    for dep in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        spec = dep.split(";")[0][len(name) :]
        bounds.setdefault(name, re.sub(r"^\[[^\]]*\]", "", spec))
    bounds["Python"] = project["requires-python"]
    page = (DOCS / "changelog.md").read_text("utf-8")
    for name in ("Python", "mlx", "mlx-lm", "mlx-vlm", "transformers", "hypercorn"):
        (row,) = re.findall(rf"^\| {re.escape(name)} \| ([^|]+) \|", page, flags=re.M)
        stated = row.split(" (")[0].replace("≥ ", ">=").replace("≤ ", "<=").replace(" ", "")
        assert stated == bounds[name].replace(" ", ""), (
            f"{name}: page {row!r}, pyproject {bounds[name]!r}"
        )
