"""benchmarks/bench_short_race.py: the Trainer example runs under transformers' own Trainer too (``hf:<mode>``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

# In a process of its own: a transformers Trainer run inside the suite's process left its heap such that a later
# test's planted allocation no longer raised the RSS (tests/trainer/test_trainer_features.py's memory metrics)
_SCRIPT = """
import json, sys, transformers
from benchmarks import bench_short_race
built = []
init = transformers.Trainer.__init__
def recording(self, *args, **kwargs):
    built.append(kwargs["args"])
    init(self, *args, **kwargs)
transformers.Trainer.__init__ = recording
out = bench_short_race.one("hf:fp32", threads=1, steps=2, out_dir=sys.argv[1])
(args,) = built
print(json.dumps({**out, "hf_args": type(args).__module__, "bf16": args.bf16, "max_steps": args.max_steps}))
"""


def test_an_hf_variant_runs_the_example_with_transformers_trainer(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["wall_s"] > 0 and out["chosen"] == "hf:fp32"
    assert out["hf_args"].startswith("transformers.") and out["bf16"] is False and out["max_steps"] == 2
