"""The benchmark harness (L3): every layout strategy side by side, interleaved in one run.

``BenchConfig`` (what to run) -> ``run_bench`` (records) -> writers (CSV, JSON, markdown, PNG).
``write_outputs`` writes all four into a directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from memlayout.bench.config import (
    BASELINE,
    CONTROL,
    DEFAULT_MODES,
    DTYPES,
    MODES,
    TASKS,
    BenchConfig,
    BenchConfigError,
    ModeUnavailable,
)
from memlayout.bench.records import FLAT_FIELDS, BenchRecord, Environment
from memlayout.bench.report import read_json, write_csv, write_json, write_markdown
from memlayout.bench.runner import BenchEvent, BenchResult, run_bench
from memlayout.bench.zoo import ZOO_NAMES, ZooEntry, zoo
from memlayout.files import write_atomic

#: what a resumed run must share with the run it continues (models, dtypes, tasks may grow)
RESUME_FIELDS = ("modes", "batch", "image_size", "rounds", "warmup", "threads", "device",
                 "compile_backend", "plan_measure", "gemm_size", "zoo_sizes", "steady_heap")


def write_outputs(result: BenchResult, out_dir: Path, *, command: str = "") -> dict[str, Path]:
    """Write ``results.csv``, ``results.json``, ``speedup.png``, ``summary.md`` and
    ``config.json`` (what ``--resume`` checks) into ``out_dir`` (created if missing), each by
    writing a temporary file and renaming it; returns their paths by kind."""
    from memlayout.bench.plot import plot_speedups  # matplotlib: loaded only when a run writes

    out_dir.mkdir(parents=True, exist_ok=True)
    env = result.env
    title = (f"{env.device_name} ({env.device}, {env.threads} threads), torch {env.torch}\n"
             "bars: median of per-round ratios vs eager NCHW, whiskers: min-max over rounds")
    config = {name: getattr(result.config, name) for name in RESUME_FIELDS}
    return {
        "csv": write_csv(result.records, out_dir / "results.csv"),
        "json": write_json(result.records, out_dir / "results.json"),
        "png": plot_speedups(result.records, out_dir / "speedup.png", title=title),
        "md": write_markdown(result, out_dir / "summary.md", command=command),
        "config": write_atomic(out_dir / "config.json", json.dumps(config, indent=1) + "\n"),
    }


def resume_records(out_dir: Path, config: BenchConfig) -> list[BenchRecord]:
    """The records an earlier run wrote to ``out_dir`` (none if it has no ``results.json``),
    after checking that it measured what ``config`` would (same modes, batch, sizes, rounds,
    threads, device...; more models, dtypes or tasks are fine). Cases already there are
    skipped by ``run_bench(..., skip=...)``; new records are added to them.

    Raises ``BenchConfigError`` when the settings differ, naming each difference.
    """
    results, saved = out_dir / "results.json", out_dir / "config.json"
    if not results.is_file():
        return []
    if not saved.is_file():
        raise BenchConfigError(f"{out_dir} has results.json but no config.json (written by an "
                               "older memlayout): cannot check the settings match; use a new --out")
    # a field an older config.json lacks had its default then
    defaults = {f.name: f.default for f in dataclasses.fields(BenchConfig)
                if f.name in RESUME_FIELDS}
    before = json.loads(json.dumps(defaults | json.loads(saved.read_text())))
    now = json.loads(json.dumps({name: getattr(config, name) for name in RESUME_FIELDS}))
    diffs = [f"{name}: {before.get(name)!r} then, {now[name]!r} now" for name in RESUME_FIELDS
             if before.get(name) != now[name]]
    if diffs:
        raise BenchConfigError(f"--resume: {out_dir} was measured with other settings ("
                               + "; ".join(diffs) + "); run with the same flags or a new --out")
    return read_json(results)


__all__ = [
    "BASELINE",
    "DTYPES",
    "FLAT_FIELDS",
    "CONTROL",
    "DEFAULT_MODES",
    "MODES",
    "TASKS",
    "RESUME_FIELDS",
    "ZOO_NAMES",
    "BenchConfig",
    "BenchConfigError",
    "BenchEvent",
    "BenchRecord",
    "BenchResult",
    "Environment",
    "ModeUnavailable",
    "ZooEntry",
    "resume_records",
    "run_bench",
    "write_outputs",
    "zoo",
]
