"""The evaluation loop behind ``Trainer.evaluate()`` and ``Trainer.predict()``.

The model runs in eval mode without gradients, through the prepared model (so under the run's precision,
with fp32 outputs), and through the same ``compute_loss`` as training (HF's ``prediction_step`` rule): a
batch reaches the model as it does in training (``model(**batch)``, ``model(*batch)`` for tuples), and a
``compute_loss`` override decides the evaluation loss too.

Losses are summed on the device and read once at the end; predictions and labels are
moved to the host only when ``compute_metrics`` (or ``predict``) needs them. Under several processes every
process evaluates its shard of the prepared loader (each example in exactly one shard) and the results are
gathered with ``Accelerator.gather``, which accepts shards of different sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixprec.models.outputs import extract_loss  # one loss rule, shared with the diagnosis
from mixprec.trainer.batches import call_model, count_samples
from mixprec.trainer.state import EvalPrediction


@dataclass
class EvalResult:
    metrics: dict[str, float]
    predictions: Any
    label_ids: Any


def logits_of(outputs: Any, ignore_keys: Sequence[str] = ()) -> Any:
    """Everything a model returned except its loss and ``ignore_keys`` (HF's rule): one tensor, or a tuple."""
    if isinstance(outputs, torch.Tensor):
        return None
    if isinstance(outputs, Mapping):
        left_out = {"loss", *ignore_keys}
        values = [v for k, v in outputs.items() if k not in left_out and isinstance(v, torch.Tensor)]
    elif hasattr(outputs, "loss") and hasattr(outputs, "logits"):
        values = [outputs.logits]
    elif isinstance(outputs, (tuple, list)):
        values = [v for v in outputs[1:] if isinstance(v, torch.Tensor)]
    else:
        values = []
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def ignored_keys(model: torch.nn.Module, ignore_keys: Sequence[str] | None) -> Sequence[str]:
    """The output keys evaluation leaves out of the logits: ``ignore_keys``, or by default the model config's
    ``keys_to_ignore_at_inference`` (HF's)."""
    if ignore_keys is not None:
        return ignore_keys
    return getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None) or ()


def _labels_of(batch: Any, label_names: Sequence[str]) -> Any:
    if not isinstance(batch, Mapping):
        return None
    found = [batch[k] for k in label_names if k in batch]
    if not found:
        return None
    return found[0] if len(found) == 1 else tuple(found)


def _concat(chunks: list[Any]) -> Any:
    """Concatenate per-batch arrays along the batch axis, padding ragged later axes with -100 (HF's pad)."""
    if not chunks:
        return None
    if isinstance(chunks[0], tuple):
        return tuple(_concat([c[i] for c in chunks]) for i in range(len(chunks[0])))
    if chunks[0].ndim == 0 or all(c.shape[1:] == chunks[0].shape[1:] for c in chunks):
        return np.concatenate([np.atleast_1d(c) for c in chunks])
    shape = [max(c.shape[d] for c in chunks) for d in range(1, chunks[0].ndim)]
    out = np.full((sum(len(c) for c in chunks), *shape), -100, dtype=chunks[0].dtype)
    row = 0
    for c in chunks:
        out[(slice(row, row + len(c)), *(slice(0, s) for s in c.shape[1:]))] = c
        row += len(c)
    return out


def _to_host(x: Any) -> Any:
    """numpy on the host (a copy: one sync per call on an accelerator); low-precision floats become fp32."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_to_host(v) for v in x)
    return x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()


ComputeLoss = Callable[..., Any]  # compute_loss(model, batch, return_outputs=True) -> (loss, outputs)


PredictionStep = Callable[[torch.nn.Module, Any, bool], tuple[Any, Any, Any]]
"""``step(model, batch, prediction_loss_only) -> (loss, logits, labels)``: HF's ``Trainer.prediction_step``."""


def prediction_step(
    compute_loss: ComputeLoss,
    model: torch.nn.Module,
    batch: Any,
    label_names: Sequence[str],
    loss_only: bool,
    ignore_keys: Sequence[str] = (),
) -> tuple[torch.Tensor | None, Any, Any]:
    """One evaluation batch, HF's ``prediction_step``: ``(loss, logits, labels)``, each None when absent;
    with ``loss_only`` the logits and labels are None.

    A batch with labels (and any tuple batch, whose labels cannot be told apart) goes through
    ``compute_loss(model, batch, return_outputs=True)``, the function training uses. A dict batch without
    labels, when no loss is needed (``predict`` on unlabelled data), is only called: there is no loss to take.
    """
    labelled = not isinstance(batch, Mapping) or any(k in batch for k in label_names)
    if not labelled and not loss_only:
        outputs = call_model(model, batch)
        return _loss_if_any(outputs), logits_of(outputs, ignore_keys), None  # no labels to return either
    try:
        result = compute_loss(model, batch, return_outputs=True)
    except ValueError:
        if loss_only:
            raise
        # predict() with a model that returns no loss even given labels: its outputs are what is wanted
        # (a second forward, on this rare path only).
        return None, logits_of(call_model(model, batch), ignore_keys), _labels_of(batch, label_names)
    if isinstance(result, tuple) and len(result) == 2:
        loss, outputs = result
    else:  # an override that ignores return_outputs and returns the loss alone
        loss, outputs = result, None
    if loss_only:
        return loss, None, None
    if isinstance(outputs, torch.Tensor):  # an override's model output: a bare tensor is its logits
        return loss, outputs if outputs is not loss else None, _labels_of(batch, label_names)
    return loss, logits_of(outputs, ignore_keys), _labels_of(batch, label_names)


def check_compute_metrics(compute_metrics: Any, batch_eval_metrics: bool) -> None:
    """With ``batch_eval_metrics``, ``compute_metrics`` must take ``compute_result``: refused at construction."""
    if batch_eval_metrics and compute_metrics is not None:
        import inspect

        if "compute_result" not in inspect.signature(compute_metrics).parameters:
            raise ValueError(
                "TrainingArguments(batch_eval_metrics=True): compute_metrics must take a compute_result "
                "argument (True on the last batch, when it returns the metrics)"
            )


def evaluation_loop(
    model: torch.nn.Module,
    loader: Any,
    accelerator: Any,
    *,
    step: PredictionStep,
    dataset_size: int | None,
    want_predictions: bool,
    compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None,
    prefix: str,
    on_batch: Callable[[], None] | None = None,
    batch_metrics: bool = False,
) -> EvalResult:
    """Run ``model`` over ``loader``; return ``<prefix>_loss``, ``<prefix>_<metric>`` and timing metrics.

    ``batch_metrics`` (HF's ``batch_eval_metrics``): ``compute_metrics`` is called after every batch with
    that batch's (gathered) tensors and ``compute_result=False``, and with ``compute_result=True`` on the
    last batch, whose return value are the metrics; so a metric can accumulate without the whole set in memory.

    Host syncs: one for the loss at the end; plus one copy per batch to the host when predictions are kept.
    """
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    world = accelerator.num_processes
    loss_sum: torch.Tensor | None = None
    counted = batches = 0
    preds, labels = [], []
    batch_result: dict[str, Any] | None = None
    try:
        with torch.no_grad():
            for batch, is_last in _with_last(loader):
                n = count_samples(batch)
                loss, logits, label = step(model, batch, not want_predictions)
                if loss is not None:
                    weighted = loss.detach().float() * n  # batch means weighted by size: a mean over examples
                    loss_sum = weighted if loss_sum is None else loss_sum + weighted
                counted += n
                batches += 1
                if want_predictions:
                    if preprocess_logits_for_metrics is not None and logits is not None:
                        logits = preprocess_logits_for_metrics(logits, label)
                    if world > 1:
                        logits, label = _gather(accelerator, logits), _gather(accelerator, label)
                    if batch_metrics and compute_metrics is not None and logits is not None and label is not None:
                        batch_result = compute_metrics(EvalPrediction(logits, label), compute_result=is_last)
                    preds.append(_to_host(logits))
                    labels.append(_to_host(label))
                if on_batch is not None:
                    on_batch()
    finally:
        model.train(was_training)

    metrics: dict[str, float] = {}
    if loss_sum is not None:
        totals = torch.stack([loss_sum, torch.tensor(float(counted), device=loss_sum.device)])
        if world > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        total_loss, total_count = totals.tolist()  # the one host sync of the loop
        metrics[f"{prefix}_loss"] = total_loss / max(total_count, 1.0)
    predictions = _concat([p for p in preds if p is not None]) if preds and preds[0] is not None else None
    label_ids = _concat([lab for lab in labels if lab is not None]) if labels and labels[0] is not None else None
    if batch_metrics:
        computed = batch_result
    elif (
        compute_metrics is not None and predictions is not None and label_ids is not None
    ):  # as HF: no labels, no metrics
        computed = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
    else:
        computed = None
    for key, value in (computed or {}).items():
        metrics[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = _plain(value)
    runtime = time.perf_counter() - start
    metrics[f"{prefix}_runtime"] = round(runtime, 4)
    samples = dataset_size if dataset_size is not None else counted  # a stream: what this process read
    metrics[f"{prefix}_samples_per_second"] = round(samples / max(runtime, 1e-9), 3)
    metrics[f"{prefix}_steps_per_second"] = round(batches / max(runtime, 1e-9), 3)
    return EvalResult(metrics, predictions, label_ids)


def _with_last(items: Any) -> Any:
    """``(item, is_last)`` pairs, one item of look-ahead."""
    iterator = iter(items)
    current = next(iterator, _END)
    while current is not _END:
        upcoming = next(iterator, _END)
        yield current, upcoming is _END
        current = upcoming


_END = object()


def _loss_if_any(outputs: Any) -> torch.Tensor | None:
    try:
        return extract_loss(outputs)
    except ValueError:
        return None  # prediction without labels: there is no loss to report, only outputs


def _gather(accelerator: Any, x: Any) -> Any:
    """Every process's rows of ``x``; later axes (a sequence length that differs between processes, with
    dynamic padding) padded with -100 to the longest first, as HF's Trainer does."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_gather(accelerator, v) for v in x)
    for dim in range(1, x.dim()):
        x = accelerator.pad_across_processes(x, dim=dim, pad_index=-100)
    return accelerator.gather(x)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)):
        return value.item()
    return value
