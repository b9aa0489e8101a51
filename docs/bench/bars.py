"""The planner issues' speed bars, read from a `memlayout bench` results.json.

    python docs/bench/bars.py docs/bench/full/results.json

Every ratio is a median over rounds of per-round time ratios, both times from the same
interleaved round (> 1: the second-named mode is faster):

- #5, inference: planned vs the faster eager mode (the one with the lower median time),
  bar >= 0.98; and planned vs eager NHWC wherever eager NHWC is slower than eager NCHW (> 1).
- #6, training: planned vs the faster eager mode, bar >= 0.98.
- #6, planned+compile vs compile, inference: bar >= 0.98 on every model, geomean > 1.

A case whose planned (or planned+compile) record is missing or failed is listed as such.
"""

import json
import statistics
import sys


def ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of time(a) / time(b)."""
    r = [x / y for x, y in zip(times[a], times[b], strict=False) if y > 0]
    return statistics.median(r), min(r), max(r)


def main(path: str) -> None:
    with open(path) as fh:
        rows = json.load(fh)
    cases: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for r in rows:
        case = cases.setdefault((r["model"].split(":")[-1], r["dtype"], r["task"]), {})
        if r["status"] == "ok" and r["round_times_s"]:
            case[r["mode"]] = r["round_times_s"]
    below: list[str] = []
    compiled: list[float] = []
    print(f"{'model':20s} {'dtype':5s} {'task':5s} {'faster eager':12s} "
          f"{'planned vs it':22s} {'planned+compile vs compile':26s}")
    for (model, dtype, task), t in cases.items():
        if not {"nchw", "nhwc"} <= t.keys():
            print(f"{model:20s} {dtype:5s} {task:5s} eager modes missing")
            continue
        fast = min(("nchw", "nhwc"), key=lambda m: statistics.median(t[m]))
        cells = [f"{fast:12s}"]
        if "planned" in t:
            m, lo, hi = ratio(t, fast, "planned")
            cells.append(f"{m:.3f} ({lo:.2f}-{hi:.2f})" + (" BELOW" if m < 0.98 else "      "))
            if m < 0.98:
                below.append(f"{model} {dtype} {task} planned vs {fast} {m:.3f}")
            if task == "infer" and fast == "nchw":
                m2, _, _ = ratio(t, "nhwc", "planned")
                if m2 <= 1.0:
                    below.append(f"{model} {dtype} infer planned not faster than the slower "
                                 f"eager NHWC: {m2:.3f}")
        else:
            cells.append(f"{'missing':22s}")
        if task == "infer" and {"compile", "planned+compile"} <= t.keys():
            m, lo, hi = ratio(t, "compile", "planned+compile")
            compiled.append(m)
            cells.append(f"{m:.3f} ({lo:.2f}-{hi:.2f})" + (" BELOW" if m < 0.98 else ""))
            if m < 0.98:
                below.append(f"{model} {dtype} infer planned+compile vs compile {m:.3f}")
        print(f"{model:20s} {dtype:5s} {task:5s} " + " ".join(cells))
    if compiled:
        print(f"planned+compile vs compile, inference: geomean {statistics.geometric_mean(compiled):.3f}"
              f" over {len(compiled)} cases")
    print(f"{len(below)} below a bar" + (":" if below else ""))
    for line in below:
        print(f"  {line}")


if __name__ == "__main__":
    main(sys.argv[1])
