"""The layout the code promises (docs/ARCHITECTURE.md): imports point down the floors, never up, no two files
import each other round a circle, no source file outgrows one concept (450 lines), few imports of mixprec
hide inside functions, and the floors diagram in ARCHITECTURE.md is the one the code draws. Read from the
source with ``ast`` by tools/architecture.py, which holds the one floor table: every ``import`` counts,
deferred ones inside functions included, since a deferred import is still an arrow."""

from __future__ import annotations

import ast
import re

import pytest
from tools.architecture import COMMAND, DOC, FLOORS, GRAPH, LEAF, MODULES, SRC, diagram, room

MAX_LINES = 450
# Imports of mixprec's own modules inside functions: each hides an arrow from a reader of the file's top and
# defers an error to the first call. Allowed only with a reason beside it (an optional part, the start-up of
# `mixprec --help` / `import mixprec`), and few: a circle is fixed by moving code to the right room instead.
MAX_DEFERRED = 10


def test_imports_point_down_the_floors() -> None:
    rooms = {room(m) for m in MODULES}
    assert rooms <= set(FLOORS), f"rooms without a floor in tools/architecture.py's ROOMS: {rooms - set(FLOORS)}"
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if room(m) != room(t) and FLOORS[room(t)] >= FLOORS[room(m)]
    )
    assert not upward, "imports that do not point down a floor:\n" + "\n".join(upward)


def test_leaves_import_nothing_from_mixprec() -> None:
    reaching = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if FLOORS[room(m)] == LEAF for t in targets)
    assert not reaching, "leaf modules (floor -1) that import mixprec:\n" + "\n".join(reaching)


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


def _deferred_imports() -> list[tuple[str, int, bool]]:
    """(file, line, has a comment beside it) for each import of mixprec's own modules inside a function. The
    reason may sit on the import's own lines or on the comment lines just above it."""
    found = set()
    for path in MODULES.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for node in (n for f in functions for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)):
            if not (getattr(node, "level", 0) > 0 or any(n.split(".")[0] == "mixprec" for n in _names(node))):
                continue
            above = node.lineno - 2
            while above >= 0 and lines[above].strip().startswith("#"):
                above -= 1
            beside = any("#" in line for line in lines[node.lineno - 1 : node.end_lineno])
            found.add((str(path.relative_to(SRC.parent)), node.lineno, beside or above < node.lineno - 2))
    return sorted(found)


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_few_imports_of_mixprec_hide_inside_functions_each_with_its_reason() -> None:
    deferred = _deferred_imports()
    where = "\n".join(f"  {file}:{line}" for file, line, _ in deferred)
    assert len(deferred) <= MAX_DEFERRED, (
        f"{len(deferred)} imports of mixprec's own modules inside functions (at most {MAX_DEFERRED}): move them "
        f"to the top of the file, or the code that needs them to the room it belongs in:\n{where}"
    )
    bare = [f"  {file}:{line}" for file, line, commented in deferred if not commented]
    assert not bare, "imports inside functions without a comment saying why they are deferred:\n" + "\n".join(bare)


def test_the_architecture_diagram_is_the_one_the_code_draws() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert diagram() in text, f"docs/ARCHITECTURE.md's floors diagram is stale or edited by hand: run `{COMMAND}`"


def test_the_architecture_prose_names_each_rooms_floor_as_the_table_does() -> None:
    # "watch/ on floor 4", "checkpoint/ stays on floor 0", "data/ (floor 0)": prose outside the generated block
    said = re.findall(r"\b(\w+)/ (?:\(|on |stays on )floor (-?\d+)", DOC.read_text(encoding="utf-8"))
    wrong = sorted({f"{r}/ on floor {n} (the table: {FLOORS.get(r)})" for r, n in said if FLOORS.get(r) != int(n)})
    assert said and not wrong, f"docs/ARCHITECTURE.md places rooms on other floors than the table: {wrong}"
