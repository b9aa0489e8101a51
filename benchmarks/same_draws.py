"""What ``same_draws=True`` costs: a training step of a convnet with an element-wise dropout
after every block (the masks on channels-last activations), planned channels-last with masks
drawn in the plan's layout (the default) and with masks drawn as the original draws them
(each dropout on a copy of its activation in NCHW, by PyTorch's own kernel, its result
converted back), interleaved round by round in one process, with an A/A control (a second
copy of the default plan), and the original model (eager NCHW) for what the plan gains.

    python benchmarks/same_draws.py [--rounds 15] [--batch 8] [--size 64] [--blocks 4] [--p 0.1]

Prints the median milliseconds per step of each, the spread over rounds, and the ratio of
each to the default plan per round (median and range).
"""

import argparse
import copy
import statistics

import torch
from torch import nn

import memlayout
from memlayout.machine import cpu_isa, cpu_model
from memlayout.timing import interleaved


def _model(blocks: int, p: float) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = _model(args.blocks, args.p).train()
    x = torch.randn(args.batch, 3, args.size, args.size)
    # analytical costs put every convolution channels-last: the masks are then redrawn
    plan = dict(train=True, measure=False, cache=False, memory=False, padding=False)
    default = memlayout.optimize(model, x, **plan)
    same = memlayout.optimize(model, x, same_draws=True, **plan)
    again = copy.deepcopy(default)

    def step(m: nn.Module):
        def run() -> object:
            m.zero_grad(set_to_none=True)
            loss = m(x).square().mean()
            loss.backward()
            return loss
        return run

    names = {"default": default, "default (A/A)": again, "same_draws": same,
             "eager NCHW": model}
    c = interleaved({n: step(m) for n, m in names.items()}, rounds=args.rounds, warmup=3,
                    baseline="default")
    print(f"{cpu_model()} ({cpu_isa()}); torch {torch.__version__}; {torch.get_num_threads()} threads")
    print(f"batch {args.batch}, {args.size} px, {args.blocks} blocks, dropout p={args.p}; "
          f"redrawn: {same.plan.verification.redrawn}")
    for name in names:
        t = [s * 1e3 for s in c[name].times]
        print(f"{name:14s} {statistics.median(t):8.2f} ms/step ({min(t):.2f}-{max(t):.2f})")
    for name in ("default (A/A)", "same_draws", "eager NCHW"):
        r = [a / b for a, b in zip(c[name].times, c["default"].times, strict=True)]
        print(f"{name} / default: median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) "
              f"over {args.rounds} rounds")


if __name__ == "__main__":
    main()
