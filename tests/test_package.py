"""The package surface: a light import, every public name resolves, the seed's imports work."""

from __future__ import annotations

import subprocess
import sys

import mixprec


def test_import_is_light():
    # optional and heavy libraries load only when the names that need them are used
    heavy = "('torch', 'transformers', 'matplotlib', 'tqdm')"
    code = f"import sys, mixprec; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_resolves():
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None, name


def test_the_seeds_imports():
    from mixprec import Accelerator, GradScaler, Trainer, TrainingArguments  # noqa: F401

    assert mixprec.LossScaler is mixprec.GradScaler
