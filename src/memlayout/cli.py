"""The ``memlayout`` command (L3): one verb per capability; parse -> call -> render.

Every verb checks all its flags before any work starts (one error line, exit code 2), states
the conditions before it times anything, and leaves the rendering to the renderer beside the
data (``audit.render``, ``bench.render``, ``coverage.render``, ``data.render``,
``train.render``, ``inspection``). The subsystems behind a verb (the planner, bench, coverage,
data, train) are imported inside it: each pulls in more (torch.fx and scipy, matplotlib,
OpInfo, PIL, torch.distributed), and ``memlayout --help`` should not wait for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memlayout import inspection
from memlayout.audit import render as audit_render
from memlayout.audit.overhead import overhead as measure_overhead
from memlayout.audit.recorder import audit as run_audit
from memlayout.dtypes import dtype_name, parse_dtype
from memlayout.errors import MemlayoutError
from memlayout.layout import Format
from memlayout.machine import Conditions
from memlayout.models import load_model
from memlayout.tensors import format_name, format_of, iter_tensors

if TYPE_CHECKING:
    from memlayout.plan.report.compare import ModelComparison

app = typer.Typer(
    help="Tensor memory layout (NCHW / channels-last) for PyTorch models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    console = Console(width=140)

#: the autocast dtypes of the verbs that run a model (bench has no fp16 cases)
DTYPES = ("fp32", "bf16", "fp16")
BENCH_DTYPES = ("fp32", "bf16")
PLAN_COSTS = ("measured", "analytic")


class UsageError(MemlayoutError, ValueError):
    """A flag value a verb cannot run with; reported before the verb does anything."""


def _fail(exc: MemlayoutError, *, debug: bool = False) -> NoReturn:
    if debug and exc.__cause__ is not None:  # the user's code that failed, where it failed
        import traceback

        console.print("".join(traceback.format_exception(exc.__cause__)), markup=False,
                      highlight=False)
    console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
    raise typer.Exit(2)


# -- flag checks: each returns the parsed value or raises a MemlayoutError naming the flag ----
def _dtype(value: str, allowed: tuple[str, ...] = DTYPES) -> str:
    """The short name of a ``--dtype`` value (``bfloat16`` -> ``bf16``)."""
    return dtype_name(parse_dtype(value, allowed=allowed))


def _dtypes(value: str, allowed: tuple[str, ...]) -> str:
    """A comma-separated ``--dtype`` list with each name checked and shortened."""
    return ",".join(_dtype(item, allowed) for item in value.split(",") if item.strip())


def _at_least(low: int, **flags: int | None) -> None:
    """Each flag given (not ``None``) is ``>= low``; keyword names are flag names."""
    for name, value in flags.items():
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise UsageError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
    return value


def _device(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine."""
    text = value.strip().lower()
    if text == "cpu":
        return text
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise UsageError(f"unknown device {value!r}; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {value}: CUDA is not available here "
                         "(torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if ":" in text and int(text.split(":")[1]) >= count:
        raise UsageError(f"--device {value}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return text


def _writable_file(flag: str, path: Path) -> None:
    """``path`` can be written: its folder exists and is writable, and it is not a folder."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")


def _print_conditions(conditions: Conditions) -> None:
    """The conditions a measurement is taken under, and the warning when the machine is busy."""
    console.print(f"conditions: {conditions.describe()}", markup=False, highlight=False)
    warning = conditions.warning()
    if warning:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


def _print_measuring_conditions(measure: bool) -> None:
    """``optimize``'s first words before it measures: the conditions, and what the planner
    does with numbers taken on a busy machine."""
    from memlayout.plan.check.guard import SUSPECT
    from memlayout.plan.costs.measure import RETRIES

    conditions = Conditions.now()
    _print_conditions(conditions)
    if measure and conditions.busy:
        console.print(
            f"costs measured now are marked noisy (one whose rounds spread too far is taken "
            f"again, at most {RETRIES} times) and counted in the plan's summary; a later run on "
            "a quiet machine measures them again instead of reading them from the cache, and a "
            f"plan predicting more than {SUSPECT:g}x the guard's measured time measures its "
            "costs once more", markup=False, highlight=False)


def _on_device(value: Any, device: str) -> Any:
    """A tensor, or a tuple / list / dict of them, on ``device``."""
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _progress(out: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=out, transient=False)


MODEL_HELP = "Model spec: torchvision:NAME, timm:NAME or file.py:factory."
DEVICE_HELP = "cpu, cuda or cuda:N. Default: cpu."


@app.callback()
def main() -> None:
    """Tensor memory layout (NCHW / channels-last) for PyTorch models."""


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 2.")] = 2,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
    device: Annotated[str, typer.Option(help=f"Device to run on: {DEVICE_HELP}")] = "cpu",
) -> None:
    """Run MODEL once in channels-last and show the format of its parameters and module outputs."""
    try:
        _at_least(1, batch=batch, image_size=image_size)
        device = _device(device)
        spec = load_model(model, batch=batch, image_size=image_size)
        inputs = _on_device(spec.example_input, device)
        report = inspection.inspect_model(spec.module.to(device), inputs, spec.fmt,
                                          kwargs=_on_device(spec.example_kwargs, device))
    except MemlayoutError as exc:
        _fail(exc)
    if spec.note:
        console.print(f"note: {spec.note}", markup=False, highlight=False)
    first = next(iter_tensors(spec.example_input))
    inspection.render_terminal(report, console, model=model, input_shape=tuple(first.shape))


@app.command()
def audit(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    train: Annotated[bool, typer.Option("--train", help="Forward + backward of the outputs' sum, model in train mode. Default: forward only, eval mode, no grad.")] = False,
    dtype: Annotated[str, typer.Option(help="fp32, or bf16 / fp16 under autocast. Default: fp32.")] = "fp32",
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 8.")] = 8,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
    format: Annotated[str | None, typer.Option("--format", help="channels_last or channels_last_3d. Default: the model's (video: channels_last_3d).")] = None,
    device: Annotated[str, typer.Option(help=f"Device to run on: {DEVICE_HELP}")] = "cpu",
    json_path: Annotated[str | None, typer.Option("--json", help="Write the whole report as JSON here. Default: none.")] = None,
    html_path: Annotated[str | None, typer.Option("--html", help="Write a self-contained HTML page here. Default: none.")] = None,
    top: Annotated[int, typer.Option(help="Rows of the terminal tables. Default: 20.")] = 20,
    overhead: Annotated[bool, typer.Option("--overhead", help="Instead: time audited vs plain runs interleaved and print the median per-round ratio. Default: off.")] = False,
    rounds: Annotated[int, typer.Option(help="Rounds for --overhead. Default: 5.")] = 5,
) -> None:
    """Run MODEL once in channels-last and report every op that drops the format (forward and
    backward), with module, phase and conversion bytes."""
    try:
        dtype = _dtype(dtype)
        fmt = Format.parse(format) if format else None
        _at_least(1, batch=batch, image_size=image_size, top=top, rounds=rounds)
        device = _device(device)
    except MemlayoutError as exc:
        _fail(exc)
    if overhead:
        _print_conditions(Conditions.now())
    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        fmt = fmt or spec.fmt
        module = spec.module.to(device).train(train)
        inputs = _on_device(spec.example_input, device)
        kwargs = _on_device(spec.example_kwargs, device)
        if spec.note:
            console.print(f"note: {spec.note}", markup=False, highlight=False)
        if overhead:
            c = measure_overhead(module, inputs, train=train, fmt=fmt, dtype=dtype, rounds=rounds,
                                 device=device, kwargs=kwargs)
            for name in ("plain", "audited"):
                if not c[name].ok:
                    raise MemlayoutError(f"the {name} run failed: {c[name].error}")
        else:
            report = run_audit(module, inputs, train=train, fmt=fmt, dtype=dtype, kwargs=kwargs)
    except MemlayoutError as exc:
        _fail(exc)
    if overhead:
        what = "forward+backward" if train else "forward"
        audit_render.render_overhead(c, console, f"{model} batch {batch} {fmt.value} {dtype} {what}")
        return
    title = f"memlayout audit {model} ({'train' if train else 'inference'}, batch {batch})"
    audit_render.render_terminal(report, console, title=title, top=top)
    if json_path:
        audit_render.write_json(report, json_path)
        console.print(f"JSON report: {json_path}")
    if html_path:
        audit_render.write_html(report, html_path, title=title)
        console.print(f"HTML report: {html_path}")


@app.command("bench-data")
def bench_data(
    images: Annotated[int, typer.Option(help="Synthetic JPEGs in the folder; one timed sample is one epoch over them. Default: 256.")] = 256,
    size: Annotated[int, typer.Option(help="Image height and width in pixels. Default: 224.")] = 224,
    workers: Annotated[int, typer.Option(help="DataLoader num_workers, for both pipelines. Default: 0.")] = 0,
    batch: Annotated[int, typer.Option(help="Batch size. Default: 64.")] = 64,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds. Default: 7.")] = 7,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads in the main process. Default: torch's own.")] = None,
    cache_dir: Annotated[str | None, typer.Option(help="Folder for the JPEGs, made once and reused. Default: $XDG_CACHE_HOME/memlayout/bench-data.")] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here. Default: none.")] = None,
    device: Annotated[str, typer.Option(help="Where the normalized batch goes (cpu, cuda, cuda:N). Default: cpu.")] = "cpu",
) -> None:
    """Images/s from JPEG files to a normalized float32 channels-last batch: the torchvision
    recipe (ToTensor, Normalize, default collate, .to(channels_last)) vs memlayout.data,
    interleaved in one run, and the bytes each writes per batch."""
    from memlayout.data.bench import DataBenchConfig, run_data_bench
    from memlayout.data.render import render_terminal, to_record

    try:
        _at_least(1, images=images, size=size, batch=batch, rounds=rounds, threads=threads)
        _at_least(0, workers=workers)
        device = _device(device)
    except MemlayoutError as exc:
        _fail(exc)
    if threads is not None:
        torch.set_num_threads(threads)
    config = DataBenchConfig(images=images, size=size, batch=batch, workers=workers, rounds=rounds,
                             cache_dir=Path(cache_dir) if cache_dir else None, device=device)
    console.print(f"{images} synthetic {size}x{size} JPEGs, batch {batch}, workers {workers}, "
                  f"torch threads {torch.get_num_threads()}, {rounds} interleaved rounds of one epoch each")
    _print_conditions(Conditions.now())
    try:
        res = run_data_bench(config)
    except MemlayoutError as exc:
        _fail(exc)
    render_terminal(res, console)
    if res.ratio is None:
        _fail(MemlayoutError("no ratio: a pipeline failed (see the table)"))
    if json_path:
        Path(json_path).write_text(json.dumps(to_record(res, torch.get_num_threads()), indent=2))
        console.print(f"JSON: {json_path}")


def _bench_command(models: list[str] | None, flags: tuple[tuple[str, Any, Any], ...],
                   steady_heap: bool) -> str:
    """The command line that reproduces a bench run (flags at their default left out)."""
    command = ["memlayout", "bench", *(models or [])]
    for flag, value, default in flags:
        if value is not None and value != default:
            command += [flag, str(value)]
    return shlex.join(command + (["--steady-heap"] if steady_heap else []))


@app.command()
def bench(
    models: Annotated[list[str] | None, typer.Argument(metavar="[MODEL_SPEC]...", help="Model specs: torchvision:NAME, timm:NAME or file.py:factory. Default: none (use --zoo).")] = None,
    zoo: Annotated[str | None, typer.Option(help="Add a model zoo: quick (3 small models at 64 px), classification (17 torchvision families) or all (+ segmentation, video, timm if installed). Default: none.")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated modes, nchw (the baseline) required: nchw, nhwc, planned, compile, planned+compile; and nhwc-again, a second copy of nhwc whose ratio to it is the run's noise floor (an A/A control); and the peer runtimes openvino, onnxruntime (inference on the CPU; pip install 'memlayout[runtimes]'). Default: the first five.")] = "nchw,nhwc,planned,compile,planned+compile",
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
    steady_heap: Annotated[bool, typer.Option("--steady-heap", help="Keep glibc's heap for the whole run (memlayout.malloc.steady_heap): large CPU tensors stop being unmapped and page-faulted in again every step. Default: off (the allocator as users run it).")] = False,
) -> None:
    """Time every layout strategy on each model, interleaved round by round in one process, and
    report speedups over eager NCHW (median of per-round ratios), FLOP/s and compile times."""
    from memlayout.bench import (
        BenchConfig,
        BenchEvent,
        BenchResult,
        resume_records,
        run_bench,
        write_outputs,
    )
    from memlayout.bench import zoo as zoo_entries
    from memlayout.bench.render import render_header, render_results

    specs = list(models or [])
    sizes: list[tuple[str, int]] = []
    try:
        _choice("--plan-costs", plan_costs, PLAN_COSTS)
        dtypes = _dtypes(dtype, BENCH_DTYPES) or dtype
        device = _device(device)
        for entry in zoo_entries(zoo) if zoo else ():
            specs.append(entry.spec)
            if entry.image_size:
                sizes.append((entry.spec, entry.image_size))
        cfg = BenchConfig.from_strings(
            list(dict.fromkeys(specs)), modes=modes, dtypes=dtypes, tasks=task, batch=batch,
            image_size=image_size, rounds=rounds, warmup=warmup, threads=threads, device=device,
            compile_backend=compile_backend, gemm_size=gemm_size, zoo_sizes=tuple(sizes),
            plan_measure=plan_costs == "measured", steady_heap=steady_heap)
        previous = resume_records(Path(out), cfg) if resume else []
    except MemlayoutError as exc:
        _fail(exc)
    done = {(r.model, r.dtype, r.task) for r in previous}
    if previous:
        console.print(f"--resume: {len(done)} model x dtype x task cases already in {out}, kept")
    command = _bench_command(models, (
        ("--zoo", zoo, None), ("--modes", modes, None), ("--dtype", dtype, None),
        ("--task", task, None), ("--batch", batch, None), ("--image-size", image_size, None),
        ("--rounds", rounds, None), ("--warmup", warmup, 1), ("--threads", threads, None),
        ("--device", device, "cpu"), ("--compile-backend", compile_backend, "inductor"),
        ("--gemm-size", gemm_size, None), ("--plan-costs", plan_costs, "measured"),
        ("--out", out, None)), steady_heap)
    render_header(cfg, console)
    conditions = Conditions.now()
    if threads is not None:  # the run sets them; state what it will run with
        conditions = dataclasses.replace(conditions, threads=threads)
    _print_conditions(conditions)

    per_case = len(cfg.modes) * cfg.rounds
    todo = [(m, d, t) for m in cfg.models for d in cfg.dtypes for t in cfg.tasks if (m, d, t) not in done]
    total = len(todo) * per_case
    records = list(previous)

    def save(case: list) -> None:  # after every case: a stopped run keeps what it measured
        records.extend(case)
        write_outputs(BenchResult(cfg, case[0].env, tuple(records)), Path(out), command=command)
    with _progress(console) as progress:
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
    result = BenchResult(cfg, result.env, tuple(records))
    render_results(result.records, console)
    paths = write_outputs(result, Path(out), command=command)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


@app.command()
def optimize(
    model: Annotated[str, typer.Argument(help="Model spec: torchvision:NAME, timm:NAME or file.py:factory.")],
    dtype: Annotated[str, typer.Option(help="fp32, or bf16 / fp16 under autocast. Default: fp32.")] = "fp32",
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 8.")] = 8,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
    device: Annotated[str, typer.Option(help="Where to plan and run: cpu, cuda or cuda:N (when CUDA is available). Default: cpu.")] = "cpu",
    save: Annotated[str | None, typer.Option(help="Write the plan as JSON here. Default: none.")] = None,
    measure: Annotated[bool, typer.Option("--measure/--no-measure", help="Time each layout node here (cached), or use the analytical model. Default: measure.")] = True,
    explain: Annotated[bool, typer.Option("--explain", help="Print every node's choice and costs. Default: off.")] = False,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of the speed comparison (0: skip it). Default: 7.")] = 7,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Use the cost cache ($MEMLAYOUT_CACHE_DIR or $XDG_CACHE_HOME/memlayout). Default: on.")] = True,
    guard: Annotated[bool, typer.Option("--guard/--no-guard", help="Time the whole planned model against all-NCHW and all-NHWC (cached; a decision measured on a busy machine is measured again) and keep the fastest of the three in the median of per-round ratios (a close call gets twice the rounds); needs --measure. Default: on.")] = True,
    refresh: Annotated[bool, typer.Option("--refresh", help="Measure every cost and whole-model decision again and overwrite the cached ones (e.g. numbers taken on a busy machine). Default: off.")] = False,
    memory_budget: Annotated[str | None, typer.Option(help="Peak activation memory the plan may use, in bytes or with a unit (300MB, 1.5GiB): the fastest plan within it, or an error naming the smallest peak found. Default: none.")] = None,
    padding: Annotated[bool, typer.Option("--padding/--no-padding", help="Time convolutions with channels padded to the vector width and pad where faster; needs --measure. Default: on.")] = True,
    compile: Annotated[bool, typer.Option("--compile", help="memlayout.compile: the fastest verified of the plan compiled so it stands (Inductor's layout optimization off), Inductor's own layout, Inductor with freezing and, on the CPU, the peer runtimes installed (Inductor's kept unless another measures >2% faster; cached); then time it against torch.compile's default and eager NCHW. Default: off.")] = False,  # noqa: A002
    train: Annotated[bool, typer.Option("--train", help="Plan a training step: forward + backward costs, gradients verified, training steps (SGD) timed against eager NCHW / NHWC. Default: off (inference).")] = False,
    input_format: Annotated[str | None, typer.Option(help="The format batches arrive in: contiguous (also nchw / ncdhw), channels_last (also nhwc; channels_last_3d / ndhwc for video), or auto (the plan chooses; deliver them so, as memlayout.data's loader can). The speed comparison gives every model its input in this format. Default: as the example is built (contiguous).")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="On an error, also print the traceback of its cause (a factory that raised, a capture that failed). Default: off.")] = False,
    plan_file: Annotated[str | None, typer.Option("--plan", help="Apply this saved plan (--save) instead of measuring: checked against the model and this torch, verified; its input shape, dtype, input format and train/inference are the plan's. Default: none (plan here).")] = None,
) -> None:
    """Plan NCHW / channels-last per operation from costs measured here, verify the planned
    model equal to the original, and time it against eager NCHW and eager NHWC (with
    --compile: against torch.compile's default and eager NCHW)."""
    from memlayout.plan.apply import apply as apply_plan
    from memlayout.plan.apply import read_plan
    from memlayout.plan.pipeline import example_inputs_of, format_label
    from memlayout.plan.pipeline import optimize as plan_model
    from memlayout.plan.report.compare import compare_with_eager
    from memlayout.plan.steer.module import keyword_call

    try:  # the options first: a bad one is reported before any model is built
        run_dtype = parse_dtype(dtype)
        if input_format is not None and input_format.strip().lower() != "auto":
            format_label(input_format, "input_format")
        run_device = _device(device)
        _at_least(1, batch=batch, image_size=image_size)
        _at_least(0, rounds=rounds)
        if save:
            _writable_file("--save", Path(save))
        saved = None
        if plan_file is not None:
            if compile:
                raise UsageError("--plan applies a saved layout plan; --compile plans and "
                                 "compiles here: use one of them")
            saved = read_plan(Path(plan_file))
            if len(saved.input_shapes) != 1 or len(saved.input_shapes[0]) < 3:
                raise UsageError(f"--plan {plan_file}: made for inputs {saved.input_shapes}; "
                                 "the command builds one image-like input")
            # the plan's example: its shape, dtype, format and task
            shape = saved.input_shapes[0]
            batch, image_size, train = shape[0], shape[-1], saved.train
            dtype = saved.dtype or "fp32"
            run_dtype = parse_dtype(dtype)
            input_format = saved.input_format
    except MemlayoutError as exc:
        _fail(exc)
    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        # keyword inputs become trailing positional ones: every step and timer below passes
        # one tuple (memlayout.plan.steer.module.KeywordCall)
        module, example = keyword_call(
            spec.module.to(run_device), _on_device(example_inputs_of(spec.example_input),
                                                   run_device),
            _on_device(spec.example_kwargs, run_device))
        first = next(iter_tensors(example))
        task_name = "training step" if train else "inference"
        shapes = ", ".join(str(tuple(t.shape)) for t in iter_tensors(example))
        console.print(f"{model}: input {shapes} ({format_name(format_of(first))}"
                      f" as built), {dtype_name(run_dtype)}, {task_name}, device {run_device}, "
                      f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
        if spec.note:
            console.print(f"note: {spec.note}", markup=False, highlight=False)
        _print_measuring_conditions(measure)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("measuring", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=f"measuring {what}")

            if saved is not None:
                opt = apply_plan(module, saved, example)
            elif compile:
                from memlayout.plan.candidates.compiled import compile as plan_and_compile

                opt = plan_and_compile(module, example, dtype=dtype,
                                       measure=measure, cache=cache, progress=progress,
                                       name=model, guard=guard, input_format=input_format,
                                       plan_kwargs={"refresh": refresh})
            else:
                opt = plan_model(module, example, dtype=dtype, measure=measure,
                                 cache=cache, progress=progress, name=model, guard=guard,
                                 memory_budget=memory_budget, padding=padding, train=train,
                                 refresh=refresh, input_format=input_format)
    except MemlayoutError as exc:
        _fail(exc, debug=debug)
    plan = opt.plan
    if explain:
        plan.explain(console)  # ends with the summary
    else:
        console.print(plan.summary(), markup=False, highlight=False)
    if plan.input_format is None:
        arrives = f"{format_name(format_of(first))}, as built"
    else:
        how = ("chosen by the plan (--input-format auto)" if input_format.strip().lower() == "auto"
               else f"--input-format {input_format}")
        arrives = (f"{plan.input_format} ({how}; the speed comparison hands every model its "
                   "input so, and the planned model converts an input that arrives otherwise)")
    console.print(f"input arrives {arrives}", markup=False, highlight=False)
    if plan.verification is not None:
        console.print(plan.verification.describe(), markup=False, highlight=False)
    if save:
        try:
            Path(save).write_text(plan.to_json())
        except OSError as exc:
            _fail(UsageError(f"--save {save}: the plan could not be written ({exc.strerror}); "
                             "it is printed above"))
        console.print(f"plan written to {save}")
    if rounds > 0 and compile:
        from memlayout.plan.candidates.compiled import compare_compiled

        result = compare_compiled(module, opt, example, rounds=rounds)
        _print_comparison(result, "batch")
    elif rounds > 0:
        result = compare_with_eager(module, opt, example, rounds=rounds, train=train)
        unit = "training step (forward, backward, SGD)" if train else "batch"
        _print_comparison(result, unit)


def _print_comparison(result: ModelComparison, unit: str) -> None:
    """Each mode's median time, then the base mode against each other one (the ratio of the
    medians shown, with the per-round ratios' median and range), and a warning when noisy."""
    for line in result.lines(unit):
        console.print(line, markup=False, highlight=False)


@app.command()
def coverage(
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    dtype: Annotated[str, typer.Option(help="Comma-separated dtypes, e.g. float32,bfloat16. Default: float32.")] = "float32",
    format: Annotated[str, typer.Option("--format", help="channels_last (4-D) or channels_last_3d (5-D). Default: channels_last.")] = "channels_last",
    ops: Annotated[str | None, typer.Option(help="Comma-separated globs over OpInfo names, e.g. 'nn.functional.conv2d,*pad*'. Default: every op.")] = None,
    out: Annotated[str, typer.Option(help="Directory for coverage.json and coverage.md. Default: memlayout-coverage.")] = "memlayout-coverage",
    max_samples: Annotated[int, typer.Option(help="Samples per op at most (spread over OpInfo's). Default: 24.")] = 24,
    jobs: Annotated[int, typer.Option(help="Worker processes (0: in this process, no hang/crash isolation). Default: 1.")] = 1,
    op_timeout: Annotated[float, typer.Option(help="Seconds per op before its worker is killed. Default: 120.")] = 120.0,
    cache: Annotated[bool, typer.Option(help="Merge the results into the per-user cache that lookup() reads. Default: on.")] = True,
) -> None:
    """Which OpInfo ops keep channels-last (forward and backward) and agree in value, on this build."""
    from memlayout.coverage import CoverageConfig, document, run_coverage, save_to_cache, write_json
    from memlayout.coverage.render import render_terminal

    try:
        _at_least(1, max_samples=max_samples)
        _at_least(0, jobs=jobs)
        if op_timeout <= 0:
            raise UsageError(f"--op-timeout must be > 0, got {op_timeout:g}")
        config = CoverageConfig(
            device=_device(device), dtypes=tuple(d.strip() for d in dtype.split(",") if d.strip()),
            fmt=Format.parse(format), ops=ops, max_samples=max_samples, jobs=jobs,
            op_timeout=op_timeout)
    except MemlayoutError as exc:
        _fail(exc)
    command = "memlayout " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        with _progress(console) as progress:
            task = progress.add_task("starting (importing OpInfo)", total=None)

            def on_record(dt: str, rec: Any) -> None:
                progress.update(task, advance=1, description=f"{dt} {rec.name[:36]:<36}")

            reports = run_coverage(config, command=command,
                                   on_start=lambda n: progress.update(task, total=n),
                                   on_record=on_record)
    except MemlayoutError as exc:
        _fail(exc)
    out_dir = Path(out)
    write_json(reports, out_dir / "coverage.json")
    (out_dir / "coverage.md").write_text(document(reports))
    cached = {i: save_to_cache(r) for i, r in enumerate(reports)} if cache else None
    render_terminal(reports, console, cached)
    console.print(f"wrote {out_dir / 'coverage.json'} and {out_dir / 'coverage.md'}")


@app.command()
def train(
    model: Annotated[str, typer.Argument(help="Classification model spec: torchvision:NAME, timm:NAME or file.py:factory.")],
    data: Annotated[str, typer.Option(help="ImageFolder (one sub-folder per class); with --synthetic, where it is written. Default: memlayout-synthetic.")] = "memlayout-synthetic",
    synthetic: Annotated[int | None, typer.Option(help="Write N synthetic JPEGs (4 classes, PIL, at --image-size) into --data first; nothing is downloaded. Default: off.")] = None,
    epochs: Annotated[int, typer.Option(help="Epochs. Default: 1.")] = 1,
    batch: Annotated[int, typer.Option(help="Batch size per process. Default: 32.")] = 32,
    dtype: Annotated[str, typer.Option(help="fp32, or bf16 / fp16 under autocast. Default: fp32.")] = "fp32",
    layout: Annotated[str, typer.Option(help="nchw (torchvision's usual path), nhwc (channels-last model + memlayout's channels-last data pipeline) or planned (memlayout.optimize(train=True) + the pipeline). Default: nhwc.")] = "nhwc",
    lr: Annotated[float, typer.Option(help="SGD learning rate (momentum 0.9). Default: 0.01.")] = 0.01,
    checkpoint: Annotated[str | None, typer.Option(help="Folder for latest.pt, written atomically at each epoch's end and the last step (rank 0), locked by this run (one writer per folder); its parent must exist. Default: none.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --checkpoint's latest.pt (model, optimizer, step, RNG). Default: off.")] = False,
    image_size: Annotated[int, typer.Option(help="Image height and width (images are resized to it). Default: 64.")] = 64,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes. Default: 0.")] = 0,
    log_every: Annotated[int, typer.Option(help="Steps per log line (and per timed interval of --compare). Default: 10.")] = 10,
    compare: Annotated[str | None, typer.Option(help="Comma-separated layouts (e.g. nchw,planned) trained side by side in this process, interval by interval (memlayout.timing.interleaved); prints images/s and per-round ratios over the first. LAYOUT-again (e.g. nchw-again) trains a second copy of a compared layout: an A/A control whose ratio is the run's noise. Default: off.")] = None,
    rounds: Annotated[int, typer.Option(help="Timed intervals per layout with --compare. Default: 7.")] = 7,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps in all. Default: epochs x steps per epoch.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (under torchrun: cuda:LOCAL_RANK). Default: cpu.")] = "cpu",
    plan_costs: Annotated[str, typer.Option(help="Planner costs for --layout planned: measured (cached) or analytic. Default: measured.")] = "measured",
    sync_bn: Annotated[bool, typer.Option("--sync-bn", help="SyncBatchNorm under torchrun: BatchNorm statistics over all ranks instead of each rank's own (CUDA only: torch has no CPU SyncBatchNorm). Default: off.")] = False,
    timeout: Annotated[float, typer.Option(help="Under torchrun: seconds a rank waits for the others (joining, each collective) before the run stops with an error naming the silent rank. Default: 300.")] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed of the weights, data order and dropout. Default: 0.")] = 0,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads per process (1 is steadier on a loaded machine). Default: torch's setting (torchrun: 1).")] = None,
    strategy: Annotated[str, typer.Option(help="Under torchrun: ddp (a replica per rank) or fsdp (FSDP2 fully_shard per block then the root, parameters contiguous, activations in --layout, mixed precision by FSDP's policy, sharded checkpoints latest.dcp). Default: ddp.")] = "ddp",
) -> None:
    """Train an image classifier (reference loop) in one layout, on one process or under
    torchrun (DDP or FSDP); print images/s, loss and accuracy per interval."""
    import contextlib

    from memlayout.train import (
        TrainConfig,
        Trainer,
        compare_layouts,
        init_distributed,
        make_synthetic,
    )
    from memlayout.train.ddp import barrier, collectives, shutdown
    from memlayout.train.loop import IntervalLog, check_compare, layout_of
    from memlayout.train.render import interval_line, render_comparison, render_run

    layouts = [s.strip() for s in compare.split(",") if s.strip()] if compare else []
    try:
        _choice("--plan-costs", plan_costs, PLAN_COSTS)
        _at_least(1, synthetic=synthetic, rounds=rounds, max_steps=max_steps, threads=threads)
        cfg = TrainConfig(model, data, epochs=epochs, batch=batch, dtype=_dtype(dtype), layout=layout,
                          lr=lr, checkpoint=checkpoint, resume=resume, image_size=image_size,
                          workers=workers, log_every=log_every, seed=seed, max_steps=max_steps,
                          device=_device(device), plan_measure=plan_costs == "measured",
                          sync_batchnorm=sync_bn, timeout=timeout, strategy=strategy)
        for name in layouts or [layout]:
            dataclasses.replace(cfg, layout=layout_of(name)).check()
        if layouts:
            check_compare(layouts)
    except MemlayoutError as exc:
        _fail(exc)
    out = console
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        info = init_distributed(cfg.device, timeout=cfg.timeout)
        if not info.is_main:
            out = Console(quiet=True)
        if synthetic is not None:
            with collectives(info, cfg.timeout, "rank 0 wrote the --synthetic data"):
                if info.is_main:
                    make_synthetic(data, synthetic, size=image_size, seed=seed)
                barrier(info)
        where = (f"{info.world_size} processes (torchrun, {cfg.strategy.upper()} {'nccl' if cfg.device.startswith('cuda') else 'gloo'})"
                 if info.distributed else "1 process")
        with contextlib.ExitStack() as stack, _progress(out) as progress:
            bar = progress.add_task("building", total=None)

            def on_event(event: object) -> None:
                if isinstance(event, IntervalLog):
                    progress.console.print(interval_line(event), markup=False, highlight=False)
                    progress.update(bar, completed=event.step, total=event.total_steps,
                                    description=f"{event.layout} epoch {event.epoch}")
                else:
                    progress.console.print(str(event), markup=False, highlight=False)

            if layouts:
                progress.update(bar, total=rounds * len(layouts), completed=0)
                out.print(f"memlayout train {model} --compare {','.join(layouts)}: {cfg.dtype}, batch {batch} per process x {where}, "
                          f"{image_size} px, {log_every} steps per interval, 1 warm-up + {rounds} interleaved rounds, "
                          f"device {cfg.device}, torch threads {torch.get_num_threads()}", markup=False, highlight=False)
                if info.is_main:
                    _print_conditions(Conditions.now())
                steps = [0]

                def on_step(r: int, name: str) -> None:
                    steps[0] += 1
                    progress.update(bar, completed=steps[0] - 1, description=f"round {r + 1}/{rounds} {name}")

                result = compare_layouts(cfg, layouts, rounds=rounds, dist_info=info,
                                         on_event=on_event, on_step=on_step)
                progress.update(bar, completed=rounds * len(layouts), description="done")
            else:
                trainer = stack.enter_context(Trainer(cfg, info, on_event))
                out.print(f"memlayout train {model}: layout {layout}, {cfg.dtype}, batch {batch} per process x {where}, "
                          f"{image_size} px, {len(trainer.dataset)} images in {len(trainer.dataset.classes)} classes, "
                          f"{trainer.steps_per_epoch} steps/epoch, {epochs} epochs, device {trainer.device}, "
                          f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
                if trainer.plan_summary:
                    out.print(trainer.plan_summary, markup=False, highlight=False)
                if resume:
                    out.print(f"resumed at step {trainer.step} from {checkpoint}", markup=False)
                progress.update(bar, total=trainer.total_steps, completed=trainer.step, description=layout)
                run = trainer.run()
    except MemlayoutError as exc:
        _fail(exc)
    if layouts:
        render_comparison(result, layouts, out, batch=batch, world_size=info.world_size, rounds=rounds)
    else:
        render_run(run, out)
    shutdown(info)


cache_app = typer.Typer(help="The measurement cache: show, prune, clear.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CACHE_HELP = "The cache file. Default: $MEMLAYOUT_CACHE_DIR/costs.sqlite, else $XDG_CACHE_HOME/memlayout/costs.sqlite."


@contextlib.contextmanager
def _cache_store(path: str | None) -> Iterator[tuple[Any, Path] | None]:
    """The cache at ``path`` (default: the user's) opened for one verb and closed after it;
    ``None``, said on screen, when there is no cache file."""
    from memlayout.plan.costs.cache import CostCache, cache_path

    file = Path(path) if path else cache_path()
    if not file.is_file():
        console.print(f"no cache at {file}", markup=False, highlight=False)
        yield None
        return
    store = CostCache(file)
    try:
        yield store, file
    finally:
        store.close()


@cache_app.command("show")
def cache_show(
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """The cache's file and its entries, grouped by machine, kind and quality, with ages."""
    from memlayout.plan.costs.cache import render

    with _cache_store(path) as opened:
        if opened is not None:
            render(opened[0].summary(), console)


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[float | None, typer.Option(help="Drop entries older than this many days. Default: none.")] = None,
    noisy: Annotated[bool, typer.Option("--noisy", help="Drop noisy entries (busy machine, or rounds spread too far). Default: off.")] = False,
    other_machines: Annotated[bool, typer.Option("--other-machines", help="Drop entries of another machine fingerprint (CPU, threads, torch, OpenMP wait policy). Default: off.")] = False,
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Drop entries older than --older-than days, noisy ones, or another machine's."""
    try:
        if older_than is None and not noisy and not other_machines:
            raise UsageError("cache prune: give --older-than DAYS, --noisy and/or "
                             "--other-machines (memlayout cache clear drops everything)")
        if older_than is not None and older_than < 0:
            raise UsageError(f"--older-than {older_than}: give a number of days >= 0")
    except MemlayoutError as exc:
        _fail(exc)
    with _cache_store(path) as opened:
        if opened is not None:
            store, file = opened
            dropped = store.prune(older_than_days=older_than, noisy_only=noisy,
                                  other_machines=other_machines)
            console.print(f"pruned {dropped} entries from {file}; {store.summary().count} left",
                          markup=False, highlight=False)


@cache_app.command("clear")
def cache_clear(
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Drop every entry: the next plan measures everything."""
    with _cache_store(path) as opened:
        if opened is not None:
            store, file = opened
            console.print(f"cleared {store.clear()} entries from {file}", markup=False,
                          highlight=False)


if __name__ == "__main__":
    app()
