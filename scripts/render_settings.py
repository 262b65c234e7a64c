"""Render the settings reference ("Every setting" on ``docs/operations.md``) from
``config/default.toml``, whose comments are the one source, and the values each setting
takes from the code: the types of ``daemon/settings.py`` (ranges, choices) and the
registries behind the open-ended ones (tool formats, backends).

    python -m mlxd.scripts.render_settings            # after editing config/default.toml
    python -m mlxd.scripts.render_settings --check    # exit 1 if the page is out of date

It also renders the registries' own lists on ``docs/families.md`` (every tool-call format
and reasoning markup mlxd knows). ``tests/test_docs_settings.py`` checks both pages are up to date
and that every value the page lists is one the settings accept. No trio, no mlx.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

ROOT = Path(__file__).resolve().parent.parent
TOML = ROOT / "config" / "default.toml"
DOCS = ROOT / "docs"

BEGIN = (
    "<!-- Rendered by scripts/render_settings.py from {source}: edit {edit}, "
    "never this part of the page (tests/test_docs_settings.py checks it is up to date). -->"
)
END = "<!-- End of the rendered part. -->"
MARK = BEGIN[: BEGIN.index("{")]  # how a page's rendered part starts, whatever its source

# Links the page adds after a setting's comment (a TOML comment holds no Markdown links).
SEE = {
    "server.idle_timeout_s": "[Connections](#connections-and-signals)",
    "admission.queue_timeout_s": "[The queue timeout](#the-queue-timeout)",
    "tokenizer.tool_format": "[Model families](families.md#every-tool-call-format)",
    "tokenizer.reasoning_tags": "[Model families](families.md#every-reasoning-markup)",
    "tokenizer.constrain_auto_calls": "[Tool calls in auto mode](api/index.md#tool-calls-in-auto-mode)",
    "engine.prefill_chunk_tokens": "[Backend defaults](#backend-defaults)",
    "engine.kv_bits": "[Quantized KV](caching.md#quantized-kv)",
    "prefix_cache.disk_dir": "[Disk tier](caching.md#disk-tier)",
    "speculative.enabled": "[Speculative decoding](speculative.md)",
    "fim.max_extra_files": "[Code completion](completion.md)",
    "cluster.host": "[Scaling out](scaling.md#several-daemons-behind-a-router)",
}


# ---- the file ---------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    default: str  # the value as the file writes it
    comment: list[str] = field(default_factory=list)


@dataclass
class Section:
    name: str
    intro: list[list[str]] = field(default_factory=list)  # comment blocks before the first key
    notes: list[list[str]] = field(default_factory=list)  # comment blocks after it
    rows: list[Row] = field(default_factory=list)


def _split_value(line: str) -> tuple[str, str]:
    """``key = value  # comment`` → (``key = value``, ``comment``): the first ``#`` before
    which the line is valid TOML starts the comment (a ``#`` inside a string does not)."""
    for match in re.finditer("#", line):
        head = line[: match.start()]
        try:
            tomllib.loads(head)
        except tomllib.TOMLDecodeError:
            continue
        return head.rstrip(), line[match.end() :].strip()
    return line.rstrip(), ""


def parse(text: str) -> list[Section]:
    """The file's tables, each with its comment blocks and its keys' defaults and comments.

    A comment at the start of a line is a block of prose for the table (before its first
    key: the table's introduction); an indented comment continues the key above it."""
    sections: list[Section] = []
    block: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            block = None
        elif header := re.fullmatch(r"\[([a-z_]+)\]", stripped):
            sections.append(Section(header.group(1)))
            block = None
        elif not sections:
            continue  # the file's own header
        elif line.startswith("#"):
            section = sections[-1]
            if block is None:
                block = []
                (section.notes if section.rows else section.intro).append(block)
            block.append(line[1:].removeprefix(" ").rstrip())
        elif stripped.startswith("#"):
            sections[-1].rows[-1].comment.append(stripped[1:].strip())
        else:
            assignment, comment = _split_value(line)
            key, _, value = assignment.partition("=")
            sections[-1].rows.append(Row(key.strip(), value.strip(), [comment] if comment else []))
            block = None
    return sections


# ---- the values a setting takes, from the code -------------------------------------------


@dataclass(frozen=True)
class Values:
    """What a setting accepts: a list of choices, or a number in a range, or free text."""

    kind: str  # "choices", "int", "float", "str", "list", "table"
    choices: tuple[Any, ...] = ()
    low: float | None = None
    low_open: bool = False  # low itself refused (> rather than >=)
    high: float | None = None
    also: tuple[Any, ...] = ()  # choices a number setting also takes ("auto")
    note: str = ""  # what "auto" means on each backend, or how text is read


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _field_types() -> dict[str, Any]:
    from mlxd.daemon import settings

    out = {}
    for section in msgspec.structs.fields(settings.Settings):
        kind = section.type
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            for f in msgspec.structs.fields(kind):
                out[f"{section.name}.{f.name}"] = f.type
    return out


def _number(kind: Any) -> tuple[str, float | None, bool, float | None]:
    meta: list[msgspec.Meta] = []
    if typing.get_origin(kind) is Annotated:
        kind, *meta = typing.get_args(kind)
    low = high = None
    low_open = False
    for m in meta:
        if m.ge is not None:
            low = m.ge
        if m.gt is not None:
            low, low_open = m.gt, True
        if m.le is not None:
            high = m.le
    return ("int" if kind is int else "float"), low, low_open, high


def _auto_by_backend(name: str) -> str:
    from mlxd.actors.engine.backend_policy import BACKENDS

    def shown(value: Any) -> str:
        return _toml(value)

    by = {backend: getattr(policy, name, None) for backend, policy in BACKENDS.items()}
    if any(v is None for v in by.values()):
        return ""
    return "auto: " + ", ".join(f"{b} {shown(v)}" for b, v in by.items())


def values(path: str, kind: Any) -> Values:
    """The values ``path`` (``table.key``) takes, read from its type and the registries."""
    from mlxd.actors.families.formats import TOOL_FORMATS
    from mlxd.daemon import settings

    special = {
        "tokenizer.tool_format": Values("choices", ("auto", *TOOL_FORMATS)),
        "tokenizer.reasoning_tags": Values(
            "choices", ("auto", "none"), note='or `"<open>,<close>"`: two tags and a comma'
        ),
        "logging.level": Values("choices", settings.LOG_LEVELS, note="any case"),
        "engine.kv_bits": Values("choices", settings.KV_BITS),
        "engine.kv_group_size": Values("choices", settings.KV_GROUP_SIZES),
    }
    if path in special:
        return special[path]
    choices: list[Any] = []
    number = None
    for part in typing.get_args(kind) if typing.get_origin(kind) is typing.Union else (kind,):
        if part is bool:
            choices += [True, False]
        elif typing.get_origin(part) is Literal:
            choices += typing.get_args(part)
        elif typing.get_origin(part) is list:
            return Values("list")
        elif typing.get_origin(part) is dict:
            return Values("table")
        elif part is str:
            return Values("str")
        else:
            number = part
    if number is None:
        return Values("choices", tuple(choices))
    num_kind, low, low_open, high = _number(number)
    note = _auto_by_backend(path.partition(".")[2]) if "auto" in choices else ""
    return Values(num_kind, low=low, low_open=low_open, high=high, also=tuple(choices), note=note)


def _bound(value: float | None) -> str:
    return f"{value:,}".replace(",", "_") if isinstance(value, int) else str(value)


def describe(v: Values) -> str:
    """The page's "values" cell."""
    if v.kind == "choices":
        text = ", ".join(f"`{_toml(c)}`" for c in v.choices)
    elif v.kind == "list":
        text = "a list of strings"
    elif v.kind == "table":
        text = "a table of strings"
    elif v.kind == "str":
        text = "a string"
    else:
        kind = "an integer" if v.kind == "int" else "a number"
        low = f"{'>' if v.low_open else '≥'} {_bound(v.low)}" if v.low is not None else ""
        if v.low is not None and v.high is not None and not v.low_open:
            text = f"{kind} from {_bound(v.low)} to {_bound(v.high)}"
        else:
            high = f"≤ {_bound(v.high)}" if v.high is not None else ""
            text = " ".join(p for p in (kind, ", ".join(p for p in (low, high) if p)) if p)
        if v.also:
            text += ", or " + ", ".join(f"`{_toml(c)}`" for c in v.also)
    return f"{text} ({v.note})" if v.note else text


# ---- the page -----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _prose(block: list[str]) -> str:
    """A comment block as Markdown: its prose joined, commented-out TOML as a code block."""
    out: list[str] = []
    prose: list[str] = []
    code: list[str] = []

    def flush() -> None:
        if prose:
            out.append(" ".join(prose))
        if code:
            out.append("```toml\n" + "\n".join(code) + "\n```")
        prose.clear()
        code.clear()

    for line in block:
        is_code = line.startswith("  ")
        if (is_code and prose) or (not is_code and code):
            flush()
        (code if is_code else prose).append(line[2:] if is_code else line)
    flush()
    return "\n\n".join(out)


def render_settings(text: str) -> str:
    """The rendered part of "Every setting": a table per TOML table."""
    types = _field_types()
    parts = [BEGIN.format(source="config/default.toml", edit="the file's comments")]
    for section in parse(text):
        parts.append(f"### `[{section.name}]`")
        parts += [_prose(b) for b in section.intro]
        lines = ["| setting | default | values | what it does |", "|---|---|---|---|"]
        for row in section.rows:
            path = f"{section.name}.{row.key}"
            what = " ".join(row.comment)
            if path in SEE:
                what = f"{what} ({SEE[path]})" if what else SEE[path]
            cells = [f"`{path}`", f"`{row.default}`", describe(values(path, types[path])), what]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(lines))
        parts += [_prose(b) for b in section.notes]
    parts.append(END)
    return "\n\n".join(parts) + "\n"


def render_registries() -> str:
    """The rendered part of families.md: every tool-call format and reasoning markup."""
    from mlxd.actors.families import formats, reasoning

    parts = [BEGIN.format(source="the registries", edit="actors/families/")]
    parts.append("### Every tool-call format")
    parts.append(
        "The names `tokenizer.tool_format` (and a `[[models]]` entry's `tool_format`) "
        "accept, from `actors/families/formats.py`, in the order detection tries them; "
        "`auto` picks one from the chat template, else the vocabulary, and says why "
        "(`mlxd parse`, `/v1/status`)."
    )
    rows = ["| name | picked when |", "|---|---|"]
    rows += [f"| `{n}` | {_cell(f.why)} |" for n, f in formats.BY_NAME.items()]
    parts.append("\n".join(rows))
    parts.append("### Every reasoning markup")
    parts.append(
        'The reasoning blocks `tokenizer.reasoning_tags = "auto"` finds in a chat '
        "template (else the vocabulary), from `actors/families/reasoning.py`, in the order "
        'tried; `"none"` turns reasoning parsing off, `"<open>,<close>"` names a pair.'
    )
    rows = ["| opens | closes | what it is |", "|---|---|---|"]
    rows += [
        f"| `{_cell(t.open)}` | `{_cell(t.close)}` | {_cell(t.why)} |" for t in reasoning._TAGS
    ]
    parts.append("\n".join(rows))
    parts.append(END)
    return "\n\n".join(parts) + "\n"


# ---- splicing into the pages ----------------------------------------------------------------


def splice(page: str, rendered: str) -> str:
    """``page`` with its rendered part (from the BEGIN comment to END) replaced."""
    start, end = page.find(MARK), page.find(END)
    if start < 0 or end < 0:
        raise ValueError(f"the page has no rendered part ({MARK!r} ... {END!r})")
    return page[:start] + rendered + page[end + len(END) + 1 :]


def pages(docs: Path = DOCS, toml: Path = TOML) -> dict[Path, str]:
    """Each rendered page as it should read."""
    settings = render_settings(toml.read_text(encoding="utf-8"))
    return {
        docs / "operations.md": splice((docs / "operations.md").read_text("utf-8"), settings),
        docs / "families.md": splice(
            (docs / "families.md").read_text("utf-8"), render_registries()
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = [p for p, text in pages().items() if p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: python -m mlxd.scripts.render_settings")
        return 1 if stale else 0
    for p, text in pages().items():
        p.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
