#!/usr/bin/env bash
# The layout comparison on a CUDA GPU, once, into one folder: eager NCHW, eager channels-last,
# memlayout's plan, torch.compile, memlayout.compile and TensorRT (torch_tensorrt, where
# installed), in fp32, fp16 and bf16, interleaved in one process per model (docs/bench/gpu_compare.py);
# then `memlayout bench` on the same models (FLOP/s, fraction of the GEMM peak, peak memory);
# then the torch.compile backend against torch.compile, training and inference, fp32 and bf16,
# with the A/A control (nhwc-again): CUDA training is where Inductor's layout rule was tuned.
# Not needed by CI. Run from the repository root:
#
#   docs/bench/gpu.sh                        # writes gpu-results/<UTC time>/
#   OUT=somewhere docs/bench/gpu.sh --rounds 7
#   docs/bench/gpu.sh --device cpu --smoke   # a tiny model on the CPU: does the script work
#
# Extra arguments go to gpu_compare.py (--models, --dtypes, --batch, --image-size, --rounds,
# --modes, --compile-backend). With --smoke the `memlayout bench` step is skipped and the
# backend comparison runs on the CPU on gpu_compare.py's tiny model, its graphs run eagerly.
# STEPS=compare,bench,backend (the default) picks the steps: STEPS=backend reruns that one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}"
python="${PYTHON:-python}"
mkdir -p "$out"
{ date -u; uname -a; nvidia-smi 2>&1 || echo "no nvidia-smi"; } > "$out/machine.txt"
steps=",${STEPS:-compare,bench,backend},"
if [[ $steps == *,compare,* ]]; then
  "$python" "$here/gpu_compare.py" --out "$out/compare" "$@"
fi
backend_modes=nchw,nhwc,nhwc-again,planned,compile,compile-memlayout
case " $* " in
  *" --smoke "*)
    if [[ $steps == *,backend,* ]]; then
      "$python" -m memlayout.cli bench "$here/gpu_compare.py:tiny" --device cpu \
        --modes "$backend_modes" --dtype fp32 --task train,infer --batch 2 --image-size 16 \
        --rounds 2 --gemm-size 64 --compile-backend eager --plan-costs analytic \
        --out "$out/backend"
    fi ;;
  *)
    if [[ $steps == *,bench,* ]]; then
      "$python" -m memlayout.cli bench torchvision:resnet50 torchvision:mobilenet_v2 \
        --device cuda --modes nchw,nhwc,planned,compile,planned+compile --dtype fp32,bf16 \
        --task infer --batch 32 --rounds 15 --out "$out/bench"
    fi
    if [[ $steps == *,backend,* ]]; then
      "$python" -m memlayout.cli bench torchvision:resnet50 torchvision:mobilenet_v2 \
        torchvision:efficientnet_b0 torchvision:convnext_tiny \
        "$here/real_models.py:smp_unet" "$here/real_models.py:ddpm_unet" \
        --device cuda --modes "$backend_modes" --dtype fp32,bf16 --task train,infer \
        --batch 32 --rounds 15 --out "$out/backend"
      "$python" "$here/backend/bars.py" "$out/backend/results.json" > "$out/backend/bars.txt"
    fi ;;
esac
echo "results in $out"
