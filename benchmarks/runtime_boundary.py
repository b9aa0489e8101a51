"""Does exporting a peer runtime's model with an NHWC input pay, for an HWC pipeline?

memlayout.data hands over channels-last batches (HWC memory). A runtime model exported with an
NCHW input must get that batch transposed on every call (the adapter's ``.contiguous()``); one
exported with ``input_layout="nhwc"`` reads the memory as it is (the permute is folded into the
model's first op). Both are fed the same channels-last batch and timed interleaved; the ratio
is NCHW-export time / NHWC-export time per round (> 1: the NHWC export is faster).

    python benchmarks/runtime_boundary.py --model torchvision:resnet18 --batch 2 --image-size 96
"""

from __future__ import annotations

import argparse
import statistics

import torch

from memlayout import runtimes
from memlayout.dtypes import parse_dtype
from memlayout.models import load_model
from memlayout.plan.compare import compare
from memlayout.timing import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision:resnet18")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="openvino:fp32,openvino:bf16,onnxruntime:fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = load_model(args.model, batch=args.batch, image_size=args.image_size)
    model = spec.module.eval()
    hwc_batch = spec.example_input.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = model(spec.example_input)
    fns = {}
    for case in args.cases.split(","):
        name, dtype = case.split(":")
        run_dtype = parse_dtype(dtype, allowed=("fp32", "bf16"))
        for layout in runtimes.INPUT_LAYOUTS:
            rt = runtimes.build_runtime(model, spec.example_input,
                                        runtimes.RuntimeOptions(name, run_dtype, layout))
            ok, worst, _ = compare(want, rt(hwc_batch), run_dtype)
            print(f"{name} {dtype} {layout} export: output vs torch fp32 {worst:.2g} "
                  f"({'within' if ok else 'OUTSIDE'} {dtype} tolerance); {rt.describe()}")
            fns[f"{name} {dtype} {layout}"] = (lambda rt=rt: rt(hwc_batch))
    timing = interleaved(fns, rounds=args.rounds, warmup=2)
    print(f"\n{args.model}, batch {args.batch}, {args.image_size} px, {args.threads} threads, "
          f"{args.rounds} interleaved rounds, channels-last input to every model")
    print("| runtime, dtype | NCHW export ms | NHWC export ms | NCHW / NHWC time, median (min-max) |")
    print("|---|---|---|---|")
    for case in args.cases.split(","):
        name, dtype = case.split(":")
        a, b = timing[f"{name} {dtype} nchw"], timing[f"{name} {dtype} nhwc"]
        ratios = [x / y for x, y in zip(a.times, b.times, strict=True)]
        print(f"| {name} {dtype} | {1e3 * a.median:.2f} | {1e3 * b.median:.2f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
