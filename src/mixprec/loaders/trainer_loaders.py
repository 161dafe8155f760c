"""The Trainer's prepared DataLoaders: the training one, and one per evaluation dataset (kept, so a dataset
evaluated again reuses its loader and the Accelerator's saved state lists each loader once). Built from
:mod:`mixprec.loaders.from_datasets` and prepared by the Accelerator it is given."""

from __future__ import annotations

from typing import Any

from mixprec.loaders.from_datasets import ShardedStream, check_dataset, is_stream, make_loader


def check_datasets(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """Refuse, naming the argument, datasets the Trainer cannot read, and an evaluation with nothing to read."""
    if train_dataset is not None:
        check_dataset(train_dataset, "train_dataset")
    if isinstance(eval_dataset, dict) and not eval_dataset:
        raise ValueError("Trainer(eval_dataset={}) holds no evaluation set: pass {name: dataset, ...} or None")
    sets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]
    for name, dataset in sets:  # HF's dict of evaluation sets: each checked by its name
        if dataset is not None:
            check_dataset(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset")
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"TrainingArguments(eval_strategy={args.eval_strategy!r}) needs an eval_dataset: pass "
            "Trainer(eval_dataset=...) or set eval_strategy='no'"
        )


class TrainerLoaders:
    """Builds and keeps the prepared loaders of one Accelerator. A stream (an IterableDataset) is sharded:
    each of its examples is read by one process only."""

    def __init__(self, accelerator: Any, args: Any, collator: Any) -> None:
        # an Accelerator and a TrainingArguments: duck-typed, as both live floors above loaders/
        self.accelerator, self.args, self.collator = accelerator, args, collator
        self.train_stream: ShardedStream | None = None
        """The training stream this process reads, when the training data is a stream (it cannot seek: a
        resume skips what was trained)."""
        self._eval: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id, batch size): the dataset, its loader
        self._train_seed: int | None = None

    def _shard(self, dataset: Any, batch_size: int) -> Any:
        if not is_stream(dataset):
            return dataset
        acc = self.accelerator
        return ShardedStream(dataset, batch_size, acc.num_processes, acc.process_index)

    def data_seed(self) -> int:
        """The seed of the training data's order: ``data_seed``, else ``seed`` (HF's rule)."""
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    def reseed(self, loader: Any) -> None:
        """Before a fresh ``train()``: the order follows the arguments' seed as they are now (a script may set
        ``trainer.args.seed`` after building the Trainer, as HF allows). A resume keeps the checkpoint's."""
        seed = self.data_seed()
        if seed != self._train_seed and hasattr(loader, "set_shuffle_seed"):
            loader.set_shuffle_seed(seed)
            self._train_seed = seed

    def train(self, dataset: Any) -> Any:
        """The prepared training loader. Prepare it before any evaluation loader: save_state records data
        positions in preparation order."""
        args = self.args
        data = self._shard(dataset, args.per_device_train_batch_size)
        self.train_stream = data if isinstance(data, ShardedStream) else None
        self._train_seed = self.data_seed()
        loader = make_loader(
            data,
            args.per_device_train_batch_size,
            self.collator,
            shuffle=args.train_sampling_strategy == "random",
            seed=self.data_seed(),
            num_workers=args.dataloader_num_workers,
            drop_last=args.dataloader_drop_last,
            **args.loader_kwargs(),
        )
        return self.accelerator.prepare_data_loader(loader)

    def evaluation(self, dataset: Any) -> Any:
        """The prepared loader of ``dataset`` at ``per_device_eval_batch_size``, made at its first use (a batch
        size edited since gets its own: HF builds one per call)."""
        key = (id(dataset), self.args.per_device_eval_batch_size)
        if key not in self._eval:
            check_dataset(dataset, "eval_dataset")
            loader = make_loader(
                self._shard(dataset, self.args.per_device_eval_batch_size),
                self.args.per_device_eval_batch_size,
                self.collator,
                shuffle=False,
                seed=0,
                num_workers=self.args.dataloader_num_workers,
                **self.args.loader_kwargs(),
            )
            # the dataset is kept with its loader, so its id is not reused by another object while cached
            self._eval[key] = (dataset, self.accelerator.prepare_data_loader(loader))
        return self._eval[key][1]
