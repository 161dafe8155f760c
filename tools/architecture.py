"""The floors of mixprec and the imports between its rooms, read from the source: the one floor table that
``tests/test_layers.py`` holds the code to, and the diagram in docs/ARCHITECTURE.md drawn from it.

``python -m tools.architecture`` rewrites the diagram between the markers in docs/ARCHITECTURE.md;
``python -m tools.architecture --check`` only says whether the committed one is current (exit 1 if not).
Every ``import`` counts as an arrow, deferred ones inside functions and ``TYPE_CHECKING`` ones included: a
deferred import is still an arrow (the diagram says which arrows are only deferred or only for types). No
dependency beyond the standard library (``ast``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mixprec"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
COMMAND = "python -m tools.architecture"
BEGIN_MARK = "<!-- floors: begin"
BEGIN = f"{BEGIN_MARK} (generated from the code by `{COMMAND}`; do not edit by hand) -->"
END = "<!-- floors: end -->"

# room -> (floor, what it holds). Bottom (-1) to top: a room may import only rooms on a lower floor (and itself).
ROOMS: dict[str, tuple[int, str]] = {
    "__main__": (9, "python -m mixprec"),
    "cli": (8, "mixprec train | bench | diagnose | export | replay | torchrun"),
    "__init__": (7, "the public face: re-exports (lazily)"),
    "trainer": (6, "Trainer, TrainingArguments (HF's names)"),
    "accelerator": (5, "Accelerator: the facade over a precision and a distributed strategy"),
    "loaders": (4, "every DataLoader: prepared ones, the Trainer's"),
    "watch": (4, "the precision watch (attaches to a WatchHost; never imports accelerator/)"),
    "bench": (4, "side-by-side precision runs"),
    "strategies": (3, "one process / DDP / FSDP2 (+ launch, peers, restarts, comm dtypes)"),
    "diagnostics": (3, "diagnose(model, batches) -> Report"),
    "precision": (2, "precision strategies, the one name registry, auto's race"),
    "scaling": (1, "GradScaler, its record, the non-finite guard"),
    "models": (0, "the built-in GPT, the model-output contract"),
    "data": (0, "the embedded corpus, text loaders, datasets"),
    "optim": (0, "the one Adam(W) step: Bf16AdamW, AnyPrecisionAdamW"),
    "checkpoint": (0, "the CheckpointManager, numbered folders, safe files"),
    "tracking": (0, "accelerate's log_with trackers"),
    "tree": (-1, "the one walk over nested data (a leaf: imports nothing from mixprec)"),
    "shards": (-1, "a DTensor's local shard (FSDP2): the one place that knows (a leaf)"),
    "_version": (-1, "__version__ (a leaf)"),
}
FLOORS: dict[str, int] = {room: floor for room, (floor, _) in ROOMS.items()}
ARROWS_NOTE = (
    "What each room imports, read from the code (each arrow points down a floor; `(deferred)`: only inside\n"
    "functions, `(types)`: only for type checkers; leaves, which any floor may use, left out):"
)
LEAF = -1  # rooms on this floor import nothing from mixprec, and any floor may use them


def module_name(path: Path) -> str:
    parts = ("mixprec", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def room(module: str) -> str:
    """The room (top-level package or module of mixprec) a module lives in: ``mixprec.cli.train`` -> "cli"."""
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


def imported_name(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The dotted names an import statement in ``module`` loads, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
    # `from mixprec import tree` is an arrow to the module tree, not to the package's face
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


RUNTIME, DEFERRED, TYPES = "runtime", "deferred", "types"  # at import; inside a function; under TYPE_CHECKING


def import_kinds(module: str) -> dict[str, str]:
    """The mixprec modules ``module`` imports (itself left out), each with how: at import (RUNTIME), inside a
    function (DEFERRED) or only for type checkers (TYPES); the first of these that applies."""
    found: dict[str, str] = {}

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and kind == RUNTIME:
                inner = DEFERRED
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = TYPES
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name in imported_name(child, module):
                    target = _target(name)
                    if target is not None and target != module:
                        found[target] = min(found.get(target, TYPES), inner, key=(RUNTIME, DEFERRED, TYPES).index)
            visit(child, inner)

    visit(ast.parse(MODULES[module].read_text(encoding="utf-8")), RUNTIME)
    return found


KINDS: dict[str, dict[str, str]] = {module: import_kinds(module) for module in MODULES}
GRAPH: dict[str, set[str]] = {module: set(kinds) for module, kinds in KINDS.items()}


def room_arrows() -> dict[str, dict[str, str]]:
    """Each room -> the other rooms its modules import, each with the strongest kind of its imports."""
    arrows: dict[str, dict[str, str]] = {r: {} for r in ROOMS}
    order = (RUNTIME, DEFERRED, TYPES).index
    for module, kinds in KINDS.items():
        mine = arrows.setdefault(room(module), {})
        for target, kind in kinds.items():
            if room(target) != room(module):
                mine[room(target)] = min(mine.get(room(target), TYPES), kind, key=order)
    return arrows


def _label(r: str) -> str:
    if r == "__init__":
        return "mixprec/__init__.py"
    return f"{r}.py" if (SRC / f"{r}.py").exists() else f"{r}/"


def _wrapped(head: str, words: list[str], width: int = 118) -> list[str]:
    lines, line = [], head
    for word in words:
        if len(line) + 1 + len(word) > width and line.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += word + " "
    return [*lines, line.rstrip()]


def diagram() -> str:
    """The floors block of docs/ARCHITECTURE.md, markers included: the rooms on each floor with what they
    hold, then, read from the imports, the rooms each room uses (leaves, which any floor may use, left out)."""
    arrows = room_arrows()
    order = sorted(ROOMS, key=lambda r: -FLOORS[r])  # stable: rooms of a floor keep the table's order
    width = max(len(_label(r)) for r in ROOMS) + 2
    out = [BEGIN, "```", f"floor  {'room'.ljust(width)}holds"]
    for r in order:
        out.append(f"{FLOORS[r]:>4}   {_label(r).ljust(width)}{ROOMS[r][1]}")
    out += ["```", "", ARROWS_NOTE, "", "```"]
    for r in order:
        used = sorted((t for t in arrows[r] if FLOORS.get(t, LEAF) != LEAF), key=lambda t: (-FLOORS.get(t, 99), t))
        words = [_label(t) + ("" if arrows[r][t] == RUNTIME else f"({arrows[r][t]})") for t in used]
        if FLOORS[r] != LEAF:
            out += _wrapped(f"{_label(r).ljust(width)}-> ", words or ["(nothing)"])
    out += ["```", END]
    return "\n".join(out)


def with_diagram(text: str) -> str:
    """``text`` (ARCHITECTURE.md) with the block between the markers (``<!-- floors: begin`` ... ``-->`` and
    ``<!-- floors: end -->``) replaced by :func:`diagram`."""
    start, stop = text.find(BEGIN_MARK), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{DOC}: put the markers {BEGIN_MARK} --> and {END} where the diagram goes")
    return text[:start] + diagram() + text[stop + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/ARCHITECTURE.md's diagram is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = with_diagram(text)
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: the diagram is stale; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new, encoding="utf-8")
        print(f"rewrote the diagram in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
