"""Terminal rendering of a benchmark run (rich): what each mode is, the conditions, the
speedup tables and what went wrong. Renderers only read the config and the records.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from memlayout.bench.config import BenchConfig
from memlayout.bench.records import BenchRecord
from memlayout.bench.report import control_line, peak_methods, peak_tables, problems, summary_tables
from memlayout.machine import SPREAD_LIMIT, noisy


def mode_descriptions(cfg: BenchConfig) -> dict[str, str]:
    """One line per mode: what runs in it."""
    return {
        "nchw": "eager, contiguous (NCHW) model and input",
        "nhwc": "eager, model.to(memory_format=channels_last) + channels-last input (channels_last_3d for video)",
        "nhwc-again": "a second copy of nhwc, prepared and timed like it: an A/A control, its ratio to nhwc is the run's noise",
        "planned": f"memlayout.optimize(model, (x,), dtype=..., measure={cfg.plan_measure}, input_format='auto'); "
                   "input in the plan's format",
        "compile": f"torch.compile(backend={cfg.compile_backend!r}) of the NCHW model; Inductor chooses layouts",
        "planned+compile": "memlayout.compile (inference): the fastest verified of the plan compiled with Inductor's "
                           "layout optimization off, Inductor's own layout and (CPU) the peer runtimes installed; "
                           "Inductor's unless another measures >2% faster; train: torch.compile of the planned model",
        "compile-memlayout": "torch.compile(backend=memlayout.backend()) of the NCHW model: each graph planned from "
                             "measured costs (train: forward + backward), compiled by Inductor with the plan standing "
                             f"(--compile-backend eager: run eagerly){'' if cfg.plan_measure else '; analytical costs'}",
        "openvino": "OpenVINO CPU plugin: openvino.convert_model + compile_model, INFERENCE_PRECISION_HINT f32 or "
                    "bf16 (the runtime's own bf16, not autocast); NCHW input; inference only",
        "onnxruntime": "ONNX Runtime CPU EP: torch.onnx.export(dynamo=True) + InferenceSession, ORT_ENABLE_ALL; "
                       "fp32 only (no bf16 convolution kernels); NCHW input; inference only",
    }


def render_header(cfg: BenchConfig, console: Console) -> None:
    """What is about to run: models x dtypes x tasks, batch, rounds, device, and each mode."""
    console.print(f"[bold]memlayout bench[/bold]: {len(cfg.models)} models x {','.join(cfg.dtypes)} x "
                  f"{','.join(cfg.tasks)}, batch {cfg.batch}, {cfg.rounds} interleaved rounds, "
                  f"device {cfg.device}, threads {cfg.threads or 'default'}")
    described = mode_descriptions(cfg)
    for mode in cfg.modes:
        console.print(f"  {mode:16s} {described[mode]}")


def render_results(records: Sequence[BenchRecord], console: Console) -> None:
    """One table per dtype x task, then the noisy measurements (counted), the noise floor of
    the A/A control and the distinct problems."""
    titled = [(table, "speedup over eager NCHW, median of per-round ratios (min-max)")
              for table in summary_tables(records)]
    titled += [(table, f"% of the {table.dtype} GEMM peak") for table in peak_tables(records)]
    for table, what in titled:
        t = Table(title=f"{table.dtype} {table.task}: {what}")
        for col in table.header:
            t.add_column(col, justify="left" if col == "model" else "right")
        for row in table.rows:
            t.add_row(*row)
        console.print(t)
    for method in peak_methods(records):
        console.print(f"GEMM peak {method}", markup=False, highlight=False)
    line = noise_line(records)
    if line:
        console.print(f"[yellow]warning[/yellow]: {line}", highlight=False)
    control = control_line(records)
    if control:
        console.print(control, markup=False, highlight=False)
    for line in problems(records):
        console.print("note: " + line, markup=False, highlight=False)


def noise_line(records: Sequence[BenchRecord]) -> str:
    """The measurements whose rounds spread beyond ``SPREAD_LIMIT``, counted per model, in one
    sentence; empty when there are none.

    >>> noise_line([])
    ''
    """
    timed = [r for r in records if r.status == "ok" and r.spread is not None]
    loose = [r for r in timed if noisy(r.spread)]
    if not loose:
        return ""
    per_model: dict[str, int] = {}
    for r in loose:
        name = r.model.removeprefix("torchvision:")
        per_model[name] = per_model.get(name, 0) + 1
    where = ", ".join(f"{m} ({n})" for m, n in per_model.items())
    return (f"{len(loose)} of {len(timed)} measurements spread more than {100 * SPREAD_LIMIT:.0f} % "
            f"over their rounds ({where}): trust those ratios for their direction only")
