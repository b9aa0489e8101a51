"""Does storing the model channels-last before ``torch.compile`` close the backend's gap to
``memlayout.optimize``'s eager plan in training? Dynamo hands the backend the parameters in
their stored format, so a plan that runs a 3x3 weight channels-last converts it (and its
gradient back) on every step, and plans around that cost; ``optimize`` holds its weights in
the plan's format. One training step per mode, as ``memlayout bench`` prepares it,
interleaved rounds:

    python benchmarks/backend/stored_channels_last.py benchmarks/real_models.py:smp_unet bf16 7

Modes: the eager plan (``planned``) and a second copy of it (the A/A control), and the
backend (``compile-memlayout``) on the model stored NCHW and stored channels-last (the input
NCHW for both, as the bench gives it). Each ratio is the median of per-round ratios, the
eager plan's time over the mode's (> 1: the mode is faster), with the spread of the rounds;
then what the backend ran.
"""

import copy
import statistics
import sys

import torch

from memlayout.bench.modes import prepare_mode
from memlayout.models import load_model
from memlayout.timing import interleaved, round_ratios


def main(spec: str, dtype: str, rounds: int) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    loaded = load_model(spec, batch=8)
    module, x = loaded.module, loaded.example_input
    stored_cl = copy.deepcopy(module).to(memory_format=torch.channels_last)
    modes = {
        "planned": ("planned", module),
        "planned-again": ("planned", module),
        "backend, stored NCHW": ("compile-memlayout", module),
        "backend, stored channels-last": ("compile-memlayout", stored_cl),
    }
    prepared = {}
    for name, (mode, model) in modes.items():
        prepared[name] = prepare_mode(mode, model, x, dtype=dtype, task="train")
        print(f"{name}: first call {prepared[name].first_call_s:.1f} s; {prepared[name].note}",
              flush=True)
    times = interleaved({name: p.step for name, p in prepared.items()}, rounds=rounds, warmup=1)
    for name in prepared:
        r = round_ratios(times["planned"].times, times[name].times)
        print(f"{spec} {dtype} {name:30s} planned/this {statistics.median(r):.3f} "
              f"({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
