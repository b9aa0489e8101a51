"""What an ``OptimizedModule`` adds to each call: a tiny model (one 1x1 convolution on a 4x4
map, a few microseconds) timed eager channels-last, planned (``input_format="auto"``, input
already in the plan's format) and the planned module without its wrapper, interleaved.

    python docs/bench/wrapper_overhead.py [--rounds 15] [--calls 2000]

Prints the median microseconds per call and the spread over rounds. The wrapper's work per
call: the shape signature (a plan per input shape), one stride check per input tensor (the
plan's input format), autocast when planned with a dtype.
"""

import argparse
import statistics

import torch
from torch import nn

import memlayout
from memlayout.timing import interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed sample")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 1)).eval()
    x = torch.randn(1, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    opt = memlayout.optimize(model, x, input_format="auto", measure=False, cache=False)
    eager = model.to(memory_format=torch.channels_last)

    def call(f: nn.Module):
        def run() -> object:
            with torch.no_grad():
                return f(x)
        return run

    c = interleaved({"eager": call(eager), "optimized": call(opt), "inner": call(opt.module)},
                    rounds=args.rounds, warmup=200, repeat=args.calls)
    print(f"plan: {opt.plan.headline()}")
    for name in ("eager", "optimized", "inner"):
        t = [s * 1e6 for s in c[name].times]
        print(f"{name:10s} {statistics.median(t):7.1f} us/call ({min(t):.1f}-{max(t):.1f})")
    extra = [(a - b) * 1e6 for a, b in zip(c["optimized"].times, c["eager"].times, strict=True)]
    print(f"optimized - eager: median {statistics.median(extra):.1f} us per call "
          f"({min(extra):.1f}-{max(extra):.1f}) over {args.rounds} rounds")


if __name__ == "__main__":
    main()
