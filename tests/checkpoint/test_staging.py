"""HostStaging (checkpoint/staging.py): the host copy an asynchronous save writes, in buffers reused across saves,
never a copy that is stale, broadcast or split where the live state is one tensor."""

from __future__ import annotations

import torch

from mixprec.checkpoint.staging import HostStaging


def state(weight: torch.Tensor, lr: float) -> dict:
    return {"model": {"w": weight, "tied": weight, "b": torch.arange(3.0)}, "groups": [{"lr": lr, "params": [0, 1]}]}


def test_the_copy_holds_the_values_at_the_call_and_later_saves_reuse_its_buffers():
    staging, w = HostStaging(), torch.randn(4, 5)
    first = staging.capture(state(w, 0.1), defer=False).states()
    assert torch.equal(first["model"]["w"], w) and first["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert first["model"]["w"] is first["model"]["tied"]  # one tensor under two names stays one (tied weights)
    assert first["model"]["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    at_call = w.clone()
    staged = staging.capture(state(w, 0.2), defer=False)  # a later save: same tensors, new learning rate
    w.add_(1.0)  # the step goes on
    second = staged.states()
    assert torch.equal(second["model"]["w"], at_call) and second["groups"][0]["lr"] == 0.2
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # copied into the same buffer


def test_a_tensor_replaced_by_another_shape_gets_its_own_buffer_never_a_broadcast_copy():
    staging = HostStaging()
    staging.capture(state(torch.randn(4, 5), 0.1)).states()
    # the same structure; "w" now a row that copy_ would broadcast into the old (4, 5) buffer
    row = torch.randn(1, 5)
    copy = staging.capture(
        {"model": {"w": row, "tied": row, "b": torch.arange(3.0)}, "groups": [{"lr": 0.1, "params": [0, 1]}]}
    ).states()
    assert copy["model"]["w"].shape == (1, 5) and torch.equal(copy["model"]["w"], row)
    # untied now: two tensors, two buffers
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    copy = staging.capture(
        {"model": {"w": a, "tied": b, "b": torch.arange(3.0)}, "groups": [{"lr": 0.1, "params": [0, 1]}]}
    ).states()
    assert torch.equal(copy["model"]["w"], a) and torch.equal(copy["model"]["tied"], b)
    assert copy["model"]["w"] is not copy["model"]["tied"]


def test_a_transposed_tensor_keeps_its_strides_so_its_bytes_match_a_synchronous_save():
    weight = torch.randn(3, 4).t()  # torch.save writes the storage as laid out
    copy = HostStaging().capture({"w": weight}).states()["w"]
    assert copy.stride() == weight.stride() and torch.equal(copy, weight)


def test_a_deferred_copy_holds_the_values_at_the_copy_except_what_now_names_which_holds_the_call():
    # The async save's contract: deferred tensors are read when copy() runs (the writer, before the next optimizer
    # step); a tensor a forward rewrites (a running statistic, named in `now`) is taken at the capture, and stays
    # one tensor under its two names.
    staging, w, stats = HostStaging(), torch.randn(4, 5), torch.zeros(3)
    staged = staging.capture({"w": w, "stats": stats, "alias": stats}, now={stats.data_ptr()})
    stats.add_(1.0)  # a forward's in-place update, after save_state returned
    w.mul_(2.0)  # only to show that the deferred copy is read late: nothing changes w before copy() in a save
    copy = staged.states()
    assert torch.equal(copy["stats"], torch.zeros(3)) and copy["stats"] is copy["alias"]
    assert torch.equal(copy["w"], w) and copy["w"].data_ptr() != w.data_ptr()


def test_every_layout_is_copied_by_value_the_byte_copy_and_torchs_alike():
    # plain dense tensors are copied byte for byte (one thread: no OpenMP team on the writer); a view with gaps,
    # a conjugate view or an offset into a larger storage must still arrive as its values
    base = torch.randn(6, 8)
    states = {
        "dense": torch.randn(5, 7),
        "bf16": torch.randn(4, 4).to(torch.bfloat16),
        "permuted": torch.randn(3, 4, 5).permute(2, 0, 1),
        "offset": base[2:4],  # dense, inside a larger storage
        "gaps": base[:, ::2],  # not dense: torch's copy
        "conj": torch.randn(3, 2, dtype=torch.complex64).conj(),  # values differ from its bytes
        "empty": torch.empty(0, 3),
    }
    copies = HostStaging().capture(states).states()
    for name, live in states.items():
        assert copies[name].dtype == live.dtype and torch.equal(copies[name], live.resolve_conj()), name
        if live.numel():
            assert copies[name].data_ptr() != live.data_ptr(), name
