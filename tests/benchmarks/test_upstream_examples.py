"""benchmarks.upstream_examples: the switch a user makes in an example script, and the table it prints."""

from __future__ import annotations

import textwrap

import torch
from benchmarks._example_probe import Probe
from benchmarks.upstream_examples import SCRIPTS, Run, Script, last_error, stage, table

SCRIPT = textwrap.dedent(
    """\
    import evaluate
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import set_seed
    from transformers import AutoModelForSequenceClassification, Trainer

    accelerator = Accelerator(cpu=True)
    """
)


def test_an_accelerate_example_gets_only_the_accelerator_from_mixprec_and_the_checkout_is_left_alone(tmp_path):
    checkout = tmp_path / "accelerate"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "nlp_example.py").write_text(SCRIPT)
    script = Script("nlp_example", "accelerate", "examples/nlp_example.py", ("accelerate", ("Accelerator",)))
    checkouts = {"accelerate": checkout}
    assert stage(script, checkouts, tmp_path / "work", "upstream") == checkout / "examples" / "nlp_example.py"
    staged = stage(script, checkouts, tmp_path / "work", "mixprec")
    text = staged.read_text()
    assert "from accelerate import DistributedType\n" in text
    assert "from mixprec import Accelerator  # swapped from accelerate\n" in text
    assert "from transformers import AutoModelForSequenceClassification, Trainer\n" in text  # not this module's
    assert "from accelerate.utils import set_seed\n" in text
    assert (checkout / "examples" / "nlp_example.py").read_text() == SCRIPT  # never edited in place
    assert staged.is_relative_to(tmp_path / "work")


def test_a_trainer_script_swaps_trainer_and_training_arguments_and_keeps_hf_argument_parser(tmp_path):
    checkout = tmp_path / "transformers"
    path = checkout / "examples" / "run_clm.py"
    path.parent.mkdir(parents=True)
    path.write_text("from transformers import (\n    HfArgumentParser,\n    Trainer,\n    TrainingArguments,\n)\n")
    run_clm = next(s for s in SCRIPTS if s.name == "run_clm")
    script = Script("run_clm", "transformers", "examples/run_clm.py", run_clm.swap)
    text = stage(script, {"transformers": checkout}, tmp_path / "work", "mixprec").read_text()
    assert text == (
        "from transformers import HfArgumentParser\n"
        "from mixprec import Trainer, TrainingArguments  # swapped from transformers\n"
    )


def test_each_script_is_told_the_precision_the_way_it_takes_it():
    by = {s.name: s for s in SCRIPTS}
    assert by["run_clm"].precision_args("fp32") == ([], {})
    assert by["run_clm"].precision_args("bf16") == (["--bf16"], {})
    assert by["nlp_example"].precision_args("fp32") == (["--mixed_precision", "no", "--cpu"], {})
    assert by["run_clm_no_trainer"].precision_args("fp16") == ([], {"ACCELERATE_MIXED_PRECISION": "fp16"})


def test_the_error_cell_is_the_exception_line_not_the_last_line_of_output():
    stderr = "Traceback (most recent call last):\n  File 'x.py'\nTypeError: bad | thing\nsome atexit chatter\n"
    assert last_error(stderr) == "TypeError: bad | thing"
    assert last_error("killed\n") == "killed"
    assert len(last_error("ValueError: " + "x" * 500)) == 160


def test_the_table_puts_both_implementations_on_one_row_and_flags_a_precision_not_really_used():
    runs = [
        Run("nlp_example", "fp16", "upstream", rc=0, linear_dtypes={"float32": 8}, losses=[0.7, 0.69]),
        Run("nlp_example", "fp16", "mixprec", rc=0, linear_dtypes={"float16": 6, "float32": 2}, losses=[0.7, 0.6]),
        Run("run_clm", "bf16", "upstream", rc=0, linear_dtypes={"bfloat16": 4}, losses=[5.0]),
        Run("run_clm", "bf16", "mixprec", rc=1, error="TypeError: unexpected keyword argument 'mixprec' | x"),
    ]
    lines = table(runs).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| script | precision | upstream | mixprec |")
    nlp, clm = lines[2], lines[3]
    assert "| fp32 / fp16 75% / fp32 25% |" in nlp and "| 0.7000 -> 0.6900 | 0.7000 -> 0.6000 |" in nlp
    assert "upstream ran fp32 when asked fp16" in nlp
    assert "**mixprec computed in fp16 75% / fp32 25%, asked fp16**" in nlp  # mixed is not the asked precision
    assert "| exit 1: TypeError: unexpected keyword argument 'mixprec' \\| x |" in clm  # a | would split the cell
    assert "item 1, HfArgumentParser (branch dropin)" in clm and "| bf16 / - |" in clm


def test_the_probe_counts_training_matmul_dtypes_and_each_loss_once():
    probe = Probe()
    linear = torch.nn.Linear(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe(linear, (), linear(torch.ones(1, 2)))
    loss = torch.tensor(0.5)
    probe(torch.nn.Module(), (), {"loss": loss})
    probe(torch.nn.Module(), (), {"loss": loss})  # a wrapper returning its inner model's output
    with torch.no_grad():
        probe(linear, (), linear(torch.ones(1, 2)))  # evaluation: not counted
    assert probe.report() == {"linear_dtypes": {"bfloat16": 1}, "losses": [0.5]}
