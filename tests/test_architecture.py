"""The layout's rules, checked on the source: every import in the tree, parsed with ``ast``.

Imports inside functions and under ``if TYPE_CHECKING:`` count like any other: a
circle held apart by a deferred import is still a circle. Nothing here imports the
modules it reads, so the check is fast and needs neither trio nor MLX.
"""

from __future__ import annotations

import ast
from collections.abc import Container, Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "actors", "protocol", "scripts", "tests")

# The engine's composition root: the one module that loads a model and picks the runner
# variant that serves it.
COMPOSITION_ROOT = "actors.engine.loading.load"
# The runner variants (they build on the base runner, ``actors.engine.runner.base``) and the
# MTP and prompt-lookup drafters. Vision + MTP is a vision runner whose text-only rows decode the
# speculative runner's way, so a variant may build on another; nothing else in the
# served tree may import one.
VARIANTS = frozenset(
    {
        "actors.engine.speculative.runner",
        "actors.engine.runner.vlm",
        "actors.engine.speculative.vlm_mtp",
        "actors.engine.speculative.mtp",
        "actors.engine.speculative.lookup",
    }
)
# Tests and benchmarks build a variant directly, to check or time it against the plain runner.
SERVED = ("daemon", "actors", "protocol")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: Container[str]
) -> Iterator[str]:
    """The dotted names an import statement loads: ``from a.b import c`` loads the module
    ``a.b.c`` if there is one (in ``known``), else ``a.b``."""
    if isinstance(node, ast.Import):
        yield from (alias.name.removeprefix("mlxd.") for alias in node.names)
        return
    base = (node.module or "").removeprefix("mlxd.")  # installed under the mlxd namespace
    if node.level:  # relative: from the importing module's package, up ``level - 1``
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        name = f"{base}.{alias.name}"
        yield name if name in known else base


def imports_of(source: str, module: str, known: Container[str], is_package=False) -> set[str]:
    """The ``known`` modules that ``module``'s source imports, at any depth of its tree."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(n for n in _imported(node, module, is_package, known) if n in known)
    found.discard(module)
    return found


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module → the project modules it imports, anywhere in its source."""
    sources = _sources()
    return {
        module: frozenset(imports_of(path.read_text(), module, sources, path.name == "__init__.py"))
        for module, path in sources.items()
    }


def _third_party(module: str) -> set[str]:
    """Top-level names of everything ``module`` imports, anywhere in its source."""
    path = _sources()[module]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """One loop per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_loop(edges, set(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _loop(edges: dict[str, frozenset[str]], component: set[str]) -> list[str]:
    """A concrete loop through a strongly connected component, for the failure message."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        step = min(w for w in edges[path[-1]] if w in component)
        if step in seen:
            return [*path[path.index(step) :], step]
        path.append(step)
        seen.add(step)


def _importers(target: str) -> set[str]:
    return {m for m, imports in graph().items() if target in imports}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return module.split(".")[0] in packages


_SAMPLE = """
import a.x
from a import y, not_a_module
from . import z
from .w import thing

if TYPE_CHECKING:
    from b import checked


def f():
    from c import deferred
"""


def test_the_graph_sees_every_kind_of_import():
    known = {"a", "a.x", "a.y", "a.z", "a.w", "b", "c", "d"}
    found = imports_of(_SAMPLE, "a.m", known)
    assert found == {"a", "a.x", "a.y", "a.z", "a.w", "b", "c"}  # "a": for not_a_module
    assert imports_of("from .. import y", "a.p", {"a.y"}, is_package=True) == {"a.y"}
    assert imports_of("from .. import y", "a.p.q", {"a.y"}) == {"a.y"}
    loop = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"})}
    assert cycles(loop) == [["a", "b", "c", "a"]]
    assert "actors.engine.loading.load" in graph()["daemon.supervisor"]  # imported in a function


def test_no_module_imports_one_that_imports_it_back():
    loops = cycles(graph())
    assert not loops, "import circles: " + "; ".join(" -> ".join(loop) for loop in loops)


# Package → the packages of the tree it must never import: the daemon wires actors over
# the protocol; scripts (set-up, benchmarks) use all three; tests use everything.
FORBIDDEN = {
    "protocol": ("actors", "daemon", "scripts", "tests"),
    "actors": ("daemon", "scripts", "tests"),
    "daemon": ("scripts", "tests"),
    "scripts": ("tests",),
}


def test_imports_point_down_the_layers_only():
    wrong = sorted(
        f"{m} -> {t}"
        for m, imports in graph().items()
        for t in imports
        if _in(t, FORBIDDEN.get(m.split(".")[0], ()))
    )
    assert not wrong, wrong


def test_protocol_imports_neither_trio_nor_mlx():
    wrong = {
        m: sorted(_third_party(m) & {"trio", "mlx", "mlx_lm", "mlx_vlm"})
        for m in _sources()
        if _in(m, ("protocol",))
    }
    assert not any(wrong.values()), wrong


def test_only_the_composition_root_imports_runner_variants():
    assert COMPOSITION_ROOT in graph()
    for variant in VARIANTS:
        importers = {m for m in _importers(variant) if _in(m, SERVED)}
        assert importers <= {COMPOSITION_ROOT} | VARIANTS, (variant, importers)
        assert COMPOSITION_ROOT not in graph()[variant], f"{variant} imports the root"


def test_the_base_runner_imports_no_variant_and_not_the_root():
    imports = graph()["actors.engine.runner.base"]
    assert not imports & (VARIANTS | {COMPOSITION_ROOT}), sorted(imports)


def test_the_scheduler_core_imports_no_mlx():
    """``actors/engine/scheduler/`` is plain Python: it imports nothing of the engine's MLX
    rooms, and nothing it imports (in this tree, transitively) imports mlx."""
    scheduler = {m for m in _sources() if m.startswith("actors.engine.scheduler")}
    assert scheduler, "no scheduler package"
    seen, todo = set(), list(scheduler)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [t for t in graph().get(m, ()) if t in graph()]
    outside = sorted(
        m for m in seen if not m.startswith("actors.engine.scheduler") and not _in(m, ("protocol",))
    )
    assert not outside, outside
    assert not any(_third_party(m) & {"mlx", "mlx_lm", "mlx_vlm"} for m in seen), sorted(seen)
