"""mixprec.trainer: the high-level API (``from mixprec import Trainer, TrainingArguments``).

One concept per module, layered on the Accelerator (which owns precision, scaling and processes):

- ``args`` / ``configs``: TrainingArguments (HF's names and defaults) over small validated configs;
- ``trainer``: the Trainer's public API; ``loop``: the training loop; ``evaluation``: evaluate/predict;
- ``context``: what one train() hands its helpers (never the Trainer); ``events``: callbacks and loggers;
- ``callbacks``: TrainerCallback, TrainerControl, the default flow; ``state``: TrainerState, EvalPrediction;
- ``checkpointing``: checkpoint-N folders (atomic, pickle-free, pruned safely); ``signals``: SIGTERM;
- ``weights``: save_model's folder and the best model loaded at the end; ``seeding``: set_seed;
- ``data``: datasets to DataLoaders; ``optim``: the default optimizer and schedules;
- ``diagnosis``: diagnose_at_start; ``meter``, ``logging``, ``progress``, ``plots``, ``summary``: what the
  user sees.

Nothing is imported here, so importing one submodule (say ``callbacks``) stays cheap.
"""
