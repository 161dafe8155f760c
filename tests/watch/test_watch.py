"""mixprec.watch piece by piece: settings, headroom readings, trends, the fp32 fallback, skip attribution in
a hand-written Accelerator loop, and that watching changes nothing about the run it watches."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import Accelerator, TrainingArguments
from mixprec.diagnostics.histogram import DeviceHistogram, to_host
from mixprec.diagnostics.hooks import hooks_left
from mixprec.precision.formats import BF16, FP16
from mixprec.watch import PrecisionWatch, WatchConfig, fp32_modules, restore, run_in_fp32
from mixprec.watch.headroom import Sample
from mixprec.watch.trend import TrendWatch, fit_slope

# -- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "every", "fallback"),
    [
        (5, 5, False),
        ("7", 7, False),
        ("watch", 100, False),
        ("fallback", 100, True),
        ("fallback:3", 3, True),
        ({"every": 4, "fallback": True}, 4, True),
    ],
)
def test_every_way_to_ask_for_a_watch_parses_to_one_config(value, every, fallback):
    config = WatchConfig.parse(value)
    assert (config.every, config.fallback) == (every, fallback)


@pytest.mark.parametrize("value", [None, False, 0, "off"])
def test_the_watch_is_off_by_default_and_when_turned_off(value):
    assert WatchConfig.parse(value) is None
    assert Accelerator(watch=value, verbose=False).watch is None


def test_a_bad_setting_names_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"TrainingArguments\(precision_watch='often'\).*'fallback:N'"):
        TrainingArguments(precision_watch="often")
    with pytest.raises(ValueError, match=r"Accelerator\(watch=\.\.\.\): the interval must be >= 1"):
        Accelerator(watch=-2, verbose=False)
    with pytest.raises(ValueError, match="unknown setting.*evry"):
        WatchConfig.parse({"evry": 3})


# -- headroom ----------------------------------------------------------------------------------------------


def _host(t: torch.Tensor, track_overflow: bool = True):
    h = DeviceHistogram(torch.device("cpu"), track_overflow=track_overflow)
    h.add(t)
    return to_host([h])[0]


def test_headroom_counts_binades_to_the_max_and_to_the_smallest_normal():
    t = torch.tensor([2.0**10, -(2.0**-3), 2.0**-2, 1.0] * 25)
    h = _host(t)
    assert h.overflow_headroom(FP16) == pytest.approx(math.log2(65504) - 10)
    assert h.underflow_headroom(FP16) == -3 - (-14)  # smallest significant value 2^-3, min normal 2^-14
    assert h.overflow_headroom(BF16) > 100


def test_headroom_is_negative_beyond_the_format_and_zero_with_infs():
    assert _host(torch.tensor([2.0**20])).overflow_headroom(FP16) == pytest.approx(math.log2(65504) - 20)
    assert _host(torch.tensor([1.0, float("inf")], dtype=torch.float16)).overflow_headroom(FP16) == 0.0


def test_a_tail_below_one_percent_is_not_the_significant_minimum():
    t = torch.cat([torch.full((999,), 0.5), torch.tensor([2.0**-30])])
    h = _host(t, track_overflow=False)
    assert h.underflow_headroom(FP16) == -1 + 14
    assert h.outside_normal_fraction(FP16) == pytest.approx(1e-3)


# -- trend -------------------------------------------------------------------------------------------------


def _sample(step: int, headroom: float, skipped: bool = False) -> Sample:
    from mixprec.watch.headroom import LayerReading

    r = LayerReading("fc", 1.0, headroom, 5, 0.0, 0.0, None, None, None, 0.0)
    return Sample(step, 1.0, "fp16", [r], skipped)


def test_a_shrinking_headroom_is_warned_once_with_the_steps_left():
    assert fit_slope([(0, 10.0), (10, 8.0), (20, 6.0)]) == pytest.approx(-0.2)
    trend = TrendWatch(horizon=30, warn_headroom=1.0, points=3)
    assert trend.update(_sample(10, 12.0)) == [] and trend.update(_sample(20, 10.0)) == []
    assert trend.update(_sample(30, 8.0)) == []  # 40 steps left: beyond the horizon
    (w,) = trend.update(_sample(40, 6.0))  # 0.2 binades/step: 30 steps left
    assert (w.layer, w.steps_left, w.step) == ("fc", 30, 40)
    assert trend.update(_sample(50, 4.0)) == []  # once per layer


def test_a_flat_headroom_warns_only_when_it_is_nearly_gone_and_skipped_steps_are_ignored():
    trend = TrendWatch(horizon=30, warn_headroom=1.0, points=3)
    assert all(trend.update(_sample(s, 3.0)) == [] for s in (10, 20, 30))
    assert trend.update(_sample(40, 0.0, skipped=True)) == []
    (w,) = trend.update(_sample(50, 0.5))
    assert w.headroom == 0.5 and w.step == 50
    (w,) = TrendWatch(horizon=30, warn_headroom=1.0, points=3).update(_sample(10, 0.5))
    assert w.steps_left is None  # one sample: no trend, only the headroom itself


# -- fp32 fallback -----------------------------------------------------------------------------------------


def test_a_fallen_back_module_computes_in_fp32_under_fp16_autocast():
    torch.manual_seed(0)
    fc = nn.Linear(8, 8)
    x = torch.randn(4, 8) * 3000
    with torch.autocast("cpu", dtype=torch.float16):
        assert fc(x).dtype == torch.float16
        run_in_fp32(fc)
        out = fc(x.half())  # an fp16 input is cast up, too
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.half().float(), fc.weight, fc.bias))
    restore(fc)
    with torch.autocast("cpu", dtype=torch.float16):
        assert fc(x).dtype == torch.float16
    assert "forward" not in fc.__dict__


def test_the_fallback_keeps_the_module_as_it_was_and_copies_run_on_their_own():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    keys = list(model.state_dict())
    run_in_fp32(model[2])
    assert list(model.state_dict()) == keys and fp32_modules(model) == ["2"]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.zero_()
        twin[2].bias.zero_()
    with torch.autocast("cpu", dtype=torch.float16):
        assert twin(torch.ones(1, 4)).abs().sum() == 0  # the copy's forward runs the copy's weights
        assert model(torch.ones(1, 4)).dtype == torch.float32


# -- the watch in a hand-written Accelerator loop -----------------------------------------------------------


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.fc2(self.drop(torch.relu(self.fc1(x)))).float().squeeze(-1), y)}


def _loop(watch, steps: int = 6, init_scale: float = 2.0**10):
    torch.manual_seed(0)
    model = DropoutNet()
    acc = Accelerator(mixed_precision="fp16", scaler_kwargs={"init_scale": init_scale}, watch=watch, verbose=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, generator=g)}
        acc.backward(model(**batch)["loss"])
        opt.step()
        opt.zero_grad()
        torch.rand(3)  # the random stream moves on between steps (a shuffling sampler, augmentation...)
    if acc.watch is not None:
        acc.watch.close()
    model.next_random = torch.rand(1).item()  # where the global random stream stands after the run
    return acc, model


def test_watching_changes_nothing_in_the_run_it_watches():
    # every step sampled, and the first ones skipped (a loss scale fp16 gradients cannot hold) and replayed
    _, plain = _loop(None, init_scale=2.0**24)
    acc, watched = _loop(PrecisionWatch(every=1), init_scale=2.0**24)
    assert acc.scaler.record.skipped_steps >= 1 and len(acc.watch.skips) == acc.scaler.record.skipped_steps
    for p, q in zip(plain.parameters(), watched.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert watched.next_random == plain.next_random  # the replays drew their dropout masks on a side stream


def test_a_gradient_overflow_is_traced_to_backward_and_does_not_fall_back():
    acc, model = _loop(PrecisionWatch(every=2, fallback=True, fallback_after=1), init_scale=2.0**24)
    first = acc.watch.skips[0]
    assert first.phase == "backward" and first.method == "replay" and first.module in {"fc1", "fc2", "drop"}
    assert acc.watch.fallbacks == [] and fp32_modules(model) == []
    assert acc.watch.summary()["samples"] == 3


def test_the_watch_hooks_only_sampled_steps_and_nothing_when_off():
    acc, model = _loop(PrecisionWatch(every=1000), steps=3)
    assert hooks_left(model) == ["<model>"]  # the one pre-hook that follows the steps
    acc.watch.detach()
    assert hooks_left(model) == []
    _, plain = _loop(None, steps=2)
    assert hooks_left(plain) == []


def test_the_fallback_list_is_saved_and_restored_with_the_accelerator_state(tmp_path):
    acc, model = _loop(PrecisionWatch(every=5), steps=1)
    acc.watch.fall_back("fc2", step=1, reason="test")
    acc.save_state(tmp_path / "ckpt")
    acc2, model2 = _loop(PrecisionWatch(every=5), steps=0)
    acc2.load_state(tmp_path / "ckpt")
    assert fp32_modules(model2) == ["fc2"]
    assert [f["module"] for f in acc2.watch.fallbacks] == ["fc2"]


def test_the_trainer_sends_the_samples_to_tensorboard_and_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mixprec import Trainer

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "y": torch.randn((), generator=g)} for _ in range(32)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        max_steps=4,
        per_device_train_batch_size=8,
        precision_watch=2,
        report_to="tensorboard",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=2,
    )
    torch.manual_seed(0)
    Trainer(DropoutNet(), args, train_dataset=data).train()
    events = EventAccumulator(args.logging_dir)
    events.Reload()
    assert {"train/watch/fc1/act_headroom", "train/watch/fc2/grad_low_headroom"} <= set(events.Tags()["scalars"])
    samples = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in samples if "watch/fc1/act_max" in e] == [2, 4]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["precision_watch"]["samples"] == 2
    assert (tmp_path / "precision_headroom.png").read_bytes()[:4] == b"\x89PNG"


def test_a_subset_histogram_keeps_the_exact_maximum_and_every_inf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=g) * 2.0 ** torch.randint(-30, 10, (1 << 18,), generator=g)
    x[12345] = 3.0e5  # the maximum, most likely outside a 1-in-4 strided subset
    exact = _host(x)
    (subset,) = to_host([_subset_add(x)])
    assert subset.max_abs == exact.max_abs and subset.total < exact.total
    assert subset.outside_normal_fraction(FP16) == pytest.approx(exact.outside_normal_fraction(FP16), abs=0.01)
    x[777] = float("inf")
    (with_inf,) = to_host([_subset_add(x)])
    assert with_inf.nonfinite >= 1 and with_inf.overflow_headroom(FP16) <= 0.0


def _subset_add(x: torch.Tensor) -> DeviceHistogram:
    h = DeviceHistogram(torch.device("cpu"), bin_limit=2**16)
    h.add(x)
    return h


class Overflows(nn.Module):
    """fc2's fp16 output overflows from the first step (a weight too large for fp16 products)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc2.weight.mul_(1e6)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": self.norm(self.fc2(self.fc1(x))).float().pow(2).mean()}


def test_after_k_skips_traced_to_a_forward_the_module_falls_back_without_a_warning():
    torch.manual_seed(0)
    acc = Accelerator(
        mixed_precision="fp16", watch={"every": 1000, "fallback": True, "fallback_after": 2}, verbose=False
    )
    model = Overflows()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    for _ in range(4):
        acc.backward(model(x=torch.randn(4, 8))["loss"])
        opt.step()
        opt.zero_grad()
    acc.watch.close()
    assert acc.scaler.record.skipped_steps == 2 and acc.watch.warnings == []
    assert [(f["module"], f["step"]) for f in acc.watch.fallbacks] == [("fc2", 2)]
    assert fp32_modules(model) == ["fc2"]


def test_positional_batches_are_attributed_from_the_gradients_when_synced_before_zero_grad():
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp16", watch=5, verbose=False)
    model = Overflows()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8))["loss"])  # positional: the replay needs model(**batch)
    opt.step()
    acc.watch.sync(opt)  # before zero_grad, as the Trainer does
    (att,) = acc.watch.skips
    assert att.method == "gradients" and att.module is None and "fc2" in att.modules
