"""planned+compile vs compile from `memlayout bench` results.json files : per model and
dtype the median of per-round ratios compile time / planned+compile time, with the range, and
the geomean. Run: ``.venv/bin/python benchmarks/compile_ratios.py [GLOB]``."""
import glob
import json
import math
import statistics
import sys

DEFAULT = "benchmarks/results/compile-per-model/bench-*.json"

rows = []
for f in sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)):
    by: dict = {}
    with open(f) as fh:
        records = json.load(fh)
    for r in records:
        by.setdefault((r["model"], r["dtype"]), {})[r["mode"]] = r
    for (model, dtype), modes in by.items():
        c, p = modes.get("compile"), modes.get("planned+compile")
        if not (c and p and c["status"] == "ok" and p["status"] == "ok"):
            print(model, dtype, "missing", {k: v["status"] for k, v in modes.items()})
            continue
        ratios = [a / b for a, b in zip(c["round_times_s"], p["round_times_s"], strict=False)]
        rows.append(statistics.median(ratios))
        print(f"{model} {dtype}: planned+compile vs compile {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f}); vs nchw: compile {c['speedup']:.2f}x, "
              f"planned+compile {p['speedup']:.2f}x; note: {p['note']}")
if rows:
    print(f"geomean planned+compile vs compile: "
          f"{math.exp(sum(map(math.log, rows)) / len(rows)):.3f}x over {len(rows)}")
