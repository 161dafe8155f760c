"""HostStaging (checkpoint/staging.py): the host copy an asynchronous save writes, in buffers reused across saves,
never a copy that is stale, broadcast or split where the live state is one tensor."""

from __future__ import annotations

import torch

from mixprec.checkpoint.staging import HostStaging


def state(weight: torch.Tensor, lr: float) -> dict:
    return {"model": {"w": weight, "tied": weight, "b": torch.arange(3.0)}, "groups": [{"lr": lr, "params": [0, 1]}]}


def test_the_copy_holds_the_values_at_the_call_and_later_saves_reuse_its_buffers():
    staging, w = HostStaging(), torch.randn(4, 5)
    first = staging.stage(state(w, 0.1))()
    assert torch.equal(first["model"]["w"], w) and first["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert first["model"]["w"] is first["model"]["tied"]  # one tensor under two names stays one (tied weights)
    assert first["model"]["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    at_call = w.clone()
    rebuild = staging.stage(state(w, 0.2))  # a later save: same tensors, new learning rate
    w.add_(1.0)  # the step goes on
    second = rebuild()
    assert torch.equal(second["model"]["w"], at_call) and second["groups"][0]["lr"] == 0.2
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # copied into the same buffer


def test_a_tensor_replaced_by_another_shape_gets_its_own_buffer_never_a_broadcast_copy():
    staging = HostStaging()
    staging.stage(state(torch.randn(4, 5), 0.1))()
    # the same structure; "w" now a row that copy_ would broadcast into the old (4, 5) buffer
    row = torch.randn(1, 5)
    copy = staging.stage(
        {"model": {"w": row, "tied": row, "b": torch.arange(3.0)}, "groups": [{"lr": 0.1, "params": [0, 1]}]}
    )()
    assert copy["model"]["w"].shape == (1, 5) and torch.equal(copy["model"]["w"], row)
    # untied now: two tensors, two buffers
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    copy = staging.stage(
        {"model": {"w": a, "tied": b, "b": torch.arange(3.0)}, "groups": [{"lr": 0.1, "params": [0, 1]}]}
    )()
    assert torch.equal(copy["model"]["w"], a) and torch.equal(copy["model"]["tied"], b)
    assert copy["model"]["w"] is not copy["model"]["tied"]


def test_a_transposed_tensor_keeps_its_strides_so_its_bytes_match_a_synchronous_save():
    weight = torch.randn(3, 4).t()  # torch.save writes the storage as laid out
    copy = HostStaging().stage({"w": weight})()["w"]
    assert copy.stride() == weight.stride() and torch.equal(copy, weight)
