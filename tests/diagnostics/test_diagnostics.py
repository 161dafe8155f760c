"""diagnose() end to end on planted models: tiny gradients, a huge activation, and a model it must not change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.diagnostics import Report, diagnose
from mixprec.diagnostics.hooks import hooks_left


class TinyGrads(nn.Module):
    """A regression whose loss is multiplied by 1e-9: every gradient is ~1e-10..1e-9, below fp16's 2^-24."""

    def __init__(self, loss_mult: float = 1e-9) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.loss_mult = loss_mult

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.body(x), y) * self.loss_mult}


class Amplify(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e6  # |x| > 0.066 becomes > 65504: inf in fp16, fine in bf16


class HugeActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), Amplify(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.encoder(x)
        return nn.functional.mse_loss(out, y), out


def _batches(n: int, d_in: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, d_in, generator=g), "y": torch.randn(8, 1, generator=g)} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny() -> tuple[TinyGrads, list[dict[str, torch.Tensor]], Report]:
    torch.manual_seed(0)
    model = TinyGrads()
    batches = _batches(3, 16)
    return model, batches, diagnose(model, batches)


def test_tiny_gradients_underflow_fp16_not_bf16(tiny) -> None:
    _, _, report = tiny
    linears = [s for s in report.layers if s.type == "Linear"]
    assert len(linears) == 2
    for s in linears:
        assert s.grad_underflow_fp16 > 0.99, s  # nearly every nonzero gradient is below 2^-24 at scale 1
        assert s.weight_grad_underflow_fp16 > 0.99
        assert s.grad_underflow_bf16 == 0.0  # bf16 reaches 2^-133
        assert s.grad_underflow_fp16_scaled < 0.01  # the recommended scale rescues (nearly) all of them
    assert report.summary["grad_underflow_fp16"] > 0.99
    assert report.recommended_init_scale == 2.0**24  # gradients ~1e-9: the scale hits its cap
    assert report.recommended_precision == "fp16"
    assert report.first_nonfinite is None


def _grads(model: nn.Module, batches, *, scale: float, fp16: bool) -> list[torch.Tensor]:
    """Plain torch, no mixprec: (scaled) backward under fp16 autocast, then divide the gradients."""
    for p in model.parameters():
        p.grad = None
    for b in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(**b)["loss"]
        (loss * scale).backward()
    out = [p.grad / scale for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def test_recommended_scale_makes_fp16_gradients_match_fp32(tiny) -> None:
    model, batches, report = tiny
    ref = _grads(model, batches, scale=1.0, fp16=False)
    unscaled = _grads(model, batches, scale=1.0, fp16=True)
    scaled = _grads(model, batches, scale=report.recommended_init_scale, fp16=True)
    for r, u, s in zip(ref, unscaled, scaled):
        assert r.abs().max() > 0
        assert torch.count_nonzero(u) == 0  # fp16 without a scale: every gradient flushed to zero
        # Tolerance: per tensor, every element within 1% of that tensor's largest fp32 gradient (fp16 keeps
        # 11 significant bits; measured worst case ~0.4%). Elementwise rtol alone would fail on the few
        # gradients that land in fp16's subnormal range even after scaling.
        torch.testing.assert_close(s, r, rtol=1e-2, atol=1e-2 * r.abs().max().item())


def test_huge_activation_is_fp16_overflow_and_first_nonfinite() -> None:
    torch.manual_seed(0)
    model = HugeActivation()
    batches = _batches(2, 8)
    report = diagnose(model, batches, precision_target="fp16")
    by_name = {s.name: s for s in report.layers}
    assert by_name["encoder.1"].act_overflow_fp16 > 0.5
    assert by_name["encoder.1"].act_overflow_bf16 == 0.0
    assert by_name["encoder.0"].act_overflow_fp16 == 0.0  # the Linear before it is innocent
    assert report.worst_layers(1)[0].act_overflow_fp16 > 0
    fn = report.first_nonfinite
    assert fn is not None
    assert (fn.module, fn.phase, fn.dtype) == ("encoder.1", "forward", "float16")
    assert report.recommended_precision == "bf16"  # CPU runs bf16, and bf16's range holds 1e6
    assert any("65504" in r and "encoder" in r for r in report.reasons)
    assert report.nonfinite_checks["bf16"] is None

    under_bf16 = diagnose(model, batches, precision_target="bf16")
    assert under_bf16.first_nonfinite is None
    assert under_bf16.recommended_precision == "bf16"


class Normed(HugeActivation):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def test_a_bf16_model_diagnosed_for_fp16_names_the_parameter_and_the_fix() -> None:
    # torch's "mixed dtype (CPU): expect parameter to have scalar type of Float" came out of the fp16 search
    model = Normed().to(torch.bfloat16)
    batches = [{k: v.to(torch.bfloat16) for k, v in b.items()} for b in _batches(2, 8)]
    with pytest.raises(ValueError, match=r"^diagnose\(\): parameter 'encoder.0.weight' is bfloat16 and precision"):
        diagnose(model, batches, precision_target="fp16")


class Stateful(nn.Module):
    """BatchNorm (running stats), dropout (RNG), a frozen parameter, mixed train/eval submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(12, 1)
        self.frozen = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, fail: bool = False) -> torch.Tensor:
        if fail:
            raise RuntimeError("planted failure")
        h = self.drop(torch.relu(self.bn(self.inp(x))))
        return nn.functional.mse_loss(self.out(h) * self.frozen, y)


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},  # the objects themselves
        "grad_values": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def test_diagnosis_leaves_the_model_untouched() -> None:
    torch.manual_seed(0)
    model = Stateful()
    batches = _batches(3, 6)
    model(**batches[0]).backward()  # pre-existing accumulated gradients...
    model.out.bias.grad = None  # ...and one parameter without a gradient
    model.eval()
    model.drop.train()  # submodules in different modes must each get their own mode back

    def user_hook(module, args, output):
        return None

    handle = model.inp.register_forward_hook(user_hook)
    before = _snapshot(model)

    report = diagnose(model, batches)
    assert report.layers  # it did run

    after = _snapshot(model)
    for n, p in before["params"].items():
        assert torch.equal(p.view(torch.int32), after["params"][n].view(torch.int32)), n  # bit-identical
    for n, g in before["grads"].items():
        assert after["grads"][n] is g, n  # same object, None stays None
        if g is not None:
            assert torch.equal(after["grad_values"][n], before["grad_values"][n]), n
    assert after["requires_grad"] == before["requires_grad"]
    for n, b in before["buffers"].items():
        assert torch.equal(b, after["buffers"][n]), n  # BatchNorm running stats restored
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])  # dropout draws did not shift the user's RNG stream
    # only the user's own hook remains
    assert list(model.inp._forward_hooks.values()) == [user_hook]
    handle.remove()
    assert hooks_left(model) == []
    assert all(not p._backward_hooks for p in model.parameters())


def test_failure_mid_diagnosis_still_removes_hooks_and_restores_modes() -> None:
    model = Stateful().eval()
    batches = _batches(2, 6)
    batches[1]["fail"] = True
    with pytest.raises(RuntimeError, match="planted failure"):
        diagnose(model, batches)
    assert hooks_left(model) == []
    assert all(not p._backward_hooks for p in model.parameters())
    assert not any(m.training for m in model.modules())


def test_to_dict_is_json_and_has_the_documented_fields(tiny) -> None:
    _, _, report = tiny
    d = json.loads(json.dumps(report.to_dict(histograms=True)))
    for key in ("layers", "recommended_precision", "recommended_init_scale", "reasons", "first_nonfinite"):
        assert key in d
    layer = next(x for x in d["layers"] if x["name"] == "body.0")
    for key in (
        "grad_underflow_fp16",
        "grad_subnormal_fp16",
        "act_overflow_fp16",
        "grad_underflow_bf16",
        "grad_subnormal_bf16",
        "act_overflow_bf16",
        "grad_underflow_fp16_scaled",
        "grad_subnormal_fp16_scaled",
        "bf16_update_lost",
    ):
        assert key in layer
    assert sum(layer["histograms"]["weight_grad"]["counts"]) > 0
    assert d["first_nonfinite"] is None
    assert all(isinstance(r, str) and r for r in d["reasons"])


def test_table_lists_worst_layers_first(tiny) -> None:
    _, _, report = tiny
    text = report.table(top=2)
    assert "recommended precision: fp16" in text
    rows = [line for line in text.splitlines() if line.startswith("body")]
    assert len(rows) == 2
    assert "3 more not shown" in text


def test_plot_writes_a_png(tiny, tmp_path) -> None:
    _, _, report = tiny
    path = report.plot(str(tmp_path / "hist.png"))
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_is_titled_with_the_recommendation(tiny, tmp_path, monkeypatch) -> None:
    """The figure's title is the report's verdict, not the last panel's name (a loop variable shadowed it)."""
    import matplotlib.figure

    titles = []
    save = matplotlib.figure.Figure.savefig

    def saving(fig, *args, **kwargs):
        titles.append(fig.get_suptitle())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", saving)
    _, _, report = tiny
    report.plot(str(tmp_path / "hist.png"))
    assert titles and titles[0].startswith(f"recommended: {report.recommended_precision}, initial loss scale 2^")


def test_bad_arguments_are_refused_by_name() -> None:
    model = TinyGrads()
    with pytest.raises(ValueError, match="fp17"):
        diagnose(model, _batches(1, 16), precision_target="fp17")
    with pytest.raises(ValueError, match="at least one batch"):
        diagnose(model, [])
    with pytest.raises(ValueError, match="optimizer"):
        diagnose(model, _batches(1, 16), optimizer="lion")
    with pytest.raises(ValueError, match="max_batches"):
        diagnose(model, _batches(1, 16), max_batches=0)
    with pytest.raises(ValueError, match="model is on cpu"):
        diagnose(model, _batches(1, 16), device="meta")


def test_hf_style_model_and_ambient_autocast(tiny_lm, batches) -> None:
    # an output object with .loss and .logits, as HF models return; the fp32 pass must stay fp32 even when
    # diagnose is called inside someone's autocast block
    with torch.no_grad():
        expected = [tiny_lm(**b).loss.item() for b in batches[:2]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = diagnose(tiny_lm, batches, max_batches=2)
    assert report.batches == 2
    assert report.losses["fp32"] == pytest.approx(expected, rel=1e-6)
    assert report.losses["fp16"] == pytest.approx(expected, rel=2e-2)  # the non-finite search ran in fp16
    names = {s.name for s in report.layers}
    assert {"embed", "hidden", "head", "<model>"} <= names
    head = next(s for s in report.layers if s.name == "head")
    assert head.params == 32 * 16 + 16 and head.act_max > 0 and head.grad_max > 0


@pytest.mark.gpu
def test_planted_overflow_on_cuda() -> None:
    torch.manual_seed(0)
    model = HugeActivation().cuda()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.cuda.get_rng_state()
    report = diagnose(model, [{k: v.cuda() for k, v in b.items()} for b in _batches(2, 8)])
    fn = report.first_nonfinite
    assert (fn.module, fn.phase, fn.dtype) == ("encoder.1", "forward", "float16")
    assert report.recommended_precision == ("bf16" if report.bf16_supported else "fp32")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert hooks_left(model) == []
