"""``memlayout bench``: every layout strategy timed side by side, interleaved."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memlayout.cli.app import app
from memlayout.cli.common import (
    BENCH_DTYPES,
    CUDNN_BENCHMARK_HELP,
    DEVICE_HELP,
    PLAN_COSTS,
    bf16_notice,
    check_device,
    check_dtypes,
    choice,
    console,
    cudnn_benchmark,
    fail,
    print_conditions,
    progress_bar,
)
from memlayout.errors import MemlayoutError
from memlayout.machine import Conditions

if TYPE_CHECKING:
    from memlayout.bench import BenchConfig, BenchRecord, BenchResult


def _bench_command(models: list[str] | None, flags: tuple[tuple[str, Any, Any], ...],
                   switches: tuple[tuple[str, bool], ...]) -> str:
    """The command line that reproduces a bench run (flags at their default left out,
    ``switches`` given where on)."""
    command = ["memlayout", "bench", *(models or [])]
    for flag, value, default in flags:
        if value is not None and value != default:
            command += [flag, str(value)]
    return shlex.join(command + [flag for flag, on in switches if on])


@app.command()
def bench(
    models: Annotated[list[str] | None, typer.Argument(metavar="[MODEL_SPEC]...", help="Model specs: torchvision:NAME, timm:NAME or file.py:factory. Default: none (use --zoo).")] = None,
    zoo: Annotated[str | None, typer.Option(help="Add a model zoo: quick (3 small models at 64 px), classification (17 torchvision families) or all (+ segmentation, video, timm if installed). Default: none.")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated modes, nchw (the baseline) required: nchw, nhwc, planned, compile, planned+compile; and compile-memlayout, torch.compile(backend=\"memlayout\"); and nhwc-again, a second copy of nhwc whose ratio to it is the run's noise floor (an A/A control); and the peer runtimes openvino, onnxruntime (inference on the CPU; pip install 'memlayout[runtimes]'). Default: the first five.")] = "nchw,nhwc,planned,compile,planned+compile",
    dtype: Annotated[str, typer.Option(help="Comma-separated dtypes: fp32, bf16 (torch.autocast). Default: fp32.")] = "fp32",
    task: Annotated[str, typer.Option(help="Comma-separated tasks: infer (no grad), train (forward + backward + SGD step). Default: infer.")] = "infer",
    batch: Annotated[int, typer.Option(help="Batch size; halved and retried on out of memory. Default: 8.")] = 8,
    image_size: Annotated[int | None, typer.Option(help="Image height and width. Default: the zoo's (quick: 64), else the model's own (224; inception_v3 299; video 112).")] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved timed rounds; every mode runs once per round. Default: 7.")] = 7,
    warmup: Annotated[int, typer.Option(help="Untimed calls per mode before the rounds, after the first (compiling) call. Default: 1.")] = 1,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads for the run. Default: torch's current setting.")] = None,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    compile_backend: Annotated[str, typer.Option(help="torch.compile backend of the compile modes. Default: inductor.")] = "inductor",
    gemm_size: Annotated[int | None, typer.Option(help="Side of the square matmul timed as the GEMM peak, once per dtype per run. Default: 2048 on CPU, 8192 on CUDA.")] = None,
    plan_costs: Annotated[str, typer.Option(help="Planner costs for the planned modes: measured (on this machine, cached) or analytic (no timing, faster). Default: measured.")] = "measured",
    out: Annotated[str, typer.Option(help="Folder for results.csv, results.json, speedup.png, summary.md, config.json; rewritten after every model x dtype x task, so a stopped run keeps what it measured. Default: bench-results.")] = "bench-results",
    resume: Annotated[bool, typer.Option("--resume", help="Keep the records already in --out and run only the cases missing there (same settings required; more models, dtypes or tasks are fine). Default: off (start over).")] = False,
    cudnn: Annotated[bool, typer.Option("--cudnn-benchmark", help=CUDNN_BENCHMARK_HELP)] = False,
    steady_heap: Annotated[bool, typer.Option("--steady-heap", help="Keep glibc's heap for the whole run (memlayout.malloc.steady_heap): large CPU tensors stop being unmapped and page-faulted in again every step. Default: off (the allocator as users run it).")] = False,
) -> None:
    """Time every layout strategy on each model, interleaved round by round in one process, and
    report speedups over eager NCHW (median of per-round ratios), FLOP/s and compile times."""
    from memlayout.bench import BenchConfig, resume_records, write_outputs
    from memlayout.bench.render import render_results

    try:
        choice("--plan-costs", plan_costs, PLAN_COSTS)
        dtypes = check_dtypes(dtype, BENCH_DTYPES) or dtype
        device = check_device(device)
        cudnn_benchmark(cudnn)
        specs, sizes = _zoo_specs(models, zoo)
        cfg = BenchConfig.from_strings(
            specs, modes=modes, dtypes=dtypes, tasks=task, batch=batch,
            image_size=image_size, rounds=rounds, warmup=warmup, threads=threads, device=device,
            compile_backend=compile_backend, gemm_size=gemm_size, zoo_sizes=sizes,
            plan_measure=plan_costs == "measured", steady_heap=steady_heap)
        previous = resume_records(Path(out), cfg) if resume else []
    except MemlayoutError as exc:
        fail(exc)
    if previous:
        cases = {(r.model, r.dtype, r.task) for r in previous}
        console.print(f"--resume: {len(cases)} model x dtype x task cases already in {out}, kept")
    command = _bench_command(models, (
        ("--zoo", zoo, None), ("--modes", modes, None), ("--dtype", dtype, None),
        ("--task", task, None), ("--batch", batch, None), ("--image-size", image_size, None),
        ("--rounds", rounds, None), ("--warmup", warmup, 1), ("--threads", threads, None),
        ("--device", device, "cpu"), ("--compile-backend", compile_backend, "inductor"),
        ("--gemm-size", gemm_size, None), ("--plan-costs", plan_costs, "measured"),
        ("--out", out, None)), (("--steady-heap", steady_heap), ("--cudnn-benchmark", cudnn)))
    _print_header(cfg, threads)
    result = _run(cfg, previous, Path(out), command)
    render_results(result.records, console)
    paths = write_outputs(result, Path(out), command=command)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def _zoo_specs(models: list[str] | None, zoo: str | None
               ) -> tuple[list[str], tuple[tuple[str, int], ...]]:
    """The model specs given and those of ``--zoo`` (each once), and the zoo's image sizes."""
    from memlayout.bench import zoo as zoo_entries

    specs = list(models or [])
    sizes: list[tuple[str, int]] = []
    for entry in zoo_entries(zoo) if zoo else ():
        specs.append(entry.spec)
        if entry.image_size:
            sizes.append((entry.spec, entry.image_size))
    return list(dict.fromkeys(specs)), tuple(sizes)


def _print_header(cfg: BenchConfig, threads: int | None) -> None:
    """What runs, bf16's speed here where asked for, and the machine's conditions."""
    from memlayout.bench.render import render_header

    render_header(cfg, console)
    bf16_notice(tuple(cfg.dtypes), cfg.device,
                "the compile modes (compile, planned+compile) are not built in bf16 (recorded "
                "unavailable, with the reason), and the other bf16 modes time emulation")
    conditions = Conditions.now()
    if threads is not None:  # the run sets them; state what it will run with
        conditions = dataclasses.replace(conditions, threads=threads)
    print_conditions(conditions)


def _run(cfg: BenchConfig, previous: list[BenchRecord], out: Path, command: str) -> BenchResult:
    """Every case not in ``previous``, with a progress bar; the outputs rewritten after every
    case, so that a stopped run keeps what it measured. All the records, old and new."""
    from memlayout.bench import BenchEvent, BenchResult, run_bench, write_outputs

    done = {(r.model, r.dtype, r.task) for r in previous}
    per_case = len(cfg.modes) * cfg.rounds
    todo = [(m, d, t) for m in cfg.models for d in cfg.dtypes for t in cfg.tasks if (m, d, t) not in done]
    total = len(todo) * per_case
    records = list(previous)

    def save(case: list) -> None:  # after every case: a stopped run keeps what it measured
        records.extend(case)
        write_outputs(BenchResult(cfg, case[0].env, tuple(records)), out, command=command)
    with progress_bar(console) as progress:
        bar = progress.add_task("starting", total=total)

        def on_event(event: BenchEvent) -> None:
            name = event.model.removeprefix("torchvision:")
            where = f"{name} {event.dtype} {event.task} batch {event.batch}"
            if event.phase == "setup":
                progress.update(bar, description=f"{where}: building {event.mode}")
                if not console.is_terminal:  # a log has no live bar: one line per step instead
                    console.print(f"{where}: building {event.mode}", markup=False, highlight=False)
            elif event.mode in cfg.modes:  # the GEMM timed alongside is not a step of the bar
                progress.update(bar, advance=1, description=f"{where}: round {(event.round or 0) + 1}/{cfg.rounds} {event.mode}")

        result = run_bench(cfg, on_event=on_event, skip=done, on_case=save)
        progress.update(bar, completed=total, description="done")
    return BenchResult(cfg, result.env, tuple(records))
