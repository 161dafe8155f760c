"""After: the same script with ``from mixprec import Trainer, TrainingArguments``: fp16 really runs (autocast and
loss scaling) on a CPU, and the seed's ``evaluation_strategy`` is accepted again as the old name of
``eval_strategy``. ``use_cpu``, ``report_to`` and the rest keep HF's names and meanings.
"""

import tempfile

import torch
from _toy import computed_dtypes, toy_model_and_data

from mixprec import Trainer, TrainingArguments  # was: from transformers import ...


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
        evaluation_strategy="epoch",
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

print(f"mixprec Trainer: computed in {sorted(map(str, seen))}, train loss {result.training_loss:.4f}")
