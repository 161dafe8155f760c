"""The invariants every cell of the combination matrix holds, each failing with its own AssertionError kind so a
cell's expected failure (``pytest.mark.xfail(raises=...)``) names the one invariant a known defect breaks and
still fails on any other. Not collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

import logging
import re
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


class FormatNamed(AssertionError):
    """A warning or log line names a number format the run does not compute in."""


class FigureMismatch(AssertionError):
    """A reported figure (summary, return value) differs from the metrics file."""


class ResumeDiffers(AssertionError):
    """A resumed run's weights differ from the uninterrupted run's."""


class WroteOutside(AssertionError):
    """Something was written outside the run folder (cwd, HOME, the cache or temp folders)."""


class SkipLeaked(AssertionError):
    """A skipped step changed weights, moments or counters as a skipped step should not."""


# "fp16" but not "bf16"; "float16" but not "bfloat16" (its tail)
FORMAT_NAMES = {
    "fp16": re.compile(r"\bfp16\b|(?<!b)float16|\bhalf precision", re.IGNORECASE),
    "bf16": re.compile(r"\bbf16|bfloat16", re.IGNORECASE),
}


def computes_in(precision: str) -> set[str]:
    """The 16-bit formats a run of ``precision`` computes in (fp32 is everywhere: masters, losses): "auto"
    races every candidate, so each may appear in its lines."""
    if precision.startswith("auto"):
        return {"fp16", "bf16"}
    return {"fp16"} if precision.startswith("fp16") else {"bf16"} if precision.startswith("bf16") else set()


@dataclass
class Findings:
    """Every invariant a cell broke; :meth:`check` raises the one kind when all are of one kind, else a plain
    AssertionError listing them (which no ``xfail(raises=<kind>)`` swallows)."""

    found: list[tuple[type[AssertionError], str]] = field(default_factory=list)

    def add(self, kind: type[AssertionError], message: str) -> None:
        self.found.append((kind, message))

    def expect(self, ok: bool, kind: type[AssertionError], message: str) -> None:
        if not ok:
            self.add(kind, message)

    def check(self) -> None:
        if not self.found:
            return
        kinds = {k for k, _ in self.found}
        text = "\n".join(f"{k.__name__}: {m}" for k, m in self.found)
        raise (kinds.pop() if len(kinds) == 1 else AssertionError)(text)


# -- what the run said -----------------------------------------------------------------------------------


@dataclass
class Said:
    """The warnings and log records (any logger, any level from INFO) a cell's run emitted, and its printout."""

    lines: list[str] = field(default_factory=list)

    def add_text(self, text: str) -> None:
        self.lines.extend(line for line in text.splitlines() if line.strip())

    def formats_named(self, precision: str, findings: Findings, also: frozenset[str] = frozenset()) -> None:
        """Each line names only formats the run computes in (or ``also``: the one its gradients travel in). An
        fp32 run's watch measures against fp16 by design ("would fp16 hold?"): its lines say so, naming fp32 as
        the format the run computes in, and only such lines may name fp16."""
        allowed = computes_in(precision) | also
        for line in self.lines:
            what_if = precision == "fp32" and ("computes in fp32: a what-if" in line or "'computes_in': 'fp32'" in line)
            for fmt, pattern in FORMAT_NAMES.items():
                if fmt not in allowed and pattern.search(line) and not (what_if and fmt == "fp16"):
                    findings.add(FormatNamed, f"a {precision} run's line names {fmt}: {line.strip()[:300]}")


class _Records(logging.Handler):
    def __init__(self, said: Said) -> None:
        super().__init__(logging.INFO)
        self.said = said

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("mixprec", "transformers", "root")):
            self.said.add_text(record.getMessage())


@contextmanager
def listening() -> Iterator[Said]:
    """Catch every warning and log record emitted inside (handlers on the root logger and on each logger that
    does not propagate to it: transformers' own)."""
    said = Said()
    handler = _Records(said)
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger) and not lg.propagate
    ]
    levels = {}
    for lg in loggers:
        lg.addHandler(handler)
        if lg.name.startswith("mixprec") or lg is loggers[0]:
            levels[lg] = lg.level
            lg.setLevel(logging.INFO)
    mixprec_logger = logging.getLogger("mixprec")
    levels.setdefault(mixprec_logger, mixprec_logger.level)
    mixprec_logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        for lg, level in levels.items():
            lg.setLevel(level)
    for w in caught:
        said.add_text(f"{w.category.__name__}: {w.message}")


# -- where the run wrote ---------------------------------------------------------------------------------


class Sandbox:
    """A cell's world: cwd, HOME, the cache and temp folders under one tmp folder, so that whatever the run
    writes can be found. ``check`` fails for any file created or changed outside the allowed run folders."""

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = root
        self.cwd, self.home, self.tmp = root / "cwd", root / "home", root / "tmp"
        for d in (self.cwd, self.home, self.tmp):
            d.mkdir()
        monkeypatch.chdir(self.cwd)
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv("XDG_CACHE_HOME", str(self.home / ".cache"))
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(self.home / ".cache" / "inductor"))
        monkeypatch.setattr(tempfile, "tempdir", str(self.tmp))
        self.before = self._snapshot()

    def _snapshot(self) -> dict[Path, tuple[int, int]]:
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in self.root.rglob("*") if p.is_file()}

    def check(self, allowed: list[Path], findings: Findings) -> None:
        allowed = [Path(a).resolve() for a in allowed]
        for path, sig in self._snapshot().items():
            if self.before.get(path) == sig:
                continue
            if not any(path.resolve().is_relative_to(a) for a in allowed):
                findings.add(WroteOutside, f"wrote {path.relative_to(self.root)} outside {[a.name for a in allowed]}")


# -- state ----------------------------------------------------------------------------------------------


def clone_tree(obj):
    """A deep copy of tensors in nested dicts/lists (an optimizer's or model's state), detached."""
    return torch.utils._pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, obj)


def same_tree(a, b) -> bool:
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    if sa != sb:
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (bit for bit), or that only one side holds."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n].float(), b[n].float())]


class Plant:
    """Make ``param``'s gradient inf while ``armed`` (a backward in the step the cell chose), as an overflow
    would: armed by step, not by backward count, since auto's race aside runs backwards of its own."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.armed = False
        param.register_hook(lambda grad: grad * float("inf") if self.armed else grad)
