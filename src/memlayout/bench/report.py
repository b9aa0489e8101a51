"""Writers for benchmark results: flat CSV and JSON, a markdown summary, table rows.

Renderers only read the records. The summary quotes ratios (median of per-round ratios against
eager NCHW, with the min-max over rounds), not absolute times.

>>> fmt_speedup(1.2345, 1.1, 1.31)
'1.23x (1.10-1.31)'
>>> fmt_speedup(None, None, None)
'-'
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlayout.bench.config import BASELINE, CONTROL, RUNTIME_MODES
from memlayout.bench.records import FLAT_FIELDS, BenchRecord, Environment
from memlayout.bench.runner import BenchResult
from memlayout.files import write_atomic
from memlayout.timing import Ratio, geomean


def write_csv(records: Sequence[BenchRecord], path: Path) -> Path:
    """One row per record, columns ``FLAT_FIELDS``; per-round lists as space-separated numbers."""
    fh = io.StringIO(newline="")
    writer = csv.DictWriter(fh, fieldnames=list(FLAT_FIELDS))
    writer.writeheader()
    for record in records:
        row = record.to_flat()
        for key in ("round_times_s", "round_speedups"):
            row[key] = " ".join(repr(v) for v in row[key])
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return write_atomic(path, fh.getvalue())


def write_json(records: Sequence[BenchRecord], path: Path) -> Path:
    """A JSON list of flat records (``null`` for a missing value, never NaN)."""
    rows = [{k: _finite(v) for k, v in r.to_flat().items()} for r in records]
    return write_atomic(path, json.dumps(rows, indent=1) + "\n")


def read_json(path: Path) -> list[BenchRecord]:
    """The records ``write_json`` wrote (to re-render tables and plots without re-running)."""
    env_fields = {f.name for f in dataclasses.fields(Environment)}
    records = []
    for row in json.loads(path.read_text()):
        env = Environment(**{k: row[k] for k in env_fields if k in row})  # older files lack some
        values = {k: v for k, v in row.items() if k not in env_fields}
        for key in ("round_times_s", "round_speedups"):
            values[key] = tuple(values[key])
        records.append(BenchRecord(env=env, **values))
    return records


@dataclass(frozen=True)
class SummaryTable:
    """The rows of one dtype x task table, as display strings."""

    dtype: str
    task: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def fmt_speedup(value: float | None, low: float | None, high: float | None) -> str:
    if value is None:
        return "-"
    if low is None or high is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({low:.2f}-{high:.2f})"


def summary_tables(records: Sequence[BenchRecord]) -> list[SummaryTable]:
    """One table per dtype x task: a row per model, a speedup column per non-baseline mode,
    then NCHW's fraction of the GEMM peak, NCHW's round spread and compile times; a last
    row with the geometric mean speedup of each mode over the models where it ran."""
    tables = []
    modes = _ordered({r.mode for r in records} - {BASELINE}, [r.mode for r in records])
    for dtype, task in _ordered({(r.dtype, r.task) for r in records},
                                [(r.dtype, r.task) for r in records]):
        case = [r for r in records if (r.dtype, r.task) == (dtype, task)]
        models = _ordered({r.model for r in case}, [r.model for r in case])
        compile_modes = [m for m in modes if "compile" in m or m in RUNTIME_MODES]
        header = ("model", "batch", *modes, "NCHW % of GEMM peak", "NCHW spread",
                  *(f"{m} s" if m != "compile" else "compile s" for m in compile_modes))
        rows = []
        for model in models:
            by_mode = {r.mode: r for r in case if r.model == model}
            base = by_mode.get(BASELINE)
            batch = str(base.batch) if base and base.batch else "-"
            if base and base.requested_batch and base.batch and base.batch != base.requested_batch:
                batch += f" (asked {base.requested_batch})"
            cells = [_cell(by_mode.get(m)) for m in modes]
            peak = (f"{100 * base.peak_fraction:.1f} %" if base and base.peak_fraction else "-")
            spread = (f"{100 * base.spread:.0f} %" if base and base.spread is not None else "-")
            if base and base.status != "ok":
                peak = spread = "error"
            compiles = [f"{by_mode[m].compile_s:.1f}" if m in by_mode and by_mode[m].compile_s
                        else "-" for m in compile_modes]
            rows.append((_short(model), batch, *cells, peak, spread, *compiles))
        means = []
        for m in modes:
            values = [r.speedup for r in case if r.mode == m and r.status == "ok" and r.speedup]
            means.append(f"{geomean(values):.2f}x" if values else "-")
        rows.append(("geomean", "", *means, "", "", *("" for _ in compile_modes)))
        tables.append(SummaryTable(dtype, task, header, tuple(rows)))
    return tables


def peak_tables(records: Sequence[BenchRecord]) -> list[SummaryTable]:
    """One table per dtype x task: each mode's FLOP/s as a fraction of the GEMM peak in that
    dtype (measured once per dtype in the run), a column per mode, baseline included."""
    tables = []
    modes = _ordered({r.mode for r in records}, [r.mode for r in records])
    for dtype, task in _ordered({(r.dtype, r.task) for r in records},
                                [(r.dtype, r.task) for r in records]):
        case = [r for r in records if (r.dtype, r.task) == (dtype, task)]
        if not any(r.peak_fraction for r in case):
            continue
        rows = []
        for model in _ordered({r.model for r in case}, [r.model for r in case]):
            by_mode = {r.mode: r for r in case if r.model == model}
            rows.append((_short(model), *(_peak_cell(by_mode.get(m)) for m in modes)))
        tables.append(SummaryTable(dtype, task, ("model", *modes), tuple(rows)))
    return tables


def peak_methods(records: Sequence[BenchRecord]) -> list[str]:
    """The GEMM peak of each dtype and how it was measured, one line each."""
    seen: dict[str, str] = {}
    for r in records:
        if r.gemm_method and r.gemm_flops_per_s and r.dtype not in seen:
            seen[r.dtype] = f"{r.dtype}: {r.gemm_flops_per_s / 1e9:.0f} GFLOP/s ({r.gemm_method})"
    return list(seen.values())


def _peak_cell(record: BenchRecord | None) -> str:
    if record is None or record.status != "ok" or not record.peak_fraction:
        return "-" if record is None or record.status == "ok" else record.status
    return f"{100 * record.peak_fraction:.1f} %"


def problems(records: Sequence[BenchRecord]) -> list[str]:
    """One line per distinct error or unavailable mode (with the cases it hit) and per note
    about an out-of-memory retry, for under the tables."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    notes: list[str] = []
    for r in records:
        if r.status != "ok":
            model = "" if r.status == "unavailable" else _short(r.model)
            groups.setdefault((model, r.status, r.error or ""), []).append(
                f"{r.dtype} {r.task} {r.mode}")
        if r.note and "out of memory" in r.note and r.mode == BASELINE:
            notes.append(f"{_short(r.model)} {r.dtype} {r.task}: {r.note}")
    n_cases = len({(r.dtype, r.task, r.mode) for r in records})
    lines = []
    for (model, status, error), where in groups.items():
        scope = "every case" if len(where) == n_cases else ", ".join(where)
        if status == "unavailable":
            modes = ", ".join(dict.fromkeys(w.rsplit(" ", 1)[-1] for w in where))
            lines.append(f"{modes}: unavailable: {error}")
        else:
            lines.append(f"{model} ({scope}): {status}: {error}")
    return lines + notes


def write_markdown(result: BenchResult, path: Path, *, command: str = "",
                   plot_name: str | None = "speedup.png") -> Path:
    """``summary.md``: command, machine and versions, one table per dtype x task, problems."""
    env, cfg = result.env, result.config
    lines = ["# memlayout bench results", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"- machine: {env.device_name}, device `{env.device}`, {env.threads} threads; {env.platform}"
        + (f"; allocator: {env.malloc}" if env.malloc else ""),
        f"- versions: torch {env.torch}, torchvision {env.torchvision}, memlayout {env.memlayout}, "
        f"Python {env.python}; {env.timestamp}",
        f"- {cfg.rounds} interleaved rounds after {cfg.warmup} warm-up call(s) per mode; "
        f"GEMM peak per dtype: a {cfg.gemm_side()}x{cfg.gemm_side()} matmul on tensors of that "
        "dtype, timed once per dtype in the run by the same timer (fastest call)",
        "- cells: speedup over eager NCHW = median of per-round ratios (NCHW time / mode time), "
        "(min-max over rounds); > 1 is faster. bf16 = `torch.autocast` (weights fp32) for the "
        "torch modes, the runtime's own bf16 for openvino (`INFERENCE_PRECISION_HINT=bf16`). "
        "train = forward + backward + SGD step.",
    ]
    lines += [f"- GEMM peak {line}" for line in peak_methods(result.records)]
    busy = sorted({(r.env.timestamp, r.env.load_average) for r in result.records
                   if r.env.overloaded})
    if busy:
        lines.append(f"- **the machine was busy**: load average {max(b[1] for b in busy):.1f} on "
                     f"{env.cpu_count} CPUs when {len(busy)} of the runs started; more jobs than "
                     "cores stretch every timing: trust these ratios for direction only "
                     f"(OMP_WAIT_POLICY={env.omp_wait_policy or 'default'})")
    stamps = sorted({r.env.timestamp for r in result.records})
    if len(stamps) > 1:
        versions = sorted({f"torch {r.env.torch}, memlayout {r.env.memlayout}"
                           for r in result.records})
        lines.append(f"- resumed: records from {len(stamps)} runs, {stamps[0]} to {stamps[-1]} "
                     f"({'; '.join(versions)})")
    lines.append("")
    for table in summary_tables(result.records):
        lines += [f"## {table.dtype} {table.task}", "", _md_row(table.header),
                  _md_row(tuple("---" for _ in table.header))]
        lines += [_md_row(row) for row in table.rows]
        lines.append("")
    for table in peak_tables(result.records):
        lines += [f"## {table.dtype} {table.task}: % of the {table.dtype} GEMM peak", "",
                  _md_row(table.header), _md_row(tuple("---" for _ in table.header))]
        lines += [_md_row(row) for row in table.rows]
        lines.append("")
    if any(r.peak_fraction and r.peak_fraction > 1 for r in result.records):
        lines += ["Above 100 %: more FLOP/s than the GEMM peak of this run. The peak is one "
                  "measurement per dtype, taken at another moment than the mode's rounds (on a "
                  "shared machine, under other load), and a runtime may compute fewer FLOPs than "
                  "torch counts for the model (Winograd convolutions).", ""]
    runtimes = runtime_lines(result.records)
    if runtimes:
        lines += ["## Peer runtimes", ""]
        lines += [f"- {_md_escape(line)}" for line in runtimes]
        lines.append("")
    issues = problems(result.records)
    if issues:
        lines += ["## Errors, unavailable modes, retries", ""]
        lines += [f"- {_md_escape(line)}" for line in issues]
        lines.append("")
    noise = control_line(result.records)
    if noise:
        lines += ["## Noise floor (A/A control)", "", noise, ""]
    choices = plan_choices(result.records)
    if choices:
        lines += ["## What the planner chose", ""]
        lines += [f"- {_md_escape(line)}" for line in choices]
        lines.append("")
    if plot_name:
        lines += [f"![speedup vs NCHW]({plot_name})", ""]
    return write_atomic(path, "\n".join(lines))


def control_line(records: Sequence[BenchRecord]) -> str:
    """With the ``nhwc-again`` control mode: the medians of per-round ratios nhwc / its copy
    over the cases, the smallest difference this run can show (identical models: 1 up to
    noise). Empty without the control."""
    times = {(r.model, r.dtype, r.task, r.mode): r.round_times_s for r in records
             if r.status == "ok" and r.round_times_s}
    medians = []
    for (model, dtype, task, mode), again in times.items():
        nhwc = times.get((model, dtype, task, "nhwc"))
        ratio = Ratio.of_times("nhwc", CONTROL, nhwc, again) if mode == CONTROL and nhwc else None
        if ratio is not None:
            medians.append(ratio.median)
    if not medians:
        return ""
    return (f"eager NHWC vs a second copy of it ({CONTROL}), median of per-round time ratios: "
            f"{min(medians):.3f}-{max(medians):.3f} over {len(medians)} cases "
            f"({sum(abs(m - 1) > 0.02 for m in medians)} more than 2 % from 1). Two modes "
            "closer than this cannot be told apart in this run.")


def runtime_lines(records: Sequence[BenchRecord]) -> list[str]:
    """One line per timed peer-runtime record: version, converter, precision, threads and the
    output check against eager NCHW (the record's note)."""
    return [f"{_short(r.model)} {r.dtype} {r.mode}: {r.note}" for r in records
            if r.mode in RUNTIME_MODES and r.status == "ok" and r.note]


def plan_choices(records: Sequence[BenchRecord]) -> list[str]:
    """One line per planned case whose record carries the plan's headline
    (``Plan.headline``: formats, conversions, what the guard kept) or memlayout.compile's
    choice."""
    return [f"{_short(r.model)} {r.dtype} {r.task} {r.mode}: {r.note}" for r in records
            if r.mode.startswith("planned") and r.status == "ok"
            and r.note.startswith(("plan:", "memlayout.compile"))]


def _cell(record: BenchRecord | None) -> str:
    if record is None:
        return "-"
    if record.status == "unavailable":
        return "unavailable"
    if record.status == "error":
        return "error"
    return fmt_speedup(record.speedup, record.speedup_min, record.speedup_max)


def _short(model: str) -> str:
    return model.removeprefix("torchvision:")


def _ordered(items: set, in_order: list) -> list:
    return [x for x in dict.fromkeys(in_order) if x in items]


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(_md_escape(c) for c in cells) + " |"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
