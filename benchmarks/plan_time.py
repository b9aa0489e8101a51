"""How long ``memlayout.optimize`` takes to plan a model: its first plan with an empty cost
cache, then a plan of the same model in a new process with that cache warm. Each run is a
fresh process (a new ``MEMLAYOUT_CACHE_DIR`` for the first); it prints the seconds of the
``optimize`` call and the plan's price line (capture, costs, solve, guard, verify).

    python benchmarks/plan_time.py benchmarks/real_models.py:smp_unet \\
        benchmarks/real_models.py:ddpm_unet benchmarks/real_models.py:yolov8n

A file spec builds its own example at its usual size; ``torchvision:NAME`` takes ``--batch``
and ``--size``.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def plan_once(spec: str, batch: int, size: int | None) -> None:
    """One ``optimize`` of ``spec`` in this process; prints its seconds and price."""
    import torch

    import memlayout
    from memlayout.models import load_model
    from memlayout.plan.report.describe import price_summary

    torch.set_num_threads(2)
    built = load_model(spec, batch=batch, image_size=size)
    start = time.perf_counter()
    planned = memlayout.optimize(built.module, built.example_input, kwargs=built.example_kwargs)
    seconds = time.perf_counter() - start
    plan = memlayout.plan_of(planned)
    print(f"{spec}: optimize {seconds:.1f} s", flush=True)
    print(plan.headline(), flush=True)
    if plan.price is not None:
        print(price_summary(plan.price), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.once:
        plan_once(args.specs[0], args.batch, args.size)
        return
    rows = []
    for spec in args.specs:
        costs = tempfile.mkdtemp(prefix="plan-costs-")
        seconds = []
        for _ in ("fresh", "cached"):
            out = subprocess.run(
                [sys.executable, __file__, spec, "--once", "--batch", str(args.batch),
                 *(["--size", str(args.size)] if args.size else [])],
                env={**os.environ, "MEMLAYOUT_CACHE_DIR": costs}, capture_output=True,
                text=True, check=True).stdout
            print(out.strip(), flush=True)
            seconds.append(float(re.search(r"optimize ([\d.]+) s", out).group(1)))  # type: ignore[union-attr]
        rows.append((spec, *seconds))
    print("\n| model | first plan | cost cache warm |\n|---|---|---|")
    for spec, fresh, cached in rows:
        print(f"| {spec} | {fresh:.1f} s | {cached:.1f} s |")


if __name__ == "__main__":
    main()
