"""Terminal and JSON rendering of a ``bench-data`` result; renderers only read the result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memlayout.data.bench import PIPELINES, DataBenchResult
from memlayout.machine import SPREAD_LIMIT, noisy


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render_terminal(res: DataBenchResult, console: Console) -> None:
    """Per pipeline: s/epoch, images/s, spread and bytes written per batch; the value check;
    then the median per-round ratio, with a warning when the rounds spread too much."""
    batch = res.config.batch
    console.print(f"folder: {res.folder}")
    table = Table(title=f"files -> normalized float32 channels-last batch {res.output_shape}; "
                        f"bytes per batch of {batch}")
    for col in ("pipeline", "s/epoch (median)", "images/s", "round spread", "copied",
                "of which layout permutes", "arithmetic writes"):
        table.add_column(col, justify="left" if col == "pipeline" else "right")
    for name in PIPELINES:
        m, c = res.comparison[name], res.copies[name]
        if not m.ok:
            table.add_row(name, f"[red]failed: {m.error}[/red]", "", "", "", "", "")
            continue
        table.add_row(name, f"{m.median:.3f}", f"{res.images_per_s(name):.0f}", f"{100 * m.spread:.0f} %",
                      _mb(c.copy_bytes), f"{_mb(c.layout_copy_bytes)} in {c.layout_copies} ops",
                      _mb(c.arithmetic_bytes))
    console.print(table)
    console.print(f"values: max |torchvision - memlayout| = {res.max_abs_diff:.2e}; strides "
                  + ", ".join(f"{n} {s}" for n, s in res.output_strides.items()))
    console.print("bytes: what torch ops write (TorchDispatchMode, one batch, num_workers=0); JPEG "
                  "decoding and PIL's packing into an array happen in both and are not counted")
    ratio, span = res.ratio, res.ratio_range
    if ratio is None or span is None:
        return
    console.print(f"memlayout / torchvision images/s: median per-round ratio [bold]{ratio:.2f}x[/bold] "
                  f"(range {span[0]:.2f}-{span[1]:.2f} over {len(res.comparison.ratios('memlayout'))} rounds)")
    loose = [n for n in PIPELINES if res.comparison[n].ok and noisy(res.comparison[n].spread)]
    if loose:
        console.print(f"[yellow]warning[/yellow]: the {' and '.join(loose)} rounds spread more than "
                      f"{100 * SPREAD_LIMIT:.0f} %: trust the ratio for its direction only")


def to_record(res: DataBenchResult, torch_threads: int) -> dict[str, Any]:
    """The result as one JSON-ready dict (what ``--json`` writes)."""
    span = res.ratio_range or (None, None)
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(res.config).items()},
        "torch_threads": torch_threads,
        "ratio_median": res.ratio, "ratio_min": span[0], "ratio_max": span[1],
        "max_abs_diff": res.max_abs_diff,
        "pipelines": {n: {"seconds_per_epoch": list(res.comparison[n].times),
                          "images_per_s": res.images_per_s(n),
                          "copy_bytes": res.copies[n].copy_bytes,
                          "layout_copy_bytes": res.copies[n].layout_copy_bytes,
                          "arithmetic_bytes": res.copies[n].arithmetic_bytes,
                          "strides": list(res.output_strides[n])} for n in PIPELINES},
    }
