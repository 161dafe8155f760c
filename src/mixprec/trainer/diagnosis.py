"""``diagnose_at_start``: measure the model's gradient ranges before the first step, start the loss scale there.

Runs :func:`mixprec.diagnostics.diagnose` on the first training batches (in order, from a loader of its own,
so the training data order is untouched), with the model as the user built it: before ``prepare`` patches
its forward with autocast, since the diagnosis measures in fp32 itself and leaves the model, its gradients
and the RNG states as it found them. The report goes to metrics.jsonl; the fp16 scaler starts at the
recommended scale (the same on every process: the largest recommendation wins). A recommended precision
other than the one asked for is logged, never applied: the run keeps the precision it was given.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mixprec.diagnostics.diagnose import diagnose
from mixprec.loaders.from_datasets import make_loader
from mixprec.precision.formats import FP16, FP32, format_named

if TYPE_CHECKING:
    import torch

    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.trainer.args import TrainingArguments

logger = logging.getLogger("mixprec.trainer")


def diagnose_at_start(
    accelerator: Accelerator,
    args: TrainingArguments,
    model: torch.nn.Module,
    dataset: Any,
    collator: Any,
    record: Callable[..., None],
) -> Any:
    """Diagnose ``model`` (not yet prepared) on the first batches of ``dataset``, apply the recommended
    initial loss scale (fp16), ``record`` the report (metrics.jsonl) and log it; return the Report. Costs a
    few forward/backward passes and host syncs, once."""
    acc = accelerator
    loader = make_loader(dataset, args.per_device_train_batch_size, collator, shuffle=False, seed=0)
    # judged by the narrowest format the run may compute in (its own; "auto"'s narrowest candidate), fp32 by fp16's
    fmt = acc.precision.narrowest_format()
    target = (FP16 if fmt is FP32 else fmt).name
    optimizer = "sgd" if args.optim == "sgd" else "adam"
    report = diagnose(model, loader, precision_target=target, lr=args.learning_rate, optimizer=optimizer)
    scale = float(acc.reduce(float(report.recommended_init_scale), reduction="max").item())
    applied = acc.set_initial_loss_scale(scale)  # clamped to [min_loss_scale, max_scale]; auto's fp16 too
    record("diagnosis", 0, applied_init_scale=applied, report=report.to_dict())
    acc.print(
        f"mixprec diagnose: recommends {report.recommended_precision} with initial loss scale "
        f"{report.recommended_init_scale:g}; running {acc.mixed_precision}"
        + (f" from loss scale {applied:g}" if applied is not None else ""),
        file=sys.stderr,
    )
    # the recommendation is a format ("fp32", "fp16", "bf16"), compared with the one the run computes in (a bf16
    # policy computes in bf16); an undecided "auto" takes the diagnosis's verdict into its race
    if acc.precision.decided and format_named(report.recommended_precision) is not acc.precision.compute_format:
        logger.warning(
            "diagnose_at_start recommends precision=%r (%s); training with %r as asked",
            report.recommended_precision,
            "; ".join(report.reasons),
            acc.mixed_precision,
        )
    return report
