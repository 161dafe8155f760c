#!/usr/bin/env bash
# Issue 28's GPU run, prepared for a session that is lent the device (one call, under 10 minutes).
#
# 1. On the session's own machine, the inputs the device cannot fetch (git ignores them; `carry` takes them):
#      fetch github:karpathy/nanoGPT                  (the tool; the mirror lands in /work/.mirror/...)
#      bash benchmarks/gpu_session.sh prepare /work/.mirror/karpathy+nanoGPT/repo
#    nanoGPT's model.py, bf16-pure's optimizer as it was before issue 28 (for the before/after step), and the
#    torchao 0.18 wheel (the device image has torch, transformers, accelerate and peft, not torchao).
# 2. The device call:
#      run(command="bash benchmarks/gpu_session.sh run", carry=[".whl", ".gpu_inputs"], timeout_s=600)
#    Figures come back under $OUT: summary.json (the goals), one JSON per section, gpu_tests.xml.
set -euo pipefail
BASE_REV=2252916  # the main this work started from: Bf16AdamW's per-parameter loop

case "${1:-run}" in
prepare)
  nanogpt_repo=${2:?"give the nanoGPT git mirror (fetch github:karpathy/nanoGPT first)"}
  mkdir -p .gpu_inputs/nanogpt .gpu_inputs/bf16_before .whl
  git -C "$nanogpt_repo" show HEAD:model.py > .gpu_inputs/nanogpt/model.py
  for f in bf16_adamw noise kahan; do
    git show "$BASE_REV:src/mixprec/optim/$f.py" > ".gpu_inputs/bf16_before/$f.py"
  done
  python -m pip download "torchao==0.18.0" --no-deps -d .whl -q
  ls -l .gpu_inputs/nanogpt .gpu_inputs/bf16_before .whl
  ;;
run)
  python -m pip install --no-deps -q .whl/torchao-*.whl || echo "gpu_session: no torchao wheel; the fp8 rows will fail"
  export PYTHONPATH="$PWD/src:$PWD"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -m benchmarks.gpu_suite --plan issue28 --out "${OUT:-gpu_out}" --nanogpt .gpu_inputs/nanogpt \
    --baseline .gpu_inputs/bf16_before --time-limit 540
  ;;
*)
  echo "usage: bash benchmarks/gpu_session.sh prepare NANOGPT_MIRROR | run" >&2
  exit 2
  ;;
esac
