"""``speedup.png``: speedup over eager NCHW per model and mode, one panel per dtype x task.

Headless: draws on a ``matplotlib.figure.Figure`` with the Agg canvas, never touching pyplot's
global backend. Log-2 axis; bars start at 1.0 and end at the median of per-round ratios
(up: faster than NCHW, down: slower); whiskers span min-max over rounds; a mode that errored
is marked ``x`` on the 1.0 line, an unavailable one is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from memlayout.bench.config import BASELINE, MODES
from memlayout.bench.records import BenchRecord
from memlayout.files import atomic_file

_COLORS = {"nhwc": "#1f77b4", "planned": "#2ca02c", "compile": "#ff7f0e",
           "planned+compile": "#9467bd", "compile-memlayout": "#e377c2", "nhwc-again": "#aec7e8", "openvino": "#d62728",
           "onnxruntime": "#8c564b"}


def plot_speedups(records: Sequence[BenchRecord], path: Path, *, title: str = "") -> Path:
    """Write the bar chart to ``path`` (PNG) and return it."""
    cases = list(dict.fromkeys((r.dtype, r.task) for r in records))
    present = {r.mode for r in records if r.status != "unavailable"} - {BASELINE}
    modes = [m for m in MODES if m in present]
    models = list(dict.fromkeys(r.model for r in records))
    width_in = max(7.0, 0.3 * len(models) * max(1, len(modes)) + 3.5)
    fig = Figure(figsize=(width_in, 3.2 * max(1, len(cases)) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(cases)), 1, squeeze=False)[:, 0]
    bar = 0.8 / max(1, len(modes))
    for ax, (dtype, task) in zip(axes, cases, strict=False):
        by_key = {(r.model, r.mode): r for r in records if (r.dtype, r.task) == (dtype, task)}
        for j, mode in enumerate(modes):
            xs, ys, lo, hi, failed = [], [], [], [], []
            for i, model in enumerate(models):
                r = by_key.get((model, mode))
                x = i - 0.4 + bar * (j + 0.5)
                if r is None or r.status == "unavailable":
                    continue
                if r.status != "ok" or r.speedup is None:
                    failed.append(x)
                    continue
                xs.append(x)
                ys.append(r.speedup)
                lo.append(r.speedup - (r.speedup_min if r.speedup_min is not None else r.speedup))
                hi.append((r.speedup_max if r.speedup_max is not None else r.speedup) - r.speedup)
            color = _COLORS.get(mode, "gray")
            if xs:
                # bars grow from the 1.0 line: up when faster than NCHW, down when slower
                ax.bar(xs, [y - 1.0 for y in ys], bar, bottom=1.0, yerr=[lo, hi], capsize=2,
                       color=color, label=mode, error_kw={"elinewidth": 0.8, "ecolor": "black"})
            if failed:
                ax.plot(failed, [1.0] * len(failed), "x", color=color, markersize=8,
                        markeredgewidth=2, label=f"{mode}: error")
        # log2 scale: 2x faster and 2x slower are the same distance from the 1.0 line
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([m.removeprefix("torchvision:") for m in models], rotation=30,
                           ha="right", fontsize=8)
        ax.set_ylabel("speedup vs NCHW (log scale)")
        ax.set_title(f"{dtype} {task}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title, fontsize=9)
    with atomic_file(path) as f:  # never half a picture
        fig.savefig(f, dpi=110, format="png")
    return path
