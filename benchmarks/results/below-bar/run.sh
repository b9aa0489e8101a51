#!/usr/bin/env bash
# Re-run of the cases below the planner bars in benchmarks/results/full (and the training cases that
# failed there before the fixes), after: the guard's margin 0 and close-call extension, the
# planned mode's input in the plan's own format (input_format="auto", converted outside the
# timed call as nhwc's is), a steady glibc heap. Fresh cost cache: every cost measured now.
# Usage: bash benchmarks/results/below-bar/run.sh [OUT]   (about 1.5 h on the 2-core dev machine)
set -euo pipefail
out=${1:-benchmarks/results/below-bar}
export MEMLAYOUT_CACHE_DIR=${MEMLAYOUT_CACHE_DIR:-${TMPDIR:-/tmp}/memlayout-below-bar-cache}
cases=(
  "alexnet bf16 infer" "shufflenet_v2_x1_0 bf16 infer" "densenet121 bf16 infer"
  "googlenet bf16 infer" "vgg11_bn bf16 infer" "squeezenet1_0 fp32 infer"
  "densenet121 fp32 infer"
  "resnet18 bf16 train" "resnet50 fp32 train" "vgg11_bn fp32 train" "vgg11_bn bf16 train"
  "densenet121 bf16 train" "googlenet fp32 train" "mobilenet_v2 fp32 train"
  "mobilenet_v2 bf16 train" "mobilenet_v3_large bf16 train" "squeezenet1_0 fp32 train"
  "regnet_y_400mf fp32 train" "efficientnet_b0 bf16 train" "convnext_tiny fp32 train"
  "inception_v3 fp32 train" "inception_v3 bf16 train"
)
for c in "${cases[@]}"; do
  read -r model dtype task <<<"$c"
  memlayout bench "torchvision:$model" --dtype "$dtype" --task "$task" \
    --modes nchw,nhwc,planned --rounds 15 --threads 2 --steady-heap --out "$out" --resume
done
