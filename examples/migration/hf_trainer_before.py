"""Before: the seed's HF Trainer snippet, ``TrainingArguments(evaluation_strategy="epoch", fp16=True)``.

transformers 5 removed ``evaluation_strategy`` (a TypeError), so this script uses ``eval_strategy``; with
``fp16=True`` on a CPU, HF's Trainer trains in fp32.
"""

import tempfile

import torch
from _toy import computed_dtypes, toy_model_and_data
from transformers import Trainer, TrainingArguments


class Model(torch.nn.Module):
    """The toy MLP behind HF's model contract: keyword batch in, ``{"loss": ...}`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.batches = toy_model_and_data()

    def forward(self, inputs, targets):
        return {"loss": torch.nn.functional.mse_loss(self.net(inputs).float(), targets)}


model = Model()
seen = computed_dtypes(model.net)
rows = [{"inputs": b["inputs"][i], "targets": b["targets"][i]} for b in model.batches for i in range(32)]

with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out,
        eval_strategy="epoch",
        fp16=True,
        num_train_epochs=1,
        per_device_train_batch_size=32,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:64])
    result = trainer.train()

print(f"HF Trainer: computed in {sorted(map(str, seen))}, train loss {result.training_loss:.4f}")
