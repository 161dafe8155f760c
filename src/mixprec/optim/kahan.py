"""Kahan-compensated summation for weights held in low precision: the one update rule behind
``Bf16AdamW(rounding="kahan")`` (``precision="bf16-pure-kahan"``) and ``AnyPrecisionAdamW(use_kahan_summation=
True)`` (HF's ``optim="adamw_anyprecision"``).

Rounding ``w + update`` to bf16 loses the part of a small update below half a unit in the last place of ``w``
(Zamirai et al. 2020); the compensation buffer keeps what each rounding lost and adds it to the next update,
so the losses never accumulate. The buffer holds the lost amount itself (torchdistx's convention), in the
buffer's own dtype.
"""

from __future__ import annotations

import torch


def kahan_update_(
    target: torch.Tensor,
    weights: torch.Tensor,
    update: torch.Tensor,
    compensation: torch.Tensor,
    work: torch.Tensor | None = None,
) -> None:
    """``target`` (a low-precision parameter, or a slice of one) <- ``weights + update + compensation``,
    rounded once to ``target``'s dtype; ``compensation`` <- what that rounding lost.

    ``weights`` is ``target``'s value in fp32 and ``update`` the optimizer's fp32 step; ``update`` is
    overwritten. ``work`` (fp32, ``weights``' size) avoids a temporary when given."""
    update.add_(compensation.float())  # y: this step plus what earlier roundings lost
    new = torch.add(weights, update, out=work) if work is not None else weights + update
    rounded = new.to(target.dtype)  # t: rounded to nearest
    compensation.copy_(update.sub_(new.copy_(rounded).sub_(weights)))  # y - (t - w): this rounding's loss
    target.copy_(rounded)


def kahan_update_buckets_(
    targets: list[torch.Tensor],
    weights: torch.Tensor,
    update: torch.Tensor,
    compensations: list[torch.Tensor],
    work: torch.Tensor,
) -> None:
    """:func:`kahan_update_` for a bucket of several parameters (Bf16AdamW's): ``weights``, ``update`` and
    ``work`` are flat fp32 buffers over the concatenated ``targets`` (flat views of low-precision parameters,
    one dtype) and ``compensations`` (their buffers, likewise). The same arithmetic, elementwise, so the same
    bits; a few multi-tensor copies instead of one loop per parameter."""
    sizes = [t.numel() for t in targets]
    torch._foreach_copy_(list(work.split(sizes)), compensations)  # exact: widening
    update.add_(work)  # y: this step plus what earlier roundings lost
    torch.add(weights, update, out=work)
    rounded = work.to(targets[0].dtype)  # t: rounded to nearest
    update.sub_(work.copy_(rounded).sub_(weights))  # y - (t - w): this rounding's loss
    torch._foreach_copy_(compensations, list(update.split(sizes)))
    torch._foreach_copy_(targets, list(rounded.split(sizes)))
