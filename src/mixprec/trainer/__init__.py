"""mixprec.trainer: the high-level API (``from mixprec import Trainer, TrainingArguments``).

One concept per module, layered on the Accelerator (which owns precision, scaling and processes):

- ``args`` / ``configs``: TrainingArguments (HF's names and defaults, each field once) and its grouped views;
- ``trainer``: the Trainer's public API; ``loop``: the training loop; ``evaluation``: evaluate/predict;
- ``context``: what one train() hands its helpers (never the Trainer); ``events``: callbacks, loggers, the
  progress bar and the watch's callback;
- ``callbacks``: TrainerCallback, TrainerControl, the default flow; ``state``: TrainerState, EvalPrediction;
- ``checkpointing``: checkpoint-N folders (atomic, pickle-free, pruned safely); ``signals``: SIGTERM;
- ``weights``: save_model's folder and the best model loaded at the end; ``seeding``: set_seed;
- ``batches``: a batch into the model; ``optimizers``: optimizer creation (HF's optim names) and schedules;
- ``diagnosis``: diagnose_at_start; ``meter``, ``logging``, ``plots``, ``summary`` (end-of-run reporting):
  what the user sees.

Nothing is imported here, so importing one submodule (say ``callbacks``) stays cheap.
"""
