"""Per-op-kind policies ("bf16:fp32_ops=attention"): the kinds named run in fp32, the rest as autocast runs
them, and the policy can be named at every level (issue 23)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.models import GPT, GPTConfig
from mixprec.precision.op_policy import OP_KINDS
from mixprec.precision.registry import canonical_name, resolve_precision


class _KernelDtypes(TorchDispatchMode):
    """The dtype of the first input of each aten kernel that runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None:
            self.seen.setdefault(func.overloadpacket.__name__, set()).add(first.dtype)
        return func(*args, **(kwargs or {}))

    def kernels(self, needle: str) -> set[torch.dtype]:
        return set().union(*(d for name, d in self.seen.items() if needle in name))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))


def _step_kernels(precision) -> _KernelDtypes:
    model = _gpt()
    ids = torch.randint(0, 64, (2, 16))
    with _KernelDtypes() as rec:
        with precision.autocast():
            loss = model(ids, labels=ids).loss
        loss.backward()
    return rec


def test_attention_runs_in_fp32_while_matmuls_run_in_bf16():
    rec = _step_kernels(resolve_precision("bf16:fp32_ops=attention", "cpu"))
    # forward and backward attention kernels (flash / math, whichever torch picks) see only fp32
    attention = rec.kernels("scaled_dot_product")
    assert attention and attention == {torch.float32}
    assert torch.bfloat16 in rec.kernels("addmm") | rec.kernels("mm")  # the linears stay bf16
    # and plain bf16 really runs attention in bf16, so the policy is what changed it
    assert rec_bf16_attention() == {torch.bfloat16}


def rec_bf16_attention() -> set[torch.dtype]:
    return _step_kernels(resolve_precision("bf16", "cpu")).kernels("scaled_dot_product")


def test_fp32_kinds_leave_autocast_outside_unchanged():
    p = resolve_precision("bf16:fp32_ops=linear", "cpu")
    lin = torch.nn.Linear(8, 4)
    with p.autocast():
        assert lin(torch.ones(2, 8)).dtype == torch.float32  # linear held in fp32
        q = torch.randn(1, 2, 4, 8)
        assert F.scaled_dot_product_attention(q, q, q).dtype == torch.bfloat16  # attention: autocast's
    assert not torch.is_autocast_enabled("cpu")


def test_policy_loss_matches_fp32_within_bf16_tolerance():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = _gpt()(ids, labels=ids).loss
    with resolve_precision("bf16:fp32_ops=attention,norm,softmax", "cpu").autocast():
        got = _gpt()(ids, labels=ids).loss
    assert got.item() == pytest.approx(ref.item(), rel=2e-2)  # bf16 matmuls: 8 mantissa bits


def test_describe_lists_every_op_kind():
    d = resolve_precision("bf16:fp32_ops=attention", "cpu").describe()
    assert set(d["op_dtypes"]) == set(OP_KINDS)
    assert d["op_dtypes"]["attention"] == "fp32 (policy)"
    assert d["op_dtypes"]["linear"].startswith("bfloat16")
    assert d["fp32_ops"] == ["attention"]


def test_the_spelling_is_canonical():
    assert canonical_name(" BF16-mixed:fp32_ops=Norm, attention ") == "bf16:fp32_ops=attention,norm"
    assert canonical_name("bf16:fp32_ops=all") == "bf16:fp32_ops=" + ",".join(OP_KINDS)


@pytest.mark.parametrize(
    "make",
    [
        lambda: canonical_name("bf16:fp32_ops=attn"),
        lambda: mixprec.Accelerator(mixed_precision="bf16", fp32_ops=["attn"], cpu=True, verbose=False),
        lambda: mixprec.TrainingArguments(output_dir="unused", precision="bf16", fp32_ops=["attn"]),
        lambda: mixprec.autocast("bf16", fp32_ops="attn"),
    ],
)
def test_an_unknown_op_kind_is_one_line_listing_the_kinds(make):
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    assert "\n" not in msg and "'attn'" in msg and ", ".join(OP_KINDS) in msg


def test_fp32_ops_need_an_autocast_mode():
    with pytest.raises(ValueError, match=r"Accelerator\(fp32_ops=.*precision='bf16' or 'fp16'"):
        mixprec.Accelerator(mixed_precision="fp32", fp32_ops=["attention"], cpu=True, verbose=False)


def test_every_level_names_the_same_policy():
    acc = mixprec.Accelerator(mixed_precision="bf16", fp32_ops=["attention"], cpu=True, verbose=False)
    assert acc.mixed_precision == "bf16:fp32_ops=attention"
    args = mixprec.TrainingArguments(output_dir="unused", bf16=True, fp32_ops="attention")
    assert args.precision == "bf16:fp32_ops=attention" and args.bf16 and not args.fp16


def test_public_autocast_applies_the_policy():
    q = torch.randn(1, 2, 4, 8)
    lin = torch.nn.Linear(8, 8)
    with mixprec.autocast("bf16", device_type="cpu", fp32_ops=["attention"]):
        assert F.scaled_dot_product_attention(q, q, q).dtype == torch.float32
        assert lin(q).dtype == torch.bfloat16
    with mixprec.autocast(resolve_precision("fp16", "cpu")):
        assert lin(q).dtype == torch.float16
    with pytest.raises(ValueError, match="auto"):
        mixprec.autocast("auto")


def test_a_prepared_model_runs_the_policy_in_its_forward():
    # the Accelerator's prepared forward enters the strategy's autocast: attention fp32, matmuls bf16
    acc = mixprec.Accelerator(mixed_precision="bf16", fp32_ops=["attention"], cpu=True, verbose=False)
    model = _gpt()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 64, (2, 16))
    with _KernelDtypes() as rec:
        acc.backward(model(ids, labels=ids).loss)
    opt.step()
    assert rec.kernels("scaled_dot_product") == {torch.float32}
    assert torch.bfloat16 in rec.kernels("addmm") | rec.kernels("mm")


def test_activation_checkpointing_is_refused_in_one_line_with_the_fix():
    # torch's recompute does not see the policy's regions (a known limit): said by name, not a metadata dump
    p = resolve_precision("bf16:fp32_ops=attention", "cpu")
    model = _gpt()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 16))
    with p.autocast():
        loss = model(ids, labels=ids).loss
    with pytest.raises(
        RuntimeError, match=r"checkpointing: the recompute .* checkpointing off or use precision='bf16'"
    ):
        p.backward(loss)


def test_a_policy_says_up_front_that_it_cannot_train_with_activation_checkpointing():
    # the same fact, asked before training: by a strategy, and of a name at the edge (TrainingArguments, the CLI)
    from mixprec.precision.registry import recompute_refusal

    assert "use precision='bf16'" in resolve_precision("bf16:fp32_ops=attention", "cpu").recompute_refusal
    assert "use precision='fp16'" in recompute_refusal("fp16:fp32_ops=softmax")
    assert [recompute_refusal(n) for n in ("fp32", "bf16", "fp16", "bf16-pure", "auto")] == [""] * 5


def test_a_model_with_checkpointing_on_is_seen_by_either_hf_flag_without_a_deprecation_warning():
    # what auto asks before timing op kinds and what prepare asks before a policy: HF 5 models answer
    # is_activation_checkpointing, and their old is_gradient_checkpointing warns; mixprec's GPT has the old one
    import warnings

    from mixprec.precision.policy import recomputes_activations

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    hf = transformers.GPT2LMHeadModel(config)
    gpt = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert not recomputes_activations(hf) and not recomputes_activations(gpt)
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable()
        gpt.gradient_checkpointing_enable()
        wrapper = torch.nn.Module()
        wrapper.module = hf  # as DDP holds it
        assert recomputes_activations(hf) and recomputes_activations(wrapper) and recomputes_activations(gpt)
