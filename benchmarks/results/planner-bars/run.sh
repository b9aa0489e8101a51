#!/usr/bin/env bash
# The planner bars on every classification model in one configuration: eager NCHW, eager
# NHWC and planned (input_format="auto": each mode gets its input in its own format, converted
# outside the timed call), fp32 and bf16, inference and training, batch 8, 2 threads, a
# steady glibc heap, 11 interleaved rounds. Read the bars with
#   python benchmarks/bars.py benchmarks/results/planner-bars/results.json
# Usage: bash benchmarks/results/planner-bars/run.sh [OUT]   (about 1.5 h on the 2-core dev machine;
# --resume: a stopped run goes on where it stopped)
set -euo pipefail
out=${1:-benchmarks/results/planner-bars}
export MEMLAYOUT_CACHE_DIR=${MEMLAYOUT_CACHE_DIR:-${TMPDIR:-/tmp}/memlayout-planner-bars-cache}
memlayout bench --zoo classification --dtype fp32,bf16 --task infer,train \
  --modes nchw,nhwc,planned --rounds 11 --threads 2 --steady-heap --out "$out" --resume
