"""The layout the code promises (docs/ARCHITECTURE.md): imports point down the floors, never up, no two files
import each other round a circle, and no source file outgrows one concept (450 lines). Read from the source
with ``ast``: every ``import`` counts, deferred ones inside functions included, since a deferred import is
still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"
MAX_LINES = 450

# Bottom (-1) to top: a room may import only rooms on a lower floor (and itself).
FLOORS: dict[str, int] = {
    **dict.fromkeys(("tree", "_version"), -1),  # leaves: import nothing from mixprec
    **dict.fromkeys(("models", "data", "optim", "checkpoint", "tracking"), 0),
    "scaling": 1,
    "precision": 2,
    **dict.fromkeys(("strategies", "diagnostics"), 3),
    **dict.fromkeys(("loaders", "watch", "bench"), 4),
    "accelerator": 5,
    "trainer": 6,
    "__init__": 7,  # the package's face
    "cli": 8,
    "__main__": 9,
}


def _module_name(path: Path) -> str:
    parts = ("mixprec", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _target(name: str) -> str | None:
    """The mixprec module an import of ``name`` loads (its longest existing prefix), None outside mixprec."""
    parts = name.split(".")
    if parts[0] != "mixprec":
        return None
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) if parts else None


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            # `from mixprec import tree` is an arrow to the module tree, not to the package's face
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for n in names if (t := _target(n)) is not None and t != module)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_imports_point_down_the_floors() -> None:
    rooms = {_room(m) for m in MODULES}
    assert rooms <= set(FLOORS), f"rooms without a floor in this test and ARCHITECTURE.md: {rooms - set(FLOORS)}"
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if _room(m) != _room(t) and FLOORS[_room(t)] >= FLOORS[_room(m)]
    )
    assert not upward, "imports that do not point down a floor:\n" + "\n".join(upward)


def test_no_import_circles() -> None:
    # Tarjan's strongly connected components over the module graph: any component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in GRAPH[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert not circles, f"modules that import each other round a circle: {circles}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_source_file_holds_more_than_one_concept(module: str) -> None:
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(SRC.parent)} is {lines} lines: split it by concept"
