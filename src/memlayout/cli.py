"""The ``memlayout`` command (L3): one verb per capability; parse -> call -> render."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from memlayout.errors import MemlayoutError

if TYPE_CHECKING:
    from memlayout.plan.compare import ModelComparison

app = typer.Typer(
    help="Tensor memory layout (NCHW / channels-last) for PyTorch models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    console = Console(width=140)

_STYLE = {"channels_last": "green", "channels_last_3d": "green", "contiguous": "yellow",
          "none": "red"}


def _styled(name: str) -> str:
    style = "cyan" if name.startswith("ambiguous") else _STYLE.get(name, "white")
    return f"[{style}]{name}[/{style}]"


def _fail(exc: MemlayoutError) -> None:
    console.print(f"[bold red]error:[/bold red] {exc}")
    raise typer.Exit(2)


@app.callback()
def main() -> None:
    """Tensor memory layout (NCHW / channels-last) for PyTorch models."""


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help="Model spec: torchvision:NAME, timm:NAME or file.py:factory.")],
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 2.")] = 2,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
) -> None:
    """Run MODEL once in channels-last and show the format of its parameters and module outputs."""
    from memlayout.inspection import inspect_model
    from memlayout.models import load_model

    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        report = inspect_model(spec.module, spec.example_input, spec.fmt)
    except MemlayoutError as exc:
        _fail(exc)
    params = Table(title=f"{model}: parameters and buffers after convert_module(..., {report.fmt.name})")
    for col in ("rank", "tensors", "elements", "formats"):
        params.add_column(col, justify="right" if col != "formats" else "left")
    for g in report.params:
        fmts = ", ".join(f"{_styled(n)} x{c}" for n, c in g.formats)
        params.add_row(str(g.rank), str(g.tensors), f"{g.elements:,}", fmts)
    console.print(params)
    outs = Table(title=f"{model}: module outputs, input {tuple(spec.example_input.shape)} in {report.fmt.name}")
    for col in ("#", "module", "type", "output shape", "format"):
        outs.add_column(col)
    for i, o in enumerate(report.outputs):
        outs.add_row(str(i), o.path or "(model)", o.type,
                     " ".join(str(s) for s in o.shapes), " ".join(_styled(f) for f in o.formats))
    console.print(outs)
    counts: dict[str, int] = {}
    for o in report.outputs:
        for f in o.formats:
            counts[f] = counts.get(f, 0) + 1
    console.print("module outputs by format: " + ", ".join(f"{_styled(k)} {v}" for k, v in sorted(counts.items())))


@app.command()
def audit(
    model: Annotated[str, typer.Argument(help="Model spec: torchvision:NAME, timm:NAME or file.py:factory.")],
    train: Annotated[bool, typer.Option("--train", help="Forward + backward of the outputs' sum, model in train mode. Default: forward only, eval mode, no grad.")] = False,
    dtype: Annotated[str, typer.Option(help="fp32, or bf16 / fp16 under autocast. Default: fp32.")] = "fp32",
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 8.")] = 8,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
    format: Annotated[str | None, typer.Option("--format", help="channels_last or channels_last_3d. Default: the model's (video: channels_last_3d).")] = None,
    device: Annotated[str, typer.Option(help="Device to run on. Default: cpu.")] = "cpu",
    json_path: Annotated[str | None, typer.Option("--json", help="Write the whole report as JSON here. Default: none.")] = None,
    html_path: Annotated[str | None, typer.Option("--html", help="Write a self-contained HTML page here. Default: none.")] = None,
    top: Annotated[int, typer.Option(help="Rows of the terminal table. Default: 20.")] = 20,
    overhead: Annotated[bool, typer.Option("--overhead", help="Instead: time audited vs plain runs interleaved and print the median per-round ratio. Default: off.")] = False,
    rounds: Annotated[int, typer.Option(help="Rounds for --overhead. Default: 5.")] = 5,
) -> None:
    """Run MODEL once in channels-last and report every op that drops the format (forward and
    backward), with module, phase and conversion bytes."""
    from memlayout.audit import audit as run_audit
    from memlayout.audit.render import render_terminal, write_html, write_json
    from memlayout.layout import Format
    from memlayout.models import load_model

    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        fmt = Format.parse(format) if format else spec.fmt
        module = spec.module.to(device).train(train)
        inputs = spec.example_input.to(device)
        if overhead:
            from memlayout.audit.overhead import overhead as measure

            c = measure(module, inputs, train=train, fmt=fmt, dtype=dtype, rounds=rounds, device=device)
            for name in ("plain", "audited"):
                if not c[name].ok:
                    _fail(MemlayoutError(f"the {name} run failed: {c[name].error}"))
            ratio, (low, high) = c.speedup("plain"), c.speedup_range("plain")
            what = "forward+backward" if train else "forward"
            console.print(f"{model} batch {batch} {fmt.value} {dtype} {what}, {c.rounds} interleaved rounds: "
                          f"plain median {c['plain'].median * 1e3:.1f} ms (spread {100 * c['plain'].spread:.0f} %), "
                          f"audited median {c['audited'].median * 1e3:.1f} ms (spread {100 * c['audited'].spread:.0f} %)")
            console.print(f"audited / plain: median per-round ratio {ratio:.2f}x (range {low:.2f}-{high:.2f})")
            return
        report = run_audit(module, inputs, train=train, fmt=fmt, dtype=dtype)
    except MemlayoutError as exc:
        _fail(exc)
    title = f"memlayout audit {model} ({'train' if train else 'inference'}, batch {batch})"
    render_terminal(report, console, title=title, top=top)
    if json_path:
        write_json(report, json_path)
        console.print(f"JSON report: {json_path}")
    if html_path:
        write_html(report, html_path, title=title)
        console.print(f"HTML report: {html_path}")


@app.command("bench-data")
def bench_data(
    images: Annotated[int, typer.Option(min=1, help="Synthetic JPEGs in the folder; one timed sample is one epoch over them. Default: 256.")] = 256,
    size: Annotated[int, typer.Option(min=1, help="Image height and width in pixels. Default: 224.")] = 224,
    workers: Annotated[int, typer.Option(min=0, help="DataLoader num_workers, for both pipelines. Default: 0.")] = 0,
    batch: Annotated[int, typer.Option(min=1, help="Batch size. Default: 64.")] = 64,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds. Default: 7.")] = 7,
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads in the main process. Default: torch's own.")] = None,
    cache_dir: Annotated[str | None, typer.Option(help="Folder for the JPEGs, made once and reused. Default: $XDG_CACHE_HOME/memlayout/bench-data.")] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here. Default: none.")] = None,
) -> None:
    """Images/s from JPEG files to a normalized float32 channels-last batch: the torchvision
    recipe (ToTensor, Normalize, default collate, .to(channels_last)) vs memlayout.data,
    interleaved in one run, and the bytes each writes per batch."""
    import json
    from pathlib import Path

    import torch

    from memlayout.data.bench import PIPELINES, DataBenchConfig, run_data_bench

    if threads is not None:
        torch.set_num_threads(threads)
    config = DataBenchConfig(images=images, size=size, batch=batch, workers=workers, rounds=rounds,
                             cache_dir=Path(cache_dir) if cache_dir else None)
    console.print(f"{images} synthetic {size}x{size} JPEGs, batch {batch}, workers {workers}, "
                  f"torch threads {torch.get_num_threads()}, {rounds} interleaved rounds of one epoch each")
    try:
        res = run_data_bench(config)
    except MemlayoutError as exc:
        _fail(exc)
    console.print(f"folder: {res.folder}")
    def mb(n: int) -> str:
        return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"

    table = Table(title=f"files -> normalized float32 channels-last batch {res.output_shape}; bytes per batch of {batch}")
    for col in ("pipeline", "s/epoch (median)", "images/s", "round spread", "copied",
                "of which layout permutes", "arithmetic writes"):
        table.add_column(col, justify="left" if col == "pipeline" else "right")
    for name in PIPELINES:
        m, c = res.comparison[name], res.copies[name]
        if not m.ok:
            table.add_row(name, f"[red]failed: {m.error}[/red]", "", "", "", "", "")
            continue
        table.add_row(name, f"{m.median:.3f}", f"{res.images_per_s(name):.0f}", f"{100 * m.spread:.0f} %",
                      mb(c.copy_bytes), f"{mb(c.layout_copy_bytes)} in {c.layout_copies} ops",
                      mb(c.arithmetic_bytes))
    console.print(table)
    console.print(f"values: max |torchvision - memlayout| = {res.max_abs_diff:.2e}; strides "
                  + ", ".join(f"{n} {s}" for n, s in res.output_strides.items()))
    console.print("bytes: what torch ops write (TorchDispatchMode, one batch, num_workers=0); JPEG "
                  "decoding and PIL's packing into an array happen in both and are not counted")
    ratio, spread = res.ratio, res.ratio_range
    if ratio is None or spread is None:
        _fail(MemlayoutError("no ratio: a pipeline failed (see the table)"))
    console.print(f"memlayout / torchvision images/s: median per-round ratio [bold]{ratio:.2f}x[/bold] "
                  f"(range {spread[0]:.2f}-{spread[1]:.2f} over {len(res.comparison.ratios('memlayout'))} rounds)")
    if json_path:
        record = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()},
            "torch_threads": torch.get_num_threads(),
            "ratio_median": ratio, "ratio_min": spread[0], "ratio_max": spread[1],
            "max_abs_diff": res.max_abs_diff,
            "pipelines": {n: {"seconds_per_epoch": list(res.comparison[n].times),
                              "images_per_s": res.images_per_s(n),
                              "copy_bytes": res.copies[n].copy_bytes,
                              "layout_copy_bytes": res.copies[n].layout_copy_bytes,
                              "arithmetic_bytes": res.copies[n].arithmetic_bytes,
                              "strides": list(res.output_strides[n])} for n in PIPELINES},
        }
        Path(json_path).write_text(json.dumps(record, indent=2))
        console.print(f"JSON: {json_path}")


@app.command()
def bench(
    models: Annotated[list[str] | None, typer.Argument(metavar="[MODEL_SPEC]...", help="Model specs: torchvision:NAME, timm:NAME or file.py:factory. Default: none (use --zoo).")] = None,
    zoo: Annotated[str | None, typer.Option(help="Add a model zoo: quick (3 small models at 64 px), classification (17 torchvision families) or all (+ segmentation, video, timm if installed). Default: none.")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated modes, nchw (the baseline) required: nchw, nhwc, planned, compile, planned+compile; and nhwc-again, a second copy of nhwc whose ratio to it is the run's noise floor (an A/A control). Default: the first five.")] = "nchw,nhwc,planned,compile,planned+compile",
    dtype: Annotated[str, typer.Option(help="Comma-separated dtypes: fp32, bf16 (torch.autocast). Default: fp32.")] = "fp32",
    task: Annotated[str, typer.Option(help="Comma-separated tasks: infer (no grad), train (forward + backward + SGD step). Default: infer.")] = "infer",
    batch: Annotated[int, typer.Option(help="Batch size; halved and retried on out of memory. Default: 8.")] = 8,
    image_size: Annotated[int | None, typer.Option(help="Image height and width. Default: the zoo's (quick: 64), else the model's own (224; inception_v3 299; video 112).")] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved timed rounds; every mode runs once per round. Default: 7.")] = 7,
    warmup: Annotated[int, typer.Option(help="Untimed calls per mode before the rounds, after the first (compiling) call. Default: 1.")] = 1,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads for the run. Default: torch's current setting.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N. Default: cpu.")] = "cpu",
    compile_backend: Annotated[str, typer.Option(help="torch.compile backend of the compile modes. Default: inductor.")] = "inductor",
    gemm_size: Annotated[int | None, typer.Option(help="Side of the square matmul timed as the GEMM peak. Default: 2048 on CPU, 8192 on CUDA.")] = None,
    plan_costs: Annotated[str, typer.Option(help="Planner costs for the planned modes: measured (on this machine, cached) or analytic (no timing, faster). Default: measured.")] = "measured",
    out: Annotated[str, typer.Option(help="Folder for results.csv, results.json, speedup.png, summary.md, config.json; rewritten after every model x dtype x task, so a stopped run keeps what it measured. Default: bench-results.")] = "bench-results",
    resume: Annotated[bool, typer.Option("--resume", help="Keep the records already in --out and run only the cases missing there (same settings required; more models, dtypes or tasks are fine). Default: off (start over).")] = False,
    steady_heap: Annotated[bool, typer.Option("--steady-heap", help="Keep glibc's heap for the whole run (memlayout.malloc.steady_heap): large CPU tensors stop being unmapped and page-faulted in again every step. Default: off (the allocator as users run it).")] = False,
) -> None:
    """Time every layout strategy on each model, interleaved round by round in one process, and
    report speedups over eager NCHW (median of per-round ratios), FLOP/s and compile times."""
    import shlex
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memlayout.bench import (
        BenchConfig,
        BenchConfigError,
        BenchEvent,
        BenchResult,
        resume_records,
        run_bench,
        write_outputs,
    )
    from memlayout.bench import zoo as zoo_entries
    from memlayout.bench.report import problems, summary_tables

    specs = list(models or [])
    sizes: list[tuple[str, int]] = []
    try:
        if plan_costs not in ("measured", "analytic"):
            raise BenchConfigError(f"--plan-costs {plan_costs!r} is neither measured nor analytic")
        for entry in zoo_entries(zoo) if zoo else ():
            specs.append(entry.spec)
            if entry.image_size:
                sizes.append((entry.spec, entry.image_size))
        cfg = BenchConfig.from_strings(
            list(dict.fromkeys(specs)), modes=modes, dtypes=dtype, tasks=task, batch=batch,
            image_size=image_size, rounds=rounds, warmup=warmup, threads=threads, device=device,
            compile_backend=compile_backend, gemm_size=gemm_size, zoo_sizes=tuple(sizes),
            plan_measure=plan_costs == "measured", steady_heap=steady_heap)
        previous = resume_records(Path(out), cfg) if resume else []
    except MemlayoutError as exc:
        _fail(exc)
    done = {(r.model, r.dtype, r.task) for r in previous}
    if previous:
        console.print(f"--resume: {len(done)} model x dtype x task cases already in {out}, kept")
    command = ["memlayout", "bench", *(models or [])]
    for flag, value, default in (("--zoo", zoo, None), ("--modes", modes, None), ("--dtype", dtype, None),
                                 ("--task", task, None), ("--batch", batch, None),
                                 ("--image-size", image_size, None), ("--rounds", rounds, None),
                                 ("--warmup", warmup, 1), ("--threads", threads, None),
                                 ("--device", device, "cpu"), ("--compile-backend", compile_backend, "inductor"),
                                 ("--gemm-size", gemm_size, None), ("--plan-costs", plan_costs, "measured"),
                                 ("--out", out, None)):
        if value is not None and value != default:
            command += [flag, str(value)]
    command += ["--steady-heap"] if steady_heap else []
    layouts = {"nchw": "eager, contiguous (NCHW) model and input", "nhwc": "eager, model.to(memory_format=channels_last) + channels-last input (channels_last_3d for video)",
               "nhwc-again": "a second copy of nhwc, prepared and timed like it: an A/A control, its ratio to nhwc is the run's noise",
               "planned": f"memlayout.optimize(model, (x,), dtype=..., measure={plan_costs == 'measured'}, input_format='auto'); input in the plan's format", "compile": f"torch.compile(backend={compile_backend!r}) of the NCHW model; Inductor chooses layouts",
               "planned+compile": "memlayout.compile (inference): the plan compiled with Inductor's layout optimization off, or Inductor's own layout unless the plan measures >2% faster; train: torch.compile of the planned model"}
    console.print(f"[bold]memlayout bench[/bold]: {len(cfg.models)} models x {','.join(cfg.dtypes)} x {','.join(cfg.tasks)}, "
                  f"batch {cfg.batch}, {cfg.rounds} interleaved rounds, device {cfg.device}, threads {threads or 'default'}")
    for mode in cfg.modes:
        console.print(f"  {mode:16s} {layouts[mode]}")
    from memlayout.bench.records import Environment

    env_now = Environment.collect(cfg.device)
    if env_now.overloaded:
        advice = ("" if env_now.omp_wait_policy.upper() == "PASSIVE" else
                  f" OpenMP threads spin while waiting (OMP_WAIT_POLICY="
                  f"{env_now.omp_wait_policy or 'unset'}): multi-threaded runs suffer most; "
                  "OMP_WAIT_POLICY=PASSIVE or --threads 1 limits the damage.")
        console.print(f"[yellow]warning[/yellow]: load average {env_now.load_average:.1f} on "
                      f"{env_now.cpu_count} CPUs: other jobs compete for the cores, so timings "
                      f"will be stretched and noisy (summary.md says so).{advice}")

    per_case = len(cfg.modes) * cfg.rounds
    todo = [(m, d, t) for m in cfg.models for d in cfg.dtypes for t in cfg.tasks if (m, d, t) not in done]
    total = len(todo) * per_case
    records = list(previous)
    command_text = shlex.join(command)

    def save(case: list) -> None:  # after every case: a stopped run keeps what it measured
        records.extend(case)
        write_outputs(BenchResult(cfg, case[0].env, tuple(records)), Path(out), command=command_text)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
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

    for table in summary_tables(result.records):
        t = Table(title=f"{table.dtype} {table.task}: speedup over eager NCHW, median of per-round ratios (min-max)")
        for col in table.header:
            t.add_column(col, justify="left" if col == "model" else "right")
        for row in table.rows:
            t.add_row(*row)
        console.print(t)
    for line in problems(result.records):
        console.print("note: " + line, markup=False, highlight=False)
    paths = write_outputs(result, Path(out), command=command_text)
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
    compile: Annotated[bool, typer.Option("--compile", help="memlayout.compile: torch.compile the plan so it stands (Inductor's layout optimization off) or let Inductor decide (kept unless the plan measures >2% faster; cached); then time it against torch.compile's default and eager NCHW. Default: off.")] = False,  # noqa: A002
    train: Annotated[bool, typer.Option("--train", help="Plan a training step: forward + backward costs, gradients verified, training steps (SGD) timed against eager NCHW / NHWC. Default: off (inference).")] = False,
    input_format: Annotated[str | None, typer.Option(help="The format batches arrive in: contiguous (also nchw / ncdhw), channels_last (also nhwc; channels_last_3d / ndhwc for video), or auto (the plan chooses; deliver them so, as memlayout.data's loader can). The speed comparison gives every model its input in this format. Default: as the example is built (contiguous).")] = None,
) -> None:
    """Plan NCHW / channels-last per operation from costs measured here, verify the planned
    model equal to the original, and time it against eager NCHW and eager NHWC (with
    --compile: against torch.compile's default and eager NCHW)."""
    import torch
    from rich.progress import Progress

    from memlayout.dtypes import dtype_name, parse_dtype
    from memlayout.errors import PlanError
    from memlayout.models import load_model
    from memlayout.plan.compare import compare_with_eager
    from memlayout.plan.pipeline import format_label
    from memlayout.plan.pipeline import optimize as plan_model
    from memlayout.tensors import format_name, format_of

    try:  # the options first: a bad one is reported before any model is built
        run_dtype = parse_dtype(dtype)
        if input_format is not None and input_format.strip().lower() != "auto":
            format_label(input_format, "input_format")
        run_device = device.strip().lower()
        if not (run_device == "cpu" or run_device == "cuda"
                or (run_device.startswith("cuda:") and run_device[5:].isdigit())):
            raise PlanError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
        if run_device != "cpu" and not torch.cuda.is_available():
            raise PlanError(f"--device {device!r}: CUDA is not available here; use --device cpu")
    except MemlayoutError as exc:
        _fail(exc)
    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        module = spec.module.to(run_device)
        example = spec.example_input.to(run_device)
        task_name = "training step" if train else "inference"
        console.print(f"{model}: input {tuple(example.shape)} ({format_name(format_of(example))}"
                      f" as built), {dtype_name(run_dtype)}, {task_name}, device {run_device}, "
                      f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("measuring", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=f"measuring {what}")

            if compile:
                from memlayout.plan.compiled import compile as plan_and_compile

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
        _fail(exc)
    plan = opt.plan
    if explain:
        plan.explain(console)  # ends with the summary
    else:
        console.print(plan.summary(), markup=False, highlight=False)
    if plan.input_format is None:
        arrives = f"{format_name(format_of(example))}, as built"
    else:
        how = ("chosen by the plan (--input-format auto)" if input_format.strip().lower() == "auto"
               else f"--input-format {input_format}")
        arrives = (f"{plan.input_format} ({how}; the speed comparison hands every model its "
                   "input so, and the planned model converts an input that arrives otherwise)")
    console.print(f"input arrives {arrives}", markup=False, highlight=False)
    if plan.verification is not None:
        console.print(plan.verification.describe(), markup=False, highlight=False)
    if save:
        from pathlib import Path

        Path(save).write_text(plan.to_json())
        console.print(f"plan written to {save}")
    if rounds > 0 and compile:
        from memlayout.plan.compiled import compare_compiled

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
    device: Annotated[str, typer.Option(help="Device: cpu or cuda. Default: cpu.")] = "cpu",
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
    import shlex
    import sys
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memlayout.coverage import CoverageConfig, document, run_coverage, save_to_cache, write_json
    from memlayout.coverage.render import summary_line
    from memlayout.layout import Format

    try:
        config = CoverageConfig(
            device=device, dtypes=tuple(d.strip() for d in dtype.split(",") if d.strip()),
            fmt=Format.parse(format), ops=ops, max_samples=max_samples, jobs=jobs,
            op_timeout=op_timeout)
        command = "memlayout " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            task = progress.add_task("starting (importing OpInfo)", total=None)

            def on_record(dt: str, rec) -> None:
                progress.update(task, advance=1, description=f"{dt} {rec.name[:36]:<36}")

            reports = run_coverage(config, command=command,
                                   on_start=lambda n: progress.update(task, total=n),
                                   on_record=on_record)
    except MemlayoutError as exc:
        _fail(exc)
    out_dir = Path(out)
    write_json(reports, out_dir / "coverage.json")
    (out_dir / "coverage.md").write_text(document(reports))
    for r in reports:
        console.print(f"[bold]{r.device} {r.dtype} {r.fmt}[/bold], torch {r.torch_version}: "
                      f"{len(r.ops)} ops in {r.seconds:g} s")
        console.print(f"  forward:  {summary_line(r, 'forward')}")
        console.print(f"  backward: {summary_line(r, 'backward')}")
        bad = r.disagreements()
        if bad:
            console.print(f"  [bold red]{len(bad)} value disagreements (bugs in torch or memlayout):[/bold red]")
            for name, d in bad:
                console.print(f"    {name} sample {d.sample} {d.what}: max abs err {d.max_abs:.3g} "
                              f"({d.mismatched}/{d.numel}) on {d.call}")
        if cache:
            console.print(f"  cached: {save_to_cache(r)}")
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
    checkpoint: Annotated[str | None, typer.Option(help="Folder for latest.pt, written atomically at each epoch's end and the last step (rank 0). Default: none.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --checkpoint's latest.pt (model, optimizer, step, RNG). Default: off.")] = False,
    image_size: Annotated[int, typer.Option(help="Image height and width (images are resized to it). Default: 64.")] = 64,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes. Default: 0.")] = 0,
    log_every: Annotated[int, typer.Option(help="Steps per log line (and per timed interval of --compare). Default: 10.")] = 10,
    compare: Annotated[str | None, typer.Option(help="Comma-separated layouts (e.g. nchw,planned) trained side by side in this process, interval by interval (memlayout.timing.interleaved); prints images/s and per-round ratios over the first. Default: off.")] = None,
    rounds: Annotated[int, typer.Option(help="Timed intervals per layout with --compare. Default: 7.")] = 7,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps in all. Default: epochs x steps per epoch.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (under torchrun: cuda:LOCAL_RANK). Default: cpu.")] = "cpu",
    plan_costs: Annotated[str, typer.Option(help="Planner costs for --layout planned: measured (cached) or analytic. Default: measured.")] = "measured",
    sync_bn: Annotated[bool, typer.Option("--sync-bn", help="SyncBatchNorm under torchrun (CUDA only). Default: off.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the weights, data order and dropout. Default: 0.")] = 0,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads per process (1 is steadier on a loaded machine). Default: torch's setting (torchrun: 1).")] = None,
) -> None:
    """Train an image classifier (reference loop) in one layout, on one process or under
    torchrun (DDP); print images/s, loss and accuracy per interval."""
    import statistics

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memlayout.train import (
        TrainConfig,
        Trainer,
        compare_layouts,
        init_distributed,
        make_synthetic,
    )
    from memlayout.train.ddp import barrier, shutdown
    from memlayout.train.loop import IntervalLog

    out = console
    try:
        if plan_costs not in ("measured", "analytic"):
            raise MemlayoutError(f"--plan-costs {plan_costs!r} is neither measured nor analytic")
        if threads is not None:
            torch.set_num_threads(threads)
        info = init_distributed(device)
        if not info.is_main:
            out = Console(quiet=True)
        if synthetic is not None:
            if info.is_main:
                make_synthetic(data, synthetic, size=image_size, seed=seed)
            barrier(info)
        cfg = TrainConfig(model, data, epochs=epochs, batch=batch, dtype=dtype, layout=layout, lr=lr,
                          checkpoint=checkpoint, resume=resume, image_size=image_size,
                          workers=workers, log_every=log_every, seed=seed, max_steps=max_steps,
                          device=device, plan_measure=plan_costs == "measured", sync_batchnorm=sync_bn)
        cfg.check()
        where = (f"{info.world_size} processes (torchrun, DDP {'nccl' if device.startswith('cuda') else 'gloo'})"
                 if info.distributed else "1 process")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=out, transient=False) as progress:
            bar = progress.add_task("building", total=None)

            def on_event(event: object) -> None:
                if isinstance(event, IntervalLog):
                    progress.console.print(
                        f"[{event.layout}] Epoch: [{event.epoch}][{event.step_in_epoch:>4}/{event.steps_per_epoch}]  "
                        f"Time {event.seconds:7.3f} s  Speed {event.images_per_second:8.1f} img/s  "
                        f"Loss {event.loss:.4f}  Acc@1 {event.accuracy:6.2f}", markup=False, highlight=False)
                    progress.update(bar, completed=event.step, total=event.total_steps,
                                    description=f"{event.layout} epoch {event.epoch}")
                else:
                    progress.console.print(str(event), markup=False, highlight=False)

            if compare:
                layouts = [s.strip() for s in compare.split(",") if s.strip()]
                progress.update(bar, total=rounds * len(layouts), completed=0)
                out.print(f"memlayout train {model} --compare {','.join(layouts)}: {dtype}, batch {batch} per process x {where}, "
                          f"{image_size} px, {log_every} steps per interval, 1 warm-up + {rounds} interleaved rounds, "
                          f"device {device}, torch threads {torch.get_num_threads()}", markup=False, highlight=False)
                steps = [0]

                def on_step(r: int, name: str) -> None:
                    steps[0] += 1
                    progress.update(bar, completed=steps[0] - 1, description=f"round {r + 1}/{rounds} {name}")

                result = compare_layouts(cfg, layouts, rounds=rounds, dist_info=info,
                                         on_event=on_event, on_step=on_step)
                progress.update(bar, completed=rounds * len(layouts), description="done")
            else:
                trainer = Trainer(cfg, info, on_event)
                out.print(f"memlayout train {model}: layout {layout}, {dtype}, batch {batch} per process x {where}, "
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
    if compare:
        c = result.comparison
        base = layouts[0]
        table = Table(title=f"images/s per layout, {result.steps_per_interval} steps x {batch} images x "
                            f"{info.world_size} processes per interval (median of {rounds} interleaved rounds)")
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
        out.print(table)
        for name in layouts[1:]:
            if c[name].ok and c.speedup(name) is not None:
                lo, hi = c.speedup_range(name)
                out.print(f"ratio {name}/{base} images/s: {c.speedup(name):.3f}x (median of "
                          f"{len(c.ratios(name))} per-round ratios, range {lo:.3f}-{hi:.3f})",
                          markup=False, highlight=False)
    else:
        later = [i.images_per_second for i in run.intervals[1:]] or [i.images_per_second for i in run.intervals]
        if later:
            out.print(f"{run.step - run.start_step} steps; images/s per interval (all processes, "
                      f"first interval left out as warm-up): median {statistics.median(later):.1f}, "
                      f"range {min(later):.1f}-{max(later):.1f}; final loss {run.intervals[-1].loss:.4f}",
                      markup=False, highlight=False)
        if run.checkpoint:
            out.print(f"checkpoint: {run.checkpoint}", markup=False, highlight=False)
    shutdown(info)


if __name__ == "__main__":
    app()
