"""Does the backend's eager plan lose to eager NHWC in training because Dynamo hands it the
weights in their stored (NCHW) format? One training step, interleaved rounds, an A/A control:

    python benchmarks/backend/stored_weights.py mobilenet_v2 11

Modes: eager NHWC (the model stored channels-last, a channels-last input) and a second copy of
it (the A/A control), and ``torch.compile(backend=memlayout.backend(inner="eager",
guard=False))`` (the plan run eagerly) on the model stored NCHW and on it stored channels-last.
Each ratio is the median of per-round ratios, eager NHWC's time over the mode's (> 1: the mode
is faster), with the spread of the rounds.
"""

import copy
import statistics
import sys

import torch
import torchvision

from memlayout.plan.compilers.backend import Backend
from memlayout.timing import interleaved, round_ratios


def main(name: str, rounds: int) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    base = getattr(torchvision.models, name)(num_classes=1000)
    x = torch.randn(8, 3, 224, 224)
    cl = torch.channels_last
    backend = Backend(inner="eager", guard=False)
    models = {
        "nhwc": (copy.deepcopy(base).to(memory_format=cl), x.contiguous(memory_format=cl)),
        "nhwc-again": (copy.deepcopy(base).to(memory_format=cl), x.contiguous(memory_format=cl)),
        "backend, weights NCHW": (torch.compile(copy.deepcopy(base), backend=backend), x),
        "backend, weights NHWC": (torch.compile(copy.deepcopy(base).to(memory_format=cl),
                                                backend=backend), x),
    }

    def step(model: torch.nn.Module, inp: torch.Tensor):
        def run() -> None:
            for p in model.parameters():
                p.grad = None
            model(inp).sum().backward()
        return run

    fns = {mode: step(*pair) for mode, pair in models.items()}
    for fn in fns.values():
        fn()  # compiles and plans
    times = interleaved(fns, rounds=rounds, warmup=1)
    for mode in fns:
        r = round_ratios(times["nhwc"].times, times[mode].times)
        print(f"{name} {mode:22s} median {statistics.median(times[mode].times):.3f} s  "
              f"nhwc/this {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
