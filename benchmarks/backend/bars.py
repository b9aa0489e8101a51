"""The backend's bars, read from `memlayout bench` results.json files (benchmarks/backend/run.sh)
or from benchmarks/gpu.sh's 02-results.json.

    python benchmarks/backend/bars.py benchmarks/results/backend/zoo/results.json benchmarks/results/backend/real/results.json

Per model x dtype x task, every ratio a median over rounds of per-round time ratios (both times
from the same interleaved round; > 1: compile-memlayout is faster):

- compile-memlayout vs the best of eager NHWC, the eager plan (``planned``) and
  ``torch.compile`` (the one with the lowest median time): bar >= 0.98 on every case;
- compile-memlayout vs ``torch.compile``: the geomean, and the cases where it wins by more
  than the run's noise (the A/A control, nhwc vs nhwc-again, of the same case), with the
  record's note (the backend's report: the convolutions that differ from Inductor's rule);
- compile time: the first call of ``compile`` and of ``compile-memlayout`` (plan + compile).
"""

import json
import statistics
import sys

BAR = 0.98
OURS = "compile-memlayout"
PEERS = ("nhwc", "planned", "compile")


def main(paths: list[str]) -> None:
    cases: dict[tuple[str, str, str], dict[str, dict]] = {}
    for path in paths:
        with open(path) as fh:
            for r in json.load(fh):
                if r["status"] == "ok" and r["round_times_s"]:
                    key = (r["model"].split(":")[-1], r["dtype"], r["task"])
                    cases.setdefault(key, {})[r["mode"]] = r
    best_ratios, compile_ratios, below, wins = [], [], [], []
    print(f"{'model':24s} {'dtype':5s} {'task':5s} {'best other':10s} {'ours vs it':20s} "
          f"{'ours vs compile':20s} {'A/A':18s} compile s (ours / torch.compile)")
    for (model, dtype, task), modes in cases.items():
        if OURS not in modes:
            print(f"{model:24s} {dtype:5s} {task:5s} {OURS} missing")
            continue
        peers = [m for m in PEERS if m in modes]
        best = min(peers, key=lambda m: statistics.median(modes[m]["round_times_s"]))
        m, lo, hi = _ratio(modes[best], modes[OURS])
        best_ratios.append(m)
        cells = [f"{best:10s}", f"{m:.3f} ({lo:.2f}-{hi:.2f})" + (" BELOW" if m < BAR else "")]
        if m < BAR:
            below.append(f"{model} {dtype} {task}: {OURS} vs {best} {m:.3f}")
        noise = None
        if "compile" in modes:
            c, clo, chi = _ratio(modes["compile"], modes[OURS])
            compile_ratios.append(c)
            cells.append(f"{c:.3f} ({clo:.2f}-{chi:.2f})")
        if {"nhwc", "nhwc-again"} <= modes.keys():
            a, alo, ahi = _ratio(modes["nhwc"], modes["nhwc-again"])
            noise = max(abs(alo - 1), abs(ahi - 1), abs(a - 1))
            cells.append(f"{a:.3f} ({alo:.2f}-{ahi:.2f})")
        if "compile" in modes and noise is not None and c - 1 > noise:
            wins.append(f"{model} {dtype} {task}: {c:.3f} vs torch.compile (noise {noise:.3f}); "
                        f"{modes[OURS].get('note', '')}")
        first = [modes[x].get("first_call_s") for x in (OURS, "compile")]
        cells.append(" / ".join("-" if s is None else f"{s:.1f}" for s in first))
        print(f"{model:24s} {dtype:5s} {task:5s} " + " ".join(cells))
    if best_ratios:
        print(f"{OURS} vs the best of {', '.join(PEERS)}: geomean "
              f"{statistics.geometric_mean(best_ratios):.3f} over {len(best_ratios)} cases, "
              f"{sum(m >= BAR for m in best_ratios)} at or above {BAR}")
    if compile_ratios:
        print(f"{OURS} vs torch.compile: geomean {statistics.geometric_mean(compile_ratios):.3f} "
              f"over {len(compile_ratios)} cases")
    print(f"{len(wins)} cases faster than torch.compile by more than the A/A noise" +
          (":" if wins else ""))
    for line in wins:
        print(f"  {line}")
    print(f"{len(below)} below the bar" + (":" if below else ""))
    for line in below:
        print(f"  {line}")


def _ratio(a: dict, b: dict) -> tuple[float, float, float]:
    """Median, min and max over rounds of time(a) / time(b)."""
    r = [x / y for x, y in zip(a["round_times_s"], b["round_times_s"], strict=False) if y > 0]
    return statistics.median(r), min(r), max(r)


if __name__ == "__main__":
    main(sys.argv[1:])
