"""What steering adds to each call: a model of 200 modules (100 blocks of a 1x1 convolution
and a ReLU on a 4x4 map, tens of microseconds a call) timed eager channels-last, planned
(``input_format="auto"``, input already in the plan's format: only the root is steered), and
planned with every module steered by a boundary that converts nothing (each input already in
its format: the per-module cost of the mechanism), interleaved round by round in one process,
with an A/A control (a second copy of eager).

    python benchmarks/steer_overhead.py [--rounds 15] [--calls 200] [--blocks 100]

Prints the median microseconds per call, the spread over rounds, and each mode minus eager
(per round, median and range). The root's work per call: the input shape signature (a plan per
input shape), one stride check per input tensor, the output strides; a steered module's: one
dict lookup, one stride check per leaf it would convert.
"""

import argparse
import statistics

import torch
from torch import nn

import memlayout
from memlayout.plan.steer.boundary import Boundary
from memlayout.plan.steer.steering import Steering, steer
from memlayout.timing import interleaved


def _model(blocks: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU()) for _ in range(blocks)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    ap.add_argument("--blocks", type=int, default=100, help="blocks of two modules")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = _model(args.blocks).eval()
    x = torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    planned = memlayout.optimize(model, x, input_format="auto", measure=False, cache=False,
                                 memory=False, padding=False)
    everywhere = memlayout.optimize(model, x, input_format="auto", measure=False, cache=False,
                                    memory=False, padding=False)
    key = everywhere.memlayout.example
    noop = Boundary(inputs=((0, 1, 4),), outputs=((0, 1, 4),))  # converts nothing: already so
    paths = tuple((path, noop) for path, _ in everywhere.named_modules() if path)
    steer(everywhere, Steering(boundaries=paths), key=key, input_label=1, outputs=(), plan=None)
    eager = model.to(memory_format=torch.channels_last)
    again = _model(args.blocks).eval().to(memory_format=torch.channels_last)
    again.load_state_dict(eager.state_dict())
    modules = sum(1 for _ in model.modules()) - 1

    def call(f: nn.Module):
        def run() -> object:
            with torch.no_grad():
                return f(x)
        return run

    c = interleaved({"eager": call(eager), "eager-again": call(again),
                     "planned": call(planned), "all-steered": call(everywhere)},
                    rounds=args.rounds, warmup=20, repeat=args.calls, baseline="eager")
    print(f"{modules} modules; plan: {planned.plan.headline()}; all-steered: {len(paths)} "
          "modules with a boundary")
    for name in ("eager", "eager-again", "planned", "all-steered"):
        t = [s * 1e6 for s in c[name].times]
        print(f"{name:12s} {statistics.median(t):8.1f} us/call ({min(t):.1f}-{max(t):.1f})")
    for name in ("eager-again", "planned", "all-steered"):
        extra = [(a - b) * 1e6 for a, b in zip(c[name].times, c["eager"].times, strict=True)]
        print(f"{name} - eager: median {statistics.median(extra):.1f} us per call "
              f"({min(extra):.1f}-{max(extra):.1f}) over {args.rounds} rounds")


if __name__ == "__main__":
    main()
