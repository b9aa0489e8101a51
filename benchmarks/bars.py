"""The planner's speed bars, read from a `memlayout bench` results.json.

    python benchmarks/bars.py benchmarks/results/full/results.json
    python benchmarks/bars.py RUN1/results.json RUN2/results.json   # rounds pooled

Every ratio is taken within one round of one run; several files (runs of the same settings)
pool their per-round ratios, so a case's median rests on all their rounds.

Every ratio is a median over rounds of per-round time ratios, both times from the same
interleaved round (> 1: the second-named mode is faster):

- inference: planned vs the faster eager mode (the one with the lower median time),
  bar >= 0.98; and planned vs eager NHWC wherever eager NHWC is slower than eager NCHW (> 1).
- training: planned vs the faster eager mode, bar >= 0.98.
- planned+compile vs compile, inference: bar >= 0.98 on every model, geomean > 1.
- the peers, inference: memlayout's best ``planned*`` mode (the one with the lower median
  time) vs the fastest other mode (eager NCHW / NHWC, ``compile``, ``openvino``,
  ``onnxruntime``: the lowest median), bar >= 0.95, in every model x dtype where a peer
  runtime ran.

A case whose planned (or planned+compile) record is missing or failed is listed as such.
Where the planned model *is* an eager one (the guard kept it, or the plan runs every layout
node in one format with no conversion), column "plan is" says which: there the ratio compares
a model with itself and shows the machine's round-to-round noise, not the planner. A run
with the `nhwc-again` control mode (a second copy of eager NHWC) prints that noise directly:
column "A/A" is nhwc vs its copy, which is 1 up to noise.
"""

import json
import re
import statistics
import sys

_HEADLINE = re.compile(r"plan: (\d+)/(\d+) layout nodes channels_last, (\d+) conversions")


def plan_is(note: str) -> str:
    """"nhwc" / "nchw" when the planned record's headline shows an eager model, else ""."""
    for kept, mode in (("all_channels_last", "nhwc"), ("all_contiguous", "nchw")):
        if f"guard kept {kept}" in note or f"the plan is {kept}" in note:
            return mode
    m = _HEADLINE.search(note)
    if m and m.group(3) == "0":
        cl, total = int(m.group(1)), int(m.group(2))
        return "nhwc" if cl == total else "nchw" if cl == 0 else ""
    return ""


class Case:
    """One model x dtype x task: per run (file), the round times of each mode that ran."""

    def __init__(self) -> None:
        self.runs: list[dict[str, list[float]]] = []

    def keys(self) -> set[str]:
        return {m for run in self.runs for m in run}

    def __contains__(self, mode: str) -> bool:
        return mode in self.keys()

    def median_time(self, mode: str) -> float:
        return statistics.median(x for run in self.runs for x in run.get(mode, []))


def ratio(case: Case, a: str, b: str) -> tuple[float, float, float]:
    """Median, min and max over rounds (of every run where both ran) of time(a) / time(b)."""
    r = [x / y for run in case.runs if a in run and b in run
         for x, y in zip(run[a], run[b], strict=False) if y > 0]
    return statistics.median(r), min(r), max(r)


def main(paths: list[str]) -> None:
    cases: dict[tuple[str, str, str], Case] = {}
    notes: dict[tuple[str, str, str], str] = {}
    for path in paths:
        with open(path) as fh:
            rows = json.load(fh)
        fresh: set[tuple[str, str, str]] = set()
        for r in rows:
            key = (r["model"].split(":")[-1], r["dtype"], r["task"])
            case = cases.setdefault(key, Case())
            if key not in fresh:
                case.runs.append({})
                fresh.add(key)
            if r["status"] == "ok" and r["round_times_s"]:
                case.runs[-1][r["mode"]] = r["round_times_s"]
                if r["mode"] == "planned":
                    notes.setdefault(key, r.get("note", ""))
    below: list[str] = []
    compiled: list[float] = []
    planned: dict[str, list[float]] = {}
    control: list[float] = []
    print(f"{'model':20s} {'dtype':5s} {'task':5s} {'faster eager':12s} {'plan is':7s} "
          f"{'planned vs it':22s} {'planned+compile vs compile':26s} A/A")
    for (model, dtype, task), t in cases.items():
        if not {"nchw", "nhwc"} <= t.keys():
            print(f"{model:20s} {dtype:5s} {task:5s} eager modes missing")
            continue
        fast = min(("nchw", "nhwc"), key=t.median_time)
        cells = [f"{fast:12s}", f"{plan_is(notes.get((model, dtype, task), '')):7s}"]
        if "planned" in t:
            m, lo, hi = ratio(t, fast, "planned")
            planned.setdefault(task, []).append(m)
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
        if {"nhwc", "nhwc-again"} <= t.keys():
            m, lo, hi = ratio(t, "nhwc", "nhwc-again")
            control.append(m)
            cells.append(f"{'':26s} {m:.3f} ({lo:.2f}-{hi:.2f})" if len(cells) == 3 else
                         f"{m:.3f} ({lo:.2f}-{hi:.2f})")
        print(f"{model:20s} {dtype:5s} {task:5s} " + " ".join(cells))
    for task, ms in planned.items():
        print(f"planned vs the faster eager mode, {task}: geomean "
              f"{statistics.geometric_mean(ms):.3f} over {len(ms)} cases, "
              f"{sum(m >= 0.98 for m in ms)} at or above 0.98")
    if control:
        print(f"A/A control, nhwc vs a second copy of it: medians {min(control):.3f}-"
              f"{max(control):.3f} over {len(control)} cases, "
              f"{sum(m < 0.98 for m in control)} below 0.98")
    if compiled:
        print(f"planned+compile vs compile, inference: geomean {statistics.geometric_mean(compiled):.3f}"
              f" over {len(compiled)} cases")
    peers(cases, below)
    print(f"{len(below)} below a bar" + (":" if below else ""))
    for line in below:
        print(f"  {line}")


RUNTIMES = ("openvino", "onnxruntime")
OURS = ("planned", "planned+compile")
PEER_BAR = 0.95


def peers(cases: dict[tuple[str, str, str], Case], below: list[str]) -> None:
    """memlayout's best planned mode against the fastest other mode, per inference case
    where a peer runtime ran."""
    rows = []
    for (model, dtype, task), t in cases.items():
        theirs = sorted(t.keys() - {*OURS, "nhwc-again"})
        ours = [m for m in OURS if m in t]
        if task != "infer" or not ours or not any(m in t for m in RUNTIMES):
            continue
        peer = min(theirs, key=t.median_time)
        best = min(ours, key=t.median_time)
        m, lo, hi = ratio(t, peer, best)
        rows.append(m)
        flag = " BELOW" if m < PEER_BAR else ""
        print(f"{model:20s} {dtype:5s} {task:5s} {best} vs the fastest other mode, {peer}: "
              f"{m:.3f} ({lo:.2f}-{hi:.2f}){flag}")
        if m < PEER_BAR:
            below.append(f"{model} {dtype} infer {best} vs {peer} {m:.3f}")
    if rows:
        print(f"memlayout's best vs the fastest other mode, inference: geomean "
              f"{statistics.geometric_mean(rows):.3f} over {len(rows)} cases, "
              f"{sum(m >= PEER_BAR for m in rows)} at or above {PEER_BAR}")


if __name__ == "__main__":
    main(sys.argv[1:])
