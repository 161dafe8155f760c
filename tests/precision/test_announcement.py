"""precision/announcement.py: the precision says the run's line itself; "auto" says it again once it decided."""

from __future__ import annotations

import logging

import pytest

from mixprec.precision import AutoDecision, make_precision
from mixprec.precision.announcement import RunContext


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mixprec.accelerator"]


def test_a_named_mode_says_its_full_line_with_the_runs_context_and_prints_it_when_verbose(caplog, capsys):
    bf16 = make_precision("bf16", "cpu")
    run = RunContext(processes="DDP over 2 processes (gloo)", comm="gradients sent in bf16", verbose=True)
    bf16.configure(run=run)
    with caplog.at_level(logging.INFO, logger="mixprec.accelerator"):
        bf16.announce()
    (line,) = _lines(caplog)
    assert line.startswith("mixprec: bf16 on cpu (compute bfloat16, master weights float32, loss scaling off), ")
    assert "DDP over 2 processes (gloo), gradients sent in bf16: " in line
    assert capsys.readouterr().err.strip() == line


def test_auto_says_it_will_decide_then_the_decided_line_once_it_adopts_a_decision(caplog, capsys):
    auto = make_precision("auto", "cpu")
    auto.configure(run=RunContext(verbose=True))
    with caplog.at_level(logging.INFO, logger="mixprec.accelerator"):
        auto.announce()
        assert capsys.readouterr().err == ""  # pending: logged only, no decision to print yet
        auto.adopt(AutoDecision(chosen="bf16", step_seconds={}, device="cpu", source="checkpoint"))
    pending, decided = _lines(caplog)
    assert pending.startswith("mixprec: auto on cpu, 1 process: ")
    assert decided.startswith("mixprec: bf16 on cpu (compute bfloat16")
    assert capsys.readouterr().err.strip() == decided


def test_only_the_main_process_says_the_line_and_an_unconfigured_precision_says_nothing(caplog, capsys):
    worker = make_precision("fp32", "cpu")
    worker.configure(run=RunContext(is_main=False, verbose=True))
    alone = make_precision("fp32", "cpu")
    with caplog.at_level(logging.INFO, logger="mixprec.accelerator"):
        worker.announce()
        alone.announce()
    assert _lines(caplog) == []
    assert capsys.readouterr().err == ""
