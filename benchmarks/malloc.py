"""glibc's default heap vs ``memlayout.malloc.steady_heap()``: step time and page faults.

    python benchmarks/malloc.py [--rounds 3] [--steps 5] [--threads 2] [CASE ...]

A CASE is ``model:dtype:task:layout`` (torchvision model, fp32|bf16, infer|train, nchw|nhwc);
default: a few that allocate heavily. The heap setting lasts for a whole process, so the two
cannot share one: each round starts one child process per setting, in alternating order
(default first, then steady first, ...). A child builds the model (batch 8, 224x224), makes 3
untimed steps (the steady heap settles in the first few) and times ``--steps`` more; it reports
the median step time, the minor page faults per step and its peak resident memory
(``getrusage``). Printed per case: the median over rounds of the per-round ratio default /
steady (> 1: the steady heap is faster) with its range, the faults per step and the peak
resident memory under each setting.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = ("alexnet:bf16:infer:nhwc", "resnet50:bf16:infer:nhwc", "resnet18:fp32:train:nhwc",
         "resnet50:bf16:train:nhwc")


def child(case: str, steps: int, threads: int, steady: bool) -> None:
    import torch
    import torchvision

    from memlayout import malloc

    if steady:
        malloc.steady_heap()
    torch.set_num_threads(threads)
    name, dtype, task, layout = case.split(":")
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().train(task == "train").to(memory_format=fmt)
    x = torch.randn(8, 3, 224, 224).contiguous(memory_format=fmt)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bf16" else None

    def step() -> None:
        if task == "infer":
            with torch.no_grad(), (ctx() if ctx else torch.enable_grad()):
                model(x)
            return
        sgd.zero_grad(set_to_none=True)
        with ctx() if ctx else torch.enable_grad():
            y = model(x)
        y.float().square().mean().backward()
        sgd.step()

    for _ in range(3):
        step()
    times, faults = [], []
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"median_s": statistics.median(times), "faults": statistics.median(faults),
                      "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "malloc": malloc.describe()}))


def run(case: str, steps: int, threads: int, steady: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", case, "--steps", str(steps),
                          "--threads", str(threads), *(["--steady"] if steady else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child")
    parser.add_argument("--steady", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.threads, args.steady)
        return
    for case in args.cases:
        ratios, faults, rss = [], {False: [], True: []}, {False: [], True: []}
        for r in range(args.rounds):
            got = {}
            for steady in ((False, True) if r % 2 == 0 else (True, False)):
                got[steady] = run(case, args.steps, args.threads, steady)
                faults[steady].append(got[steady]["faults"])
                rss[steady].append(got[steady]["max_rss_mb"])
            ratios.append(got[False]["median_s"] / got[True]["median_s"])
        print(f"{case:28s} default/steady time {statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}), {args.rounds} rounds; minor faults per "
              f"step: default {statistics.median(faults[False]):.0f}, "
              f"steady {statistics.median(faults[True]):.0f}; peak resident MB: default "
              f"{max(rss[False]):.0f}, steady {max(rss[True]):.0f}", flush=True)


if __name__ == "__main__":
    main()
