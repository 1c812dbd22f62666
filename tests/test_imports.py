"""Imports go one way: the layer table of docs/architecture.md, checked against the code.

Every tessera import (module level, inside functions, under TYPE_CHECKING alike) must go to the
importer's own layer or to a layer listed before it; no two modules import each other through any
chain (no cycles); an import inside a function is allowed only for a module that needs an
optional dependency, and says so with `# optional: <dependency>` on its line."""

from __future__ import annotations

import ast
import graphlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tessera"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass
class Layer:
    name: str
    paths: list[str]
    index: int


def layer_table() -> list[Layer]:
    """The rows of the table under 'Layers and what each may import', in order."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers and what each may import", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    layers: list[Layer] = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if set(cells[0]) <= {"-", " "}:
            continue
        name, package, may = cells[0], cells[1], cells[2]
        paths = [p for p in re.findall(r"`([^`]+)`", package) if p.startswith("tessera")]
        if not paths:
            continue  # bench: not part of the package
        names = [x.name for x in layers]
        for term in (t.strip().removesuffix(" and below") for t in may.split(",")):
            assert term in names or term in ("nothing", "anything"), f"'{term}' in the row of {name}: not an earlier layer"
        layers.append(Layer(name, paths, len(layers)))
    return layers


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, name: str) -> list[tuple[str, int, bool]]:
    """(imported tessera module or name, line, inside a function) for every import in `path`."""
    tree = ast.parse(path.read_text())
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                   for n in ast.walk(f)}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(t, node.lineno, id(node) in in_function) for t in targets if t.split(".")[0] == "tessera"]
    return found


def resolve(target: str, mods: dict[str, Path]) -> str:
    """The module an imported dotted name lives in (`tessera.ir.expr.Var` -> `tessera.ir.expr`)."""
    while target not in mods:
        target = target.rpartition(".")[0]
    return target


def layer_of(path: Path, layers: list[Layer]) -> Layer | None:
    """The row whose package holds the file (the longest matching path wins)."""
    rel = path.relative_to(ROOT).as_posix()
    best = None
    for layer in layers:
        for p in layer.paths:
            if (rel == p or (p.endswith("/") and rel.startswith(p))) and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return best[1] if best else None


def edges() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _, _ in imports(path, m):
            t = resolve(target, mods)
            if t != m and not m.startswith(t + "."):  # importing one's own package is no edge
                graph[m].add(t)
    return graph


def test_the_table_covers_every_module():
    layers = layer_table()
    assert [x.name for x in layers][:2] == ["errors", "settings"]
    uncovered = [m for m, path in modules().items() if layer_of(path, layers) is None]
    assert not uncovered, f"modules in no row of docs/architecture.md's layer table: {uncovered}"


@pytest.mark.slow
def test_imports_follow_the_layer_table():
    layers = layer_table()
    mods = modules()
    wrong = []
    for m, path in mods.items():
        own = layer_of(path, layers)
        if own is None:
            continue
        for target, line, _ in imports(path, m):
            other = layer_of(mods[resolve(target, mods)], layers)
            if other is not None and other.index > own.index:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({own.name}) imports {target} (layer {other.name})")
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)


@pytest.mark.slow
def test_no_import_cycles():
    sorter = graphlib.TopologicalSorter(edges())
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


@pytest.mark.slow
def test_imports_inside_functions_only_for_optional_dependencies():
    mods = modules()
    unexplained = []
    for m, path in mods.items():
        lines = path.read_text().splitlines()
        for target, line, inside in imports(path, m):
            if inside and "# optional:" not in lines[line - 1]:
                unexplained.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not unexplained, "\n".join(unexplained)
    inside = sum(1 for m, p in mods.items() for *_, f in imports(p, m) if f)
    assert inside <= 40
