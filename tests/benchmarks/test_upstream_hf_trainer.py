"""benchmarks.upstream_hf_trainer: the import switch a user makes, and nothing else."""

from __future__ import annotations

import textwrap

from benchmarks.upstream_hf_trainer import swap_imports


def test_only_the_names_mixprec_exports_move_and_the_rest_of_the_file_is_untouched():
    source = textwrap.dedent(
        """\
        import torch
        from transformers import (
            GPT2Config,
            Trainer,
            TrainingArguments,
        )
        from transformers.trainer_callback import CallbackHandler, TrainerControl
        from transformers.testing_utils import require_torch


        def f():
            from transformers import EarlyStoppingCallback
            return Trainer
        """
    )
    text, moved = swap_imports(source, {"Trainer", "TrainingArguments", "TrainerControl", "EarlyStoppingCallback"})
    assert moved == ["EarlyStoppingCallback", "Trainer", "TrainerControl", "TrainingArguments"]
    assert "from transformers import GPT2Config\n" in text
    assert "from mixprec import Trainer, TrainingArguments  # swapped from transformers\n" in text
    assert "from transformers.trainer_callback import CallbackHandler\n" in text
    assert "    from mixprec import EarlyStoppingCallback  # swapped from transformers\n" in text
    assert "from transformers.testing_utils import require_torch\n" in text  # other modules stay
    assert text.endswith("    return Trainer\n") and text.startswith("import torch\n")
