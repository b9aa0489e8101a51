#!/usr/bin/env bash
# The layout comparison on a CUDA GPU, once, into one folder: eager NCHW, eager channels-last,
# memlayout's plan, torch.compile, memlayout.compile and TensorRT (torch_tensorrt, where
# installed), in fp32, fp16 and bf16, interleaved in one process per model (docs/bench/gpu_compare.py);
# then `memlayout bench` on the same models (FLOP/s, fraction of the GEMM peak, peak memory).
# Not needed by CI. Run from the repository root:
#
#   docs/bench/gpu.sh                        # writes gpu-results/<UTC time>/
#   OUT=somewhere docs/bench/gpu.sh --rounds 7
#   docs/bench/gpu.sh --device cpu --smoke   # a tiny model on the CPU: does the script work
#
# Extra arguments go to gpu_compare.py (--models, --dtypes, --batch, --image-size, --rounds,
# --modes, --compile-backend). With --smoke the `memlayout bench` step is skipped.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}"
python="${PYTHON:-python}"
mkdir -p "$out"
{ date -u; uname -a; nvidia-smi 2>&1 || echo "no nvidia-smi"; } > "$out/machine.txt"
"$python" "$here/gpu_compare.py" --out "$out/compare" "$@"
case " $* " in
  *" --smoke "*) ;;
  *)
    "$python" -m memlayout.cli bench torchvision:resnet50 torchvision:mobilenet_v2 \
      --device cuda --modes nchw,nhwc,planned,compile,planned+compile --dtype fp32,bf16 \
      --task infer --batch 32 --rounds 15 --out "$out/bench" ;;
esac
echo "results in $out"
