"""What the sequential rounds of the cost step save: ``measure_costs`` on one torchvision
model's captured graph (inference, batch 8, 224 px, no cache), with each op's rounds ending
once its formats are apart or tied (as the planner measures) and with every op timed for all
``--rounds`` rounds (the same code, the stop left out), and the sequential way again (the A/A
control), in turn in one process, the order rotating. The first set runs while oneDNN still
builds its kernels, so it is printed but left out of the ratios.

    python benchmarks/measure_rounds.py resnet18 resnet50 [--sets 3] [--rounds 5]
"""

import argparse
import statistics
import time

import torch
import torchvision

import memlayout.plan.costs.measure as costs
from memlayout.plan.capture.regions import capture
from memlayout.timing import interleaved


def fixed(fns, **kwargs):
    """``interleaved`` with no early stop: every round runs."""
    kwargs.pop("stop", None)
    return interleaved(fns, **kwargs)


def per_set(top: list[float], bottom: list[float]) -> str:
    return ", ".join(f"{a / b:.2f}" for a, b in zip(top, bottom, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| model | costs timed | sequential, s (median) | every round, s (median) | "
          "sequential / every round, per set | A/A: sequential / sequential again, per set |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        model = torchvision.models.get_model(name).eval()
        x = torch.randn(8, 3, 224, 224)
        gm = capture(model, (x,)).regions[0].gm
        ways = ["sequential", "fixed", "again"]
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        timed = 0
        for i in range(args.sets + 1):
            for way in ways[i % 3:] + ways[:i % 3]:
                costs.interleaved = fixed if way == "fixed" else interleaved
                start = time.perf_counter()
                timed = costs.measure_costs(gm, (x,), rounds=args.rounds).measured
                seconds[way].append(time.perf_counter() - start)
            print(f"{name} set {i}{' (warm-up)' if i == 0 else ''}: " + ", ".join(
                f"{way} {seconds[way][-1]:.2f} s" for way in ways), flush=True)
        seq, fix, again = (seconds[way][1:] for way in ways)
        print(f"| {name} | {timed} | {statistics.median(seq):.2f} | {statistics.median(fix):.2f}"
              f" | {per_set(seq, fix)} | {per_set(seq, again)} |", flush=True)
    costs.interleaved = interleaved


if __name__ == "__main__":
    main()
