"""The benchmark harness (L3): every layout strategy side by side, interleaved in one run.

``BenchConfig`` (what to run) -> ``run_bench`` (records) -> writers (CSV, JSON, markdown, PNG).
``write_outputs`` writes all four into a directory.
"""

from __future__ import annotations

from pathlib import Path

from memlayout.bench.config import (
    BASELINE,
    DTYPES,
    MODES,
    TASKS,
    BenchConfig,
    BenchConfigError,
    ModeUnavailable,
)
from memlayout.bench.records import FLAT_FIELDS, BenchRecord, Environment
from memlayout.bench.runner import BenchEvent, BenchResult, run_bench
from memlayout.bench.zoo import ZOO_NAMES, ZooEntry, zoo


def write_outputs(result: BenchResult, out_dir: Path, *, command: str = "") -> dict[str, Path]:
    """Write ``results.csv``, ``results.json``, ``speedup.png`` and ``summary.md`` into
    ``out_dir`` (created if missing); returns their paths by kind."""
    from memlayout.bench.plot import plot_speedups
    from memlayout.bench.report import write_csv, write_json, write_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    env = result.env
    title = (f"{env.device_name} ({env.device}, {env.threads} threads), torch {env.torch}\n"
             "bars: median of per-round ratios vs eager NCHW, whiskers: min-max over rounds")
    return {
        "csv": write_csv(result.records, out_dir / "results.csv"),
        "json": write_json(result.records, out_dir / "results.json"),
        "png": plot_speedups(result.records, out_dir / "speedup.png", title=title),
        "md": write_markdown(result, out_dir / "summary.md", command=command),
    }


__all__ = [
    "BASELINE",
    "DTYPES",
    "FLAT_FIELDS",
    "MODES",
    "TASKS",
    "ZOO_NAMES",
    "BenchConfig",
    "BenchConfigError",
    "BenchEvent",
    "BenchRecord",
    "BenchResult",
    "Environment",
    "ModeUnavailable",
    "ZooEntry",
    "run_bench",
    "write_outputs",
    "zoo",
]
