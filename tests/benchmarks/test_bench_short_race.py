"""benchmarks/bench_short_race.py: the Trainer example runs under transformers' own Trainer too (``hf:<mode>``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_short_race  # noqa: E402


def test_an_hf_variant_runs_the_example_with_transformers_trainer(tmp_path, monkeypatch):
    import transformers

    built = []
    init = transformers.Trainer.__init__

    def recording(self, *args, **kwargs):
        built.append(kwargs["args"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "__init__", recording)
    out = bench_short_race.one("hf:fp32", threads=1, steps=2, out_dir=str(tmp_path))
    assert out["wall_s"] > 0 and out["chosen"] == "hf:fp32"
    (args,) = built
    assert isinstance(args, transformers.TrainingArguments) and not args.bf16 and args.max_steps == 2
