"""The Trainer: the seed's third snippet, for real.

::

    args = TrainingArguments(output_dir="./results", evaluation_strategy="epoch", fp16=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset["train"],
                      eval_dataset=dataset["validation"], compute_metrics=compute_metrics)
    trainer.train()

Built on the :class:`~mixprec.accelerator.accelerator.Accelerator` (precision, loss scaling, accumulation,
processes, checkpoint files); the Trainer adds the loop (:mod:`~mixprec.trainer.loop`), evaluation, checkpoint-N
folders (:mod:`~mixprec.trainer.checkpointing`), logs, plots and the end summary, through parts it owns (its
events, loaders, script endings). Under ``torchrun`` every process trains; the main one logs and writes files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.delegation import delegate
from mixprec.accelerator.prepared import is_prepared, release
from mixprec.loaders.from_datasets import ColumnFilter, is_stream
from mixprec.loaders.trainer_loaders import TrainerLoaders, check_datasets
from mixprec.trainer import checkpointing as ckpt
from mixprec.trainer import evaluation, loss_items, weights, world_change
from mixprec.trainer.activation_checkpointing import enable_activation_checkpointing
from mixprec.trainer.args import TrainingArguments
from mixprec.trainer.batches import loss_and_outputs
from mixprec.trainer.callbacks import CallbackHandler, TrainerCallback, TrainerControl
from mixprec.trainer.compile_gate import compile_model
from mixprec.trainer.configs import accelerator_kwargs
from mixprec.trainer.constructor_checks import check_model, check_optimizer_arguments
from mixprec.trainer.context import RunContext
from mixprec.trainer.diagnosis import diagnose_at_start
from mixprec.trainer.evaluation import EvalResult, check_compute_metrics, evaluation_loop
from mixprec.trainer.events import RunEvents
from mixprec.trainer.hf_loggers import set_library_log_level
from mixprec.trainer.logging import make_reporters
from mixprec.trainer.loop import Plan, fit
from mixprec.trainer.memory_metrics import MemoryMetrics
from mixprec.trainer.meter import StepMeter
from mixprec.trainer.neftune import input_embeddings
from mixprec.trainer.optimizers import build_optimizer, build_scheduler
from mixprec.trainer.seeding import enable_full_determinism, seed_run, set_seed
from mixprec.trainer.state import PredictionOutput, TrainerState, TrainOutput
from mixprec.trainer.summary import ScriptEndings

__all__ = ["Trainer", "enable_full_determinism", "set_seed"]


class Trainer:
    """Train, evaluate and predict with any ``nn.Module`` whose forward takes the batch's keys and returns
    a loss (``.loss``, a dict's "loss", or a tuple's first item), HF transformers models included."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Any = None,
    ) -> None:  # HF's arguments, in HF's order (transformers 5)
        self.args = args if args is not None else TrainingArguments()
        check_optimizer_arguments(model_init, optimizers, optimizer_cls_and_kwargs)
        self.compute_loss_func = compute_loss_func  # HF's: the loss from (outputs, labels, num_items_in_batch=)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self._memory = MemoryMetrics(not self.args.skip_memory_metrics, self.args.device)
        self._memory.start("init")
        # model_init (HF): a fresh model at every train(); also the model when none is given
        self.model_init = model_init
        if model is None and model_init is not None:
            seed_run(self.args.seed, self.args.full_determinism)
            model = model_init()
        check_model(model)
        self.args.validate()
        args = self.args
        check_datasets(args, train_dataset, eval_dataset)
        if args.neftune_noise_alpha is not None:
            input_embeddings(model)  # refused now, naming the fix, if the model has no embeddings to add noise to
        # the reporters' packages are checked before joining any process group, so a missing one fails fast
        main_launch = int(os.environ.get("RANK", "0")) == 0
        reporters = make_reporters(args.report_to, args.logging_dir) if main_launch else []
        seed_run(self.args.seed, self.args.full_determinism)
        self.accelerator = self._build_accelerator()
        set_library_log_level(args.log_level if self.accelerator.is_main_process else args.log_level_replica)
        self.model = model.to(self.accelerator.device)  # prepared (forward patched) when first used
        self._model_prepared = False
        self._created_scheduler = False
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.compute_metrics = compute_metrics
        check_compute_metrics(compute_metrics, args.batch_eval_metrics)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self._label_names = list(args.label_names or ["labels"])
        self.data_collator = ColumnFilter.for_model(
            model, data_collator, args.remove_unused_columns, self._label_names, processing_class
        )
        self.optimizer, self.lr_scheduler = optimizers
        self._trained = False
        self.diagnosis: Any = None
        self.resume_command = "trainer.train(resume_from_checkpoint=True)"  # for stop messages (the CLI's own)
        # Prepared first, before any eval loader: save_state records data positions in preparation order.
        self._loaders = TrainerLoaders(self.accelerator, args, self.data_collator)
        self._train_loader = self._loaders.train(train_dataset) if train_dataset is not None else None
        across = (lambda t: self.accelerator.reduce(t, "sum")) if self.accelerator.num_processes > 1 else None
        self.meter = StepMeter(self._current_scale, args.logging_nan_inf_filter, across)
        self.events = RunEvents(args, self.accelerator, reporters, list(callbacks or []))
        self._endings = ScriptEndings(args, self.events, self.accelerator)
        self.callback_handler.model = self.model
        self.event("on_init_end")
        self._memory.stop("init")

    # -- callbacks -----------------------------------------------------------------------------------

    @property
    def state(self) -> TrainerState:
        """The run's TrainerState: steps, epoch, log history, best metric."""
        return self.events.state

    @state.setter
    def state(self, value: TrainerState) -> None:
        self.events.state = value

    @property
    def control(self) -> TrainerControl:
        """The TrainerControl callbacks set to steer the loop (save, evaluate, log, stop)."""
        return self.events.control

    @control.setter
    def control(self, value: TrainerControl) -> None:
        self.events.control = value

    @property
    def callback_handler(self) -> CallbackHandler:
        """The object that calls each callback's events in order (HF's name)."""
        return self.events.handler

    add_callback = delegate("events.handler", CallbackHandler.add_callback)
    pop_callback = delegate("events.handler", CallbackHandler.pop_callback)
    remove_callback = delegate("events.handler", CallbackHandler.remove_callback)

    _load_callback_state = delegate("events", RunEvents.restore_callback_states)  # HF's name
    event = delegate("events", RunEvents.fire)
    record_event = delegate("events", RunEvents.record)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the loss scaler skipped in this run, a resumed one included (from its record)."""
        return self.accelerator.scaler.record.skipped_steps

    # -- the model and its loss ----------------------------------------------------------------------

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The module training calls (HF's name). mixprec keeps the user's module object when it prepares it:
        under DDP its forward runs through DDP, FSDP2 shards it in place; so this is ``self.model``, wrapped
        once however many times ``train()`` runs."""
        return self.model

    def get_num_trainable_parameters(self) -> int:
        """How many parameter elements training updates (``requires_grad``), counted on the unwrapped model."""
        model = self.accelerator.unwrap_model(self.model)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _prepared_model(self, training: bool = False) -> torch.nn.Module:
        if is_prepared(self.model) and not self.accelerator.prepared_here(self.model):
            # prepared by another Trainer's Accelerator (one model, several Trainers, as in HF): this Trainer's
            # precision takes over; single-process only (release refuses a DDP/FSDP-wrapped model)
            release(self.model)
            self._model_prepared = False
        if not self._model_prepared or not is_prepared(self.model):
            self.model = self.accelerator.prepare_model(self.model.to(self.accelerator.device))
            if self.args.torch_compile and not self._model_prepared and not training:  # training: compile_gate.py
                compile_model(self.model, self.args)
            self._model_prepared = True
        return self.model

    # -- construction helpers ------------------------------------------------------------------------

    def _build_accelerator(self) -> Accelerator:
        accelerator = Accelerator(**accelerator_kwargs(self.args))
        accelerator.gradient_state.divide_loss = False  # training_step divides, as HF's (see GradientState)
        return accelerator

    def _new_model_from_init(self) -> None:
        """model_init at train(), as HF: a fresh model, optimizer and scheduler. The Accelerator is rebuilt
        when it already prepared the old model or its optimizer, so its saved state holds this model only."""
        seed_run(self.args.seed, self.args.full_determinism)
        model = self.model_init()
        if self._model_prepared or self.optimizer is not None:
            self.accelerator = self._build_accelerator()
            self._endings = ScriptEndings(self.args, self.events, self.accelerator)
            self._loaders = TrainerLoaders(self.accelerator, self.args, self.data_collator)
            self._train_loader = self._loaders.train(self.train_dataset) if self.train_dataset is not None else None
        self.model = model.to(self.accelerator.device)
        self._model_prepared = False
        self.optimizer, self.lr_scheduler, self._created_scheduler = None, None, False
        self.callback_handler.model = self.model

    def compute_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The loss of one batch (override to customise, as in HF): the model's own, or with
        ``compute_loss_func`` that function's on the outputs and the labels. Raises ValueError if there is none."""
        loss, outputs = loss_and_outputs(model, inputs, self.compute_loss_func, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch, as HF's (its override point): ``compute_loss``, divided by the accumulation steps
        unless over the window's ``num_items_in_batch`` (loss_items.py), backpropagated; returned, detached."""
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.meter.phases.lap("forward")  # the run's time split (issue 36): one perf_counter, no sync
        if num_items_in_batch is not None:  # the window's items over every process: DDP averages, so x processes
            loss = loss * (self.accelerator.num_processes if self.args.average_tokens_across_devices else 1)
        elif (steps := self.args.gradient_accumulation_steps) > 1:
            loss = loss / steps
        self.accelerator.backward(loss)
        return loss.detach()

    def _current_scale(self) -> float:
        return self.accelerator.scaler.get_scale() if self.accelerator.scaler.is_enabled() else 1.0

    # -- data ----------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        """The prepared training DataLoader (each process's share; resumable mid-epoch)."""
        if self._train_loader is None:
            raise ValueError("Trainer: training needs a train_dataset; pass Trainer(train_dataset=...)")
        return self._train_loader

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The prepared loader ``predict(test_dataset)`` reads."""
        return self.get_eval_dataloader(test_dataset)

    def num_examples(self, dataloader: Any) -> int:
        """Examples in ``dataloader``'s dataset (HF's helper)."""
        return len(dataloader.dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The evaluation DataLoader over ``eval_dataset`` (or the Trainer's, or one of them by its name),
        split across processes."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate() needs an eval_dataset: pass Trainer(eval_dataset=...) or evaluate(ds)")
        return self._loaders.evaluation(dataset)

    # -- training ------------------------------------------------------------------------------------

    def create_optimizer(self) -> Any:
        """The optimizer from the arguments (``optim``, ``learning_rate``, ``weight_decay``...), unless one was
        given to ``Trainer``; HF's override point."""
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.args.optimization, self.optimizer_cls_and_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The LR schedule from the arguments over ``num_training_steps``, unless one was given; HF's override
        point."""
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = build_scheduler(optimizer, self.args.schedule, num_training_steps)
            self._created_scheduler = True
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Build AdamW (or SGD) and the LR schedule from the arguments, unless given to ``Trainer``."""
        self.create_optimizer()
        if self.lr_scheduler is None:
            self.create_scheduler(num_training_steps, self.optimizer)
        elif self._created_scheduler and self._trained:
            # a later train() (HF): the schedule this Trainer made restarts for the new run's length, inside
            # the prepared scheduler the Accelerator already holds (so its saved state keeps one scheduler)
            self.lr_scheduler.scheduler = build_scheduler(self.optimizer, self.args.schedule, num_training_steps)

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Train for ``max_steps`` or ``num_train_epochs``; resume from a checkpoint (``True``: the newest
        one in output_dir whose manifest verifies; newer damaged ones are skipped with a warning). On
        SIGTERM: saves a checkpoint at the next step boundary, then raises
        :class:`~mixprec.trainer.signals.TrainingInterrupted` (its ``exit_status`` is 143, 128 + SIGTERM, which
        ``mixprec train`` exits with, so schedulers see a job that did not finish). Under ``torchrun --max-restarts=N``,
        a restarted worker group resumes by itself (``None`` then means the newest complete checkpoint if
        any; ``False`` always starts fresh). A peer that dies or stays silent past ``ddp_timeout`` ends the
        run with :class:`~mixprec.strategies.peers.PeerLostError` naming its rank. output_dir is locked while training:
        a second run into it is refused (FolderInUseError) naming the process that holds it."""
        with ckpt.lock_output_dir(self.accelerator, self.args.output_dir):
            try:
                with self._memory.measure("train"):  # ended by the summary, which logs its metrics
                    return self._train(resume_from_checkpoint)
            except BaseException as err:
                self.events.close_progress()  # end the bar's line, so that the error is printed on its own
                explained = self.accelerator.explain_failure(err)
                if explained is not err:  # a peer died or went silent: one line naming it, not gloo's trace
                    raise explained from None
                raise

    def _train(self, resume_from_checkpoint: bool | str | None) -> TrainOutput:
        args = self.args
        args.validate()
        if self._trained:  # a later train(): a fresh state and control, as HF; the model continues as it is
            self.events.new_run(self.accelerator)
        if self.model_init is not None:
            self._new_model_from_init()
        acc = self.accelerator
        loader = self.get_train_dataloader()
        if self._trained and hasattr(loader, "set_epoch"):
            loader.set_epoch(0)  # the data from its start, as HF, and in step with the fresh state's position
        checkpoint = ckpt.agree_on_resume(acc, resume_from_checkpoint, args.output_dir)
        if checkpoint is None:
            self._loaders.reseed(loader)
        plan = Plan.for_dataset(self.train_dataset, loader, args)
        if checkpoint is not None:  # saved by another number of processes: the run's steps as saved
            plan = world_change.planned(plan, world_change.SavedRun.read(checkpoint), args, acc.num_processes)
        if checkpoint is None:
            self.record_event("train_begin", 0, resumed_from=None, precision=acc.mixed_precision)
            if args.diagnose_at_start:
                if self._model_prepared:
                    raise RuntimeError("diagnose_at_start measures the model before it is prepared: call train() first")
                self.diagnosis = diagnose_at_start(
                    acc, args, self.model, self.train_dataset, self.data_collator, self.record_event
                )
        checkpointing, checkpointing_kwargs = args.checkpointing_requested()
        if checkpointing:
            enable_activation_checkpointing(acc.unwrap_model(self.model), checkpointing_kwargs)
        model = self._prepared_model(training=True)
        self.create_optimizer_and_scheduler(plan.max_steps)
        self._trained = True
        self.optimizer, self.lr_scheduler = acc.prepare(self.optimizer, self.lr_scheduler)
        handler = self.callback_handler
        handler.optimizer, handler.lr_scheduler, handler.train_dataloader = self.optimizer, self.lr_scheduler, loader
        run = RunContext(
            acc,
            args,
            self.events,
            self.meter,
            model,
            self.optimizer,
            self.lr_scheduler,
            loader,
            compute_loss=self.compute_loss,
            training_step=self.training_step,
            count_items=loss_items.counter(
                acc.unwrap_model(model), self.compute_loss_func, acc, args.average_tokens_across_devices
            ),
            evaluate=lambda: self._evaluate(None, None),
            log=self.log,
            resume_command=self.resume_command,
            diagnosis=self.diagnosis,
            memory=self._memory,
        )
        examples = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None  # a stream has none
        return fit(run, plan, checkpoint, self._loaders.train_stream, examples)

    log = delegate("events", RunEvents.log)

    # -- evaluation and prediction -------------------------------------------------------------------

    def _run_eval(self, dataset: Any, prefix: str, want_predictions: bool, ignore_keys: Any = None) -> EvalResult:
        dataset = dataset if dataset is not None else self.eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset  # HF's: a set by its name
        loader = self.get_eval_dataloader(dataset)
        self.callback_handler.eval_dataloader = loader
        return evaluation_loop(
            self._prepared_model(),
            loader,
            self.accelerator,
            step=lambda model, batch, loss_only: self.prediction_step(model, batch, loss_only, ignore_keys),
            dataset_size=None if is_stream(dataset) else len(dataset),
            want_predictions=want_predictions,
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
            prefix=prefix,
            on_batch=lambda: self.event("on_prediction_step"),
            batch_metrics=self.args.batch_eval_metrics,
        )

    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """One evaluation batch, HF's override point: ``(loss, logits, labels)``, each None when absent (and
        logits and labels None with ``prediction_loss_only``). The loss is ``compute_loss``'s, the function
        training uses, an override included; ``ignore_keys`` are left out of the logits."""
        step, keys = evaluation.prediction_step, evaluation.ignored_keys(self.model, ignore_keys)
        return step(self.compute_loss, model, inputs, self._label_names, prediction_loss_only, keys)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """Loss and ``compute_metrics`` over the evaluation set, logged with prefix ``eval_``; a dict of sets
        (HF's) is evaluated set by set, each under ``eval_<name>_``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            parts = [self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}") for name, part in dataset.items()]
            return {key: value for metrics in parts for key, value in metrics.items()}
        want = self.compute_metrics is not None and not self.args.prediction_loss_only
        with self._memory.measure("eval") as memory:
            metrics = self._run_eval(dataset, metric_key_prefix, want, ignore_keys).metrics
            self.log(metrics)
            self.event("on_evaluate", metrics=metrics)
        metrics.update(memory)  # HF's eval_mem_* (returned, not logged)
        if self.state.epoch is not None:
            metrics["epoch"] = self.state.epoch  # as HF's, whose log() adds it to the dict it is given
        return metrics

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False) -> dict[str, float]:
        """The evaluation training runs when the callbacks ask for one; its metrics choose the best checkpoint
        (``metric_for_best_model``). HF's name and signature: HF's tests patch it to plant metrics. ``trial``
        (hyperparameter search) and ``skip_scheduler`` are accepted and unused: mixprec has no HP search
        and no metric-driven scheduler."""
        return self.evaluate(ignore_keys=ignore_keys_for_eval)

    def predict(self, test_dataset: Any, ignore_keys: Any = None, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (everything the model returns but the loss and ``ignore_keys``), labels and metrics, as
        HF's; with ``prediction_loss_only`` the loss alone (predictions and labels None)."""
        with self._memory.measure("test") as memory:
            want = not self.args.prediction_loss_only
            result = self._run_eval(test_dataset, metric_key_prefix, want, ignore_keys)
        result.metrics.update(memory)
        self.event("on_predict", metrics=result.metrics)
        return PredictionOutput(result.predictions, result.label_ids, result.metrics)

    # -- the final model -----------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the (unwrapped) model's weights as safetensors (HF models via ``save_pretrained``), with the
        tokenizer/processor when one was given. Main process only."""
        out = Path(output_dir or self.args.output_dir)
        return weights.save_model(self.accelerator, self.model, out, self.args, self.processing_class)

    # -- what HF's example scripts call at their end: the endings part (main process only) -------------

    is_world_process_zero = delegate("_endings", ScriptEndings.is_world_process_zero)
    is_local_process_zero = delegate("_endings", ScriptEndings.is_local_process_zero)
    metrics_format = delegate("_endings", ScriptEndings.metrics_format)
    log_metrics = delegate("_endings", ScriptEndings.log_metrics)
    save_metrics = delegate("_endings", ScriptEndings.save_metrics)
    save_state = delegate("_endings", ScriptEndings.save_state)
    create_model_card = delegate("_endings", ScriptEndings.create_model_card)
