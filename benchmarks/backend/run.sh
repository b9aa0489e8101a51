#!/usr/bin/env bash
# torch.compile(model, backend="memlayout") against torch.compile (Inductor's own layouts), eager
# NCHW / NHWC and the eager plan, with the A/A control (nhwc-again): inference and training,
# fp32 and bf16, interleaved in one process per case, on this CPU. Then the bars:
#   python benchmarks/backend/bars.py OUT/zoo/results.json OUT/real/results.json
# Usage: bash benchmarks/backend/run.sh [OUT]   (--resume: a stopped run goes on where it stopped)
#
# Compile time: each case's compile and compile-memlayout records hold the first call
# (compile, and for the backend its planning: cost measurement, verification, the guard's
# timing) as first_call_s. The first run measures into a fresh cost cache; the second run
# (cached/) repeats the zoo's resnet18 and mobilenet_v2 with the costs and Inductor's FX graph
# cache warm: its first_call_s is the cached compile time of both.
set -euo pipefail
out=${1:-benchmarks/results/backend}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OMP_WAIT_POLICY=PASSIVE
export MEMLAYOUT_CACHE_DIR=${MEMLAYOUT_CACHE_DIR:-${TMPDIR:-/tmp}/memlayout-backend-bars-cache}
modes=nchw,nhwc,nhwc-again,planned,compile,compile-memlayout
common=(--modes "$modes" --dtype fp32,bf16 --task infer,train --rounds 7 --threads 2 --resume)

# the classification zoo (17 torchvision models), batch 8 at 224 px (inception_v3 299)
memlayout bench --zoo classification --batch 8 "${common[@]}" --out "$out/zoo"

# four real models at their usual sizes (benchmarks/real_models.py, random weights): timm's
# mobilevitv2 (attention between convolutions), diffusers' DDPM UNet (attention, a timestep
# input), smp's UNet (resnet34 encoder) and MONAI's 3-d UNet (3-d convolutions, which
# Inductor's layout rule leaves as traced); each brings its own batch and size
memlayout bench "$here/real_models.py:mobilevitv2" "$here/real_models.py:ddpm_unet" \
  "$here/real_models.py:smp_unet" "$here/real_models.py:monai_unet3d" "${common[@]}" \
  --out "$out/real"

# compile time with everything cached (costs, guard decisions, Inductor's FX graph cache)
memlayout bench torchvision:resnet18 torchvision:mobilenet_v2 --batch 8 \
  --modes nchw,compile,compile-memlayout --dtype fp32 --task infer,train --rounds 3 --threads 2 \
  --out "$out/cached"
