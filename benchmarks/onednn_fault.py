"""Does this torch still have oneDNN's channels-last fault? A training step of one
convolution, channels-last, per case, each in a process of its own with a time limit (the
fault hangs, crashes the process or returns a wrong weight gradient), the weight gradient
compared with the same step run contiguous:

    python benchmarks/onednn_fault.py [--timeout 30] [--steps 10]

Prints one row per case: in channels, kernel, stride, and what the step did (``ok``,
``WRONG`` with its relative error, ``CRASH`` with the signal, ``HANG``). The cases are the
rule's (``memlayout.plan.costs.faults``): the faulty ones and their neighbours that are not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

#: (in channels, kernel, stride, spatial size): the rule says 1x1, a stride above 1 and
#: fewer than 16 input channels; the others are its neighbours
CASES = [(3, 1, 2, 224), (4, 1, 2, 224), (6, 1, 2, 224), (3, 1, 2, 48), (15, 1, 2, 224),
         (3, 1, (2, 1), 224), (16, 1, 2, 224), (64, 1, 2, 224), (3, 1, 1, 224),
         (3, 3, 2, 224)]

STEP = """
import sys, torch
torch.set_num_threads(2)
cin, k, s, hw, steps = {cin}, {k}, {s!r}, {hw}, {steps}
g = torch.Generator().manual_seed(0)
x = torch.randn(2, cin, hw, hw, generator=g)
w = torch.randn(64, cin, k, k, generator=g)
def grad(fmt):
    xs, ws = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt).requires_grad_()
    out = torch.conv2d(xs, ws, None, s)
    return torch.autograd.grad([out], [ws], [torch.ones_like(out)])[0]
want = grad(torch.contiguous_format)
worst = max(float((grad(torch.channels_last) - want).abs().max() / want.abs().max())
            for _ in range(steps))
print(worst)
"""


def case(cin: int, k: int, s: object, hw: int, *, steps: int, timeout: float) -> str:
    code = STEP.format(cin=cin, k=k, s=s, hw=hw, steps=steps)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"HANG (no answer in {timeout:g} s)"
    if done.returncode:
        return f"CRASH (exit {done.returncode})"
    error = float(done.stdout.strip().splitlines()[-1])
    return f"ok ({error:.1e})" if error < 1e-4 else f"WRONG (relative error {error:.2g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    ap.add_argument("--steps", type=int, default=10, help="channels-last steps per case")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| in channels | kernel | stride | size | channels-last weight gradient |\n|---|---|---|---|---|")
    for cin, k, s, hw in CASES:
        result = case(cin, k, s, hw, steps=args.steps, timeout=args.timeout)
        print(f"| {cin} | {k}x{k} | {s} | {hw} | {result} |", flush=True)


if __name__ == "__main__":
    main()
