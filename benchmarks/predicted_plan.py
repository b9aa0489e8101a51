"""Does predicting costs keep the plan's speed? ``optimize(predict=True)`` times only the
layout nodes whose costs could change the minimum cut and predicts the others from this
machine's cached timings; this compares its plan with the plan of every cost measured.

For each model, in one process:

1. a cost cache is filled with this machine's timings of other models (``--seed-with``), as a
   user's cache holds them after planning a few models; the model is then planned with
   ``predict=True`` on that cache (how many nodes it measured, how many it predicted, the
   regret bound);
2. the model is planned again with an empty cache and every cost measured;
3. both plans, and a second copy of the measured one (the A/A control), run interleaved
   round by round; printed: how many layout nodes the two plans put in another format, and
   each one's time per call against the measured plan's, per round (median and range).

The guard and padding are off in both, so that what is compared is the two plans themselves.

    python benchmarks/predicted_plan.py benchmarks/real_models.py:smp_unet \\
        benchmarks/real_models.py:ddpm_unet benchmarks/real_models.py:yolov8n [--rounds 15]
"""

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memlayout
from memlayout.machine import cpu_isa, cpu_model
from memlayout.models import load_model
from memlayout.timing import interleaved, round_ratios

#: what both plans leave out: the guard (it may replace either plan by a one-format model)
#: and padding (a step after the plan)
SAME = dict(guard=False, padding=False)


def _plan(built: Any, cache: Path, **options: Any) -> tuple[nn.Module, float]:
    start = time.perf_counter()
    planned = memlayout.optimize(built.module, built.example_input, kwargs=built.example_kwargs,
                                 cache=str(cache / "costs.sqlite"), **SAME, **options)
    return planned, time.perf_counter() - start


def _formats(planned: nn.Module) -> dict[tuple[str, str], str]:
    return {(n.region, n.name): n.format for n in memlayout.plan_of(planned).nodes}


def compare(spec: str, seeds: list[str], seed_size: int, rounds: int) -> None:
    """Plan ``spec`` both ways and time the two plans interleaved with an A/A control."""
    built = load_model(spec)  # a file spec builds its own example at its usual size
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as empty:
        for seed in seeds:
            other = load_model(seed, batch=2, image_size=seed_size)
            _plan(other, Path(warm))
        predicted, predict_s = _plan(built, Path(warm), predict=True)
        measured, measure_s = _plan(built, Path(empty))
    p, m = memlayout.plan_of(predicted), memlayout.plan_of(measured)
    guess = p.prediction
    want, got = _formats(measured), _formats(predicted)
    differ = sorted(k for k in want if got.get(k) != want[k])
    print(f"{spec}: {len(want)} layout nodes")
    # plan.measured: cost records timed now (nodes of one shape share one); the prediction's
    # counts are layout nodes
    if guess is not None:
        print(f"  predicted plan: {p.measured} costs timed; layout nodes {guess.measured} "
              f"measured, {guess.predicted} predicted, regret bound {guess.regret * 1e3:.3f} ms, "
              f"widths {guess.widths * 1e3:.3f} ms; planned in {predict_s:.1f} s")
    print(f"  measured plan: {m.measured} costs timed; planned in {measure_s:.1f} s")
    print(f"  nodes in another format: {len(differ)}"
          + (f" (first: {differ[0][1]}: measured {want[differ[0]]}, predicted "
             f"{got[differ[0]]})" if differ else ""))

    xs = built.example_input if isinstance(built.example_input, tuple) else (built.example_input,)

    def call(model: nn.Module):
        def run() -> object:
            with torch.no_grad():
                return model(*xs, **built.example_kwargs)
        return run

    runs = {"measured": measured, "measured (A/A)": copy.deepcopy(measured),
            "predicted": predicted}
    c = interleaved({n: call(model) for n, model in runs.items()}, rounds=rounds, warmup=2,
                    baseline="measured")
    for name in runs:
        t = [s * 1e3 for s in c[name].times]
        print(f"  {name:15s} {statistics.median(t):8.2f} ms/call ({min(t):.2f}-{max(t):.2f})")
    for name in ("measured (A/A)", "predicted"):
        r = round_ratios(c[name].times, c["measured"].times)
        print(f"  {name} / measured: median {statistics.median(r):.3f} "
              f"({min(r):.3f}-{max(r):.3f}) over {rounds} rounds", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--seed-with", default="torchvision:resnet18,torchvision:mobilenet_v2",
                    help="models whose timings fill the cache the prediction is fitted to")
    ap.add_argument("--seed-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{cpu_model()} ({cpu_isa().capability}); torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads; cache seeded with {args.seed_with} "
          f"(batch 2, {args.seed_size} px)", flush=True)
    for spec in args.specs:
        compare(spec, args.seed_with.split(","), args.seed_size, args.rounds)


if __name__ == "__main__":
    main()
