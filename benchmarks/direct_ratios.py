"""Direct per-round ratios between two modes of a `memlayout bench` results.json.

    python benchmarks/direct_ratios.py benchmarks/results/full/results.json nhwc planned
    python benchmarks/direct_ratios.py benchmarks/results/full/results.json compile planned+compile

For each model x dtype x task: the median (min-max) over rounds of time(A) / time(B), both
from the same interleaved round (> 1: B is faster). The summary's cells are each mode against
NCHW; this compares two modes with each other directly.
"""

import json
import statistics
import sys

path, a, b = sys.argv[1:4]
with open(path) as fh:
    rows = json.load(fh)
by_case: dict[tuple[str, str, str], dict[str, list[float]]] = {}
for r in rows:
    if r["status"] == "ok" and r["round_times_s"]:
        by_case.setdefault((r["model"], r["dtype"], r["task"]), {})[r["mode"]] = r["round_times_s"]
ratios_all = []
for (model, dtype, task), modes in by_case.items():
    if a in modes and b in modes:
        ratios = [x / y for x, y in zip(modes[a], modes[b], strict=False) if y > 0]
        ratios_all.append(statistics.median(ratios))
        print(f"{model.split(':')[-1]:20s} {dtype} {task:5s} {a}/{b} time "
              f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
if ratios_all:
    print(f"geomean of medians: {statistics.geometric_mean(ratios_all):.3f} over {len(ratios_all)} cases")
