"""First calls of ``torch.compile(model)`` and ``torch.compile(model, backend="memlayout")``,
each in a fresh process with new, empty caches (Inductor's and memlayout's cost cache), then
the backend again with its cost cache warm from that run (Inductor's cache new again), case
by case, the order of the two backends alternating between cases.

    python benchmarks/backend/first_calls.py resnet18:infer resnet18:train [--batch 8]
        [--size 224] [--dtype fp32] [--again] [--calls N]

Prints each run's seconds and price line, and a table: per case the backend's first call over
torch.compile's, fresh and with the cost cache warm. ``--again``: each fresh process then
compiles the model a second time after ``torch._dynamo.reset()`` (every cache warm, in memory
and on disk), and the table gives that first call too. ``--calls N``: each fresh process
then times its next N calls together (the backend's guard races on a graph's calls), and the
table gives the first call with them.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("first_call.py")


def run(backend: str, model: str, task: str, args: argparse.Namespace, caches: str,
        costs: str | None = None, again: bool = False, calls: int = 0
        ) -> tuple[float, float | None, float | None]:
    """The first call's seconds, with ``again`` the second compile's first call's, and with
    ``calls`` the next ``calls`` calls' together."""
    cmd = [sys.executable, str(SCRIPT), backend, model, args.dtype, "--task", task,
           "--batch", str(args.batch), "--size", str(args.size), "--fresh", "--caches", caches,
           *(["--costs", costs] if costs else []), *(["--again"] if again else []),
           "--calls", str(calls)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    print(out.strip(), flush=True)
    first = re.search(r"first call ([\d.]+) s", out)
    second = re.search(r"first call again, after torch._dynamo.reset\(\) ([\d.]+) s", out)
    more = re.search(r"then \d+ calls ([\d.]+) s", out)
    return (float(first.group(1)), float(second.group(1)) if second else None,  # type: ignore[union-attr]
            float(more.group(1)) if more else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="MODEL:TASK, TASK infer or train; MODEL a "
                    "torchvision name or a spec (benchmarks/real_models.py:smp_unet)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--again", action="store_true",
                    help="each fresh process compiles again after torch._dynamo.reset()")
    ap.add_argument("--calls", type=int, default=0,
                    help="each fresh process then times its next N calls together")
    args = ap.parse_args()
    rows = []
    for i, case in enumerate(args.cases):
        model, task = case.rsplit(":", 1)
        caches = tempfile.mkdtemp(prefix="first-call-")
        costs = tempfile.mkdtemp(prefix="costs-", dir=caches)
        seconds: dict[str, Any] = {}
        order = ("inductor", "memlayout") if i % 2 == 0 else ("memlayout", "inductor")
        for backend in order:
            seconds[backend], seconds[backend + " again"], seconds[backend + " calls"] = run(
                backend, model, task, args, caches, costs if backend == "memlayout" else None,
                again=args.again, calls=args.calls)
        seconds["warm"] = run("memlayout", model, task, args, caches, costs)[0]
        rows.append((case, seconds))
    again = " torch.compile again | backend again | ratio |" if args.again else ""
    calls = (f" torch.compile, first call and {args.calls} more | backend, the same | ratio |"
             if args.calls else "")
    print(f"\n| case (batch {args.batch}, {args.size} px, {args.dtype}) | torch.compile | "
          f"backend, fresh | ratio | backend, cost cache warm | ratio |{again}{calls}")
    print("|---|---|---|---|---|---|" + "---|---|---|" * (bool(again) + bool(calls)))
    for case, s in rows:
        line = (f"| {case} | {s['inductor']:.1f} s | {s['memlayout']:.1f} s | "
                f"{s['memlayout'] / s['inductor']:.2f}x | {s['warm']:.1f} s | "
                f"{s['warm'] / s['inductor']:.2f}x |")
        if again:
            a, b = s["inductor again"], s["memlayout again"]
            line += f" {a:.1f} s | {b:.1f} s | {b / a:.2f}x |"
        if calls:
            a, b = (s["inductor"] + s["inductor calls"], s["memlayout"] + s["memlayout calls"])
            line += f" {a:.1f} s | {b:.1f} s | {b / a:.2f}x |"
        print(line)


if __name__ == "__main__":
    main()
