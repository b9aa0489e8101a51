#!/usr/bin/env bash
# Inference again, with the A/A control: a second copy of eager NHWC (nhwc-again) timed in the
# same rounds as nchw, nhwc and planned. Where the planned model is eager NHWC itself, planned
# vs nhwc can only be judged against nhwc vs nhwc-again. Read with
#   python benchmarks/bars.py benchmarks/results/planner-bars/control/results.json
set -euo pipefail
out=${1:-benchmarks/results/planner-bars/control}
export MEMLAYOUT_CACHE_DIR=${MEMLAYOUT_CACHE_DIR:-${TMPDIR:-/tmp}/memlayout-planner-bars-cache}
memlayout bench --zoo classification --dtype fp32,bf16 --task infer \
  --modes nchw,nhwc,nhwc-again,planned --rounds 11 --threads 2 --steady-heap --out "$out" --resume
