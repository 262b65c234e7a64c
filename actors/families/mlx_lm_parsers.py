"""mlx-lm's tool-call parsers, used as they ship, behind a contract check.

mlx-lm (``mlx_lm.tool_parsers``) has one module per tool-call markup: each
exports ``tool_call_start``, ``tool_call_end`` and ``parse_tool_call(text,
tools)``, which turns the text between the two markers into ``{"name",
"arguments"}`` (or a list of them). mlx-lm itself parses a finished call; mlxd
adds the streaming around the markup, call ids and the APIs (``delimited.py``).

The contract (those three names, in a tested mlx-lm version range) is checked
once per module at load; a module that breaks it is not used, with one log
line, and its format falls back to mlxd's generic JSON parsing.
Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mlxd")

# mlx-lm versions whose parser modules this wrapper was tested against (lower inclusive,
# upper exclusive). Outside it the modules are still used when their attributes check out.
TESTED = ((0, 32), (0, 34))
CONTRACT = ("tool_call_start", "tool_call_end", "parse_tool_call")


class LibraryParser:
    """One mlx-lm parser module: its markers and its parse function."""

    def __init__(self, name: str, module: Any):
        self.name = name
        self.start: str = module.tool_call_start
        self.end: str = module.tool_call_end
        self._parse: Callable[[str, Any], Any] = module.parse_tool_call

    def parse(self, body: str, tools: list[dict] | None) -> list[dict]:
        """The calls in ``body`` (the text between the markers) as dicts; raises on none."""
        found = self._parse(body, tools)
        calls = found if isinstance(found, list) else [found]
        if not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            raise ValueError(f"{self.name}: no tool call in the text")
        return calls


def _version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


@functools.cache
def library_parser(name: str) -> LibraryParser | None:
    """mlx-lm's parser module ``name``, or None (logged once) when it breaks the contract."""
    try:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except ImportError as exc:
        log.warning("mlx-lm has no tool parser %r (%s); using mlxd's generic parsing", name, exc)
        return None
    missing = [a for a in CONTRACT if not hasattr(module, a)]
    if missing or not callable(getattr(module, "parse_tool_call", None)):
        log.warning("mlx-lm's tool parser %r lacks %s; using mlxd's generic parsing", name, missing)
        return None
    version = _version()
    if version and not TESTED[0] <= version < TESTED[1]:
        log.info("mlx-lm %s is outside the tested range for its tool parsers", version)
    return LibraryParser(name, module)
