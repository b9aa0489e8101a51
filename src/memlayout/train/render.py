"""Terminal rendering of ``memlayout train``: the log line of an interval, the side-by-side
comparison of layouts and the summary of a run. Renderers only read the results."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from memlayout.machine import SPREAD_LIMIT, noisy
from memlayout.train.compare import LayoutComparison, layout_of
from memlayout.train.loop import IntervalLog, TrainResult


def interval_line(event: IntervalLog) -> str:
    """One log line in the shape of torchvision's reference scripts."""
    return (f"[{event.layout}] Epoch: [{event.epoch}][{event.step_in_epoch:>4}/{event.steps_per_epoch}]  "
            f"Time {event.seconds:7.3f} s  Speed {event.images_per_second:8.1f} img/s  "
            f"Loss {event.loss:.4f}  Acc@1 {event.accuracy:6.2f}")


def render_comparison(result: LayoutComparison, layouts: list[str], console: Console, *,
                      batch: int, world_size: int, rounds: int) -> None:
    """images/s per layout and the median per-round ratio of each over the first, with a
    warning beside figures whose rounds spread beyond ``SPREAD_LIMIT``."""
    c = result.comparison
    base = layouts[0]
    table = Table(title=f"images/s per layout, {result.steps_per_interval} steps x {batch} images x "
                        f"{world_size} processes per interval (median of {rounds} interleaved rounds)")
    for col in ("layout", "images/s", "interval s (median)", "spread", f"speed vs {base}", "last loss", "last acc@1"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for name in layouts:
        t = c[name]
        if not t.ok:
            table.add_row(name, "failed", t.error or "", "", "", "", "")
            continue
        span = c.speedup_range(name)
        ratio = (f"{c.speedup(name):.3f}x ({span[0]:.2f}-{span[1]:.2f})"
                 if name != base and span else "1")
        loss, acc = result.final.get(name, (float("nan"), float("nan")))
        table.add_row(name, f"{result.images_per_second(name):.1f}", f"{t.median:.3f}",
                      f"{100 * t.spread:.0f} %", ratio, f"{loss:.4f}", f"{acc:.1f}")
    console.print(table)
    for name in layouts[1:]:
        span = c.speedup_range(name)
        if c[name].ok and c.speedup(name) is not None and span:
            console.print(f"ratio {name}/{base} images/s: {c.speedup(name):.3f}x (median of "
                          f"{len(c.ratios(name))} per-round ratios, range {span[0]:.3f}-{span[1]:.3f})",
                          markup=False, highlight=False)
    for name in layouts:
        first = layout_of(name)
        if name != first and c[name].ok and c[first].ok:
            r = c.ratio(first, name)
            if r is not None:
                console.print(f"A/A control: {name}/{first} images/s {r.median:.3f}x "
                              f"(range {r.min:.3f}-{r.max:.3f}): two copies of one layout, the "
                              "noise of every ratio above", markup=False, highlight=False)
    loose = [name for name in layouts if c[name].ok and noisy(c[name].spread)]
    if loose:
        console.print(f"[yellow]warning[/yellow]: the {', '.join(loose)} rounds spread more than "
                      f"{100 * SPREAD_LIMIT:.0f} %: trust the ratios for their direction only")


def render_run(run: TrainResult, console: Console) -> None:
    """Steps done, images/s over the intervals after the first (warm-up), final loss, and
    where the checkpoint is."""
    later = [i.images_per_second for i in run.intervals[1:]] or [i.images_per_second for i in run.intervals]
    if later:
        console.print(f"{run.step - run.start_step} steps; images/s per interval (all processes, "
                      f"first interval left out as warm-up): median {statistics.median(later):.1f}, "
                      f"range {min(later):.1f}-{max(later):.1f}; final loss {run.intervals[-1].loss:.4f}",
                      markup=False, highlight=False)
    if run.compiled is not None:
        console.print(run.compiled.describe(), markup=False, highlight=False)
    if run.checkpoint:
        console.print(f"checkpoint: {run.checkpoint}", markup=False, highlight=False)
