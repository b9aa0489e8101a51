#!/usr/bin/env bash
# The layout comparison on one CUDA GPU, in one run of at most 8 minutes, into one folder of 6
# files: eager NCHW, eager channels-last and its A/A control (nhwc-again), memlayout's plan,
# torch.compile and torch.compile with memlayout's backend, training and inference, in bf16,
# fp32 and fp16, on resnet50, convnext_tiny (timm), efficientnet_b0 and a 4-level UNet
# (benchmarks/gpu_compare.py, one process). Needs python3 with torch, torchvision and timm;
# memlayout is taken from this checkout (PYTHONPATH=src), nothing is installed. Not run by CI;
# `--dry-run` is (the same code on the CPU, a tiny model, under a minute).
#
#   benchmarks/gpu.sh                       # writes $OUT, else gpu-results/<UTC time>/
#   benchmarks/gpu.sh --dry-run             # on the CPU: does the script work here
#   benchmarks/gpu.sh --models resnet50 --dtypes fp32,fp16 --budget 300
#
# Arguments go to gpu_compare.py (--budget, --models, --dtypes, --tasks, --rounds, --repeat,
# --warmup, --compile-backend, --dry-run). PYTHON picks the interpreter (default: python3).
#
# What comes out, the table first:
#   01-table.md        a row per case x mode: ms/step, img/s, speedup over eager NCHW (median
#                      and range over rounds), first call (compile) seconds, step peak memory
#   02-results.json    the same records with every round's time
#   03-environment.json  versions, the options, the device's fingerprint (TF32, cuDNN)
#   04-machine.txt     date, uname, nvidia-smi
#   05-log.txt         the run's output (compile warnings included)
#   06-bars.txt        the backend's bars (benchmarks/backend/bars.py): compile-memlayout
#                      against the best other mode and against torch.compile, with the A/A noise
#
# Batches: 224 px classifiers run at 128, the UNet at 256 px at 32 (inference) and 16
# (training): sizes a GPU user runs, where eager kernels outlast their launches (resnet50's
# bf16 training step at 128: ~20 ms of kernels, ~7 ms of Python launching ~700 of them). Per
# mode: 2 warm-up steps, then 10 interleaved rounds of 3 steps.
#
# Time. gpu_compare.py starts no case its forecast puts past --budget (default 420 s; the
# forecast is the longest case of its task so far, training counted as twice inference), and
# builds no mode past it; the skipped ones are rows of their own. A hard stop at LIMIT_S
# (default 465 s) ends the run inside 8 minutes, every finished case kept. Cases go resnet50
# bf16 train, bf16 infer, fp32 train, fp32 infer, then fp16, then the other models (bf16, then
# fp16 and fp32). The estimate per resnet50 case on an H100 with 16 CPU cores, in seconds, from
# the rates below and the usual cold-cache compile times (not yet measured on that machine):
#
#                                        bf16 infer  bf16 train  fp32 infer  fp32 train
#   eager firsts, checks, peak memory         5           5           5          10
#   planned: costs timed per node, guard     15          25          15          35
#   torch.compile (Inductor, cold)           40          80          40          80
#   memlayout backend: costs, planned
#     graph compiled, guard (Inductor's
#     own layout from the FX graph cache)    60         110          60         120
#   timing: 6 modes x 34 steps                2           4           5          30
#   case                                   ~120        ~225        ~125        ~275
#
# Steps: the forward is 4.1 G multiply-adds (8.2 GFLOP) per 224 px image, training ~3x that,
# so 1.05 TFLOP an inference step and 3.2 TFLOP a training step at 128: at ~400 TFLOP/s dense
# bf16 and ~50 TFLOP/s fp32 (TF32) that is 2.6 / 8 ms bf16 and 21 / 63 ms fp32 at peak, taken
# as 2-3x that eager. So bf16 train and bf16 infer (~345 s) fit in 420 s, fp32 train is
# forecast past it and skipped, with every case after it: with imports and CUDA start the run
# takes ~6 minutes. `--dtypes fp32` (or --models, --tasks) runs the next cases in a run of
# their own. Compile time is the unknown: each row's first-call seconds show what it was.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
out="${OUT:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}"
python="${PYTHON:-python3}"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
{ date -u; uname -a; nvidia-smi 2>&1 || echo "no nvidia-smi"; } > "$out/04-machine.txt"
status=0
timeout -k 10 "${LIMIT_S:-465}" "$python" "$here/gpu_compare.py" --out "$out" "$@" 2>&1 \
  | tee "$out/05-log.txt" || status=$?
if [[ -f "$out/02-results.json" ]]; then
  "$python" "$here/backend/bars.py" "$out/02-results.json" > "$out/06-bars.txt" 2>&1 || true
fi
echo "results in $out (exit status $status)"
exit "$status"
