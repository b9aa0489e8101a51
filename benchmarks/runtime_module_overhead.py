"""Does calling a runtime through ``memlayout.compile``'s module cost anything? The same
OpenVINO model called through ``RuntimeModule`` (``nn.Module.__call__``, the input-format check)
and bare, alone in one process, timed interleaved; the ratio is bare time / module time per
round (1: no cost).

    python benchmarks/runtime_module_overhead.py --model torchvision:mobilenet_v2 --rounds 31
"""

from __future__ import annotations

import argparse
import statistics

import torch

from memlayout import runtimes
from memlayout.models import load_model
from memlayout.plan.compilers.runtime_model import RuntimeModule
from memlayout.plan.pipeline import optimize
from memlayout.timing import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision:mobilenet_v2")
    parser.add_argument("--runtime", default="openvino")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = load_model(args.model, batch=args.batch, image_size=args.image_size)
    model, x = spec.module.eval(), spec.example_input
    plan = optimize(model, x, measure=False, cache=False, guard=False, memory=False,
                    padding=False, blocked=False).plan
    options = runtimes.RuntimeOptions(args.runtime)
    module = RuntimeModule(model, plan, x, options)
    bare = runtimes.build_runtime(model, x, options)

    def through_module() -> object:
        with torch.no_grad():
            return module(x)
    c = interleaved({"bare": lambda: bare(x), "module": through_module}, rounds=args.rounds,
                    warmup=3, repeat=5)
    r = c.ratios("module")
    print(f"{args.model} {args.runtime}: module {c['module'].median * 1e3:.2f} ms, bare "
          f"{c['bare'].median * 1e3:.2f} ms; bare / module time {statistics.median(r):.3f} "
          f"({min(r):.3f}-{max(r):.3f}) over {args.rounds} rounds")


if __name__ == "__main__":
    main()
