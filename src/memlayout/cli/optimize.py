"""``memlayout optimize``: plan, verify and time a model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
import typer
from rich.progress import Progress
from torch import nn

from memlayout.cli.app import app
from memlayout.cli.common import (
    CUDNN_BENCHMARK_HELP,
    UsageError,
    at_least,
    bf16_notice,
    check_device,
    console,
    cudnn_benchmark,
    debug_log,
    fail,
    on_device,
    print_measuring_conditions,
    writable_file,
)
from memlayout.devices import seam
from memlayout.dtypes import dtype_name, parse_dtype
from memlayout.errors import MemlayoutError
from memlayout.models import load_model
from memlayout.tensors import format_name, format_of, iter_tensors

if TYPE_CHECKING:
    from memlayout.plan.check.speed import ModelComparison
    from memlayout.plan.options import PlanOptions
    from memlayout.plan.report.plan import Plan


@app.command()
def optimize(
    ctx: typer.Context,
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
    debug: Annotated[bool, typer.Option("--debug", help="Also print torch's whole text of why a part is not captured, what torch printed while capturing (on stderr), and on an error the traceback of its cause (a factory that raised, a capture that failed). Default: off.")] = False,
    cudnn: Annotated[bool, typer.Option("--cudnn-benchmark", help=CUDNN_BENCHMARK_HELP)] = False,
    plan_file: Annotated[str | None, typer.Option("--plan", help="Apply this saved plan (--save) instead of measuring: checked against the model and this torch, verified; its input shape, dtype, input format and train/inference are the plan's. Default: none (plan here).")] = None,
) -> None:
    """Plan NCHW / channels-last per operation from costs measured here, verify the planned
    model equal to the original, and time it against eager NCHW and eager NHWC (with
    --compile: against torch.compile's default and eager NCHW)."""
    debug_log(ctx, debug)
    cudnn_benchmark(cudnn)
    flags = _Flags(model=model, dtype=dtype, batch=batch, image_size=image_size, device=device,
                   save=save, measure=measure, explain=explain, rounds=rounds, cache=cache,
                   guard=guard, refresh=refresh, memory_budget=memory_budget, padding=padding,
                   compile=compile, train=train, input_format=input_format, debug=debug,
                   plan_file=plan_file)
    try:  # the options first: a bad one is reported before any model is built
        flags = _checked(ctx, flags)
    except MemlayoutError as exc:
        fail(exc)
    try:
        module, example = _model(flags)
        opt = _plan(module, example, flags)
    except MemlayoutError as exc:
        fail(exc, debug=debug)
    _report(opt.plan, example, flags)
    if flags.rounds > 0 and flags.compile:
        from memlayout.plan.compilers.compiled import compare_compiled

        _print_comparison(compare_compiled(module, opt, example, rounds=flags.rounds), "batch")
    elif flags.rounds > 0:
        from memlayout.plan.check.speed import compare_with_eager

        result = compare_with_eager(module, opt, example, rounds=flags.rounds, train=flags.train)
        unit = "training step (forward, backward, SGD)" if flags.train else "batch"
        _print_comparison(result, unit)


@dataclass(frozen=True)
class _Flags:
    """``optimize``'s flags. :func:`_checked` adds ``run_dtype`` (the autocast dtype), the
    ``options`` ``memlayout.optimize`` is given and, with ``--plan``, the ``saved`` plan, whose
    example (shape, dtype, input format, task) replaces the flags'."""

    model: str
    dtype: str
    batch: int
    image_size: int | None
    device: str
    save: str | None
    measure: bool
    explain: bool
    rounds: int
    cache: bool
    guard: bool
    refresh: bool
    memory_budget: str | None
    padding: bool
    compile: bool
    train: bool
    input_format: str | None
    debug: bool
    plan_file: str | None
    run_dtype: torch.dtype | None = None
    options: PlanOptions | None = None
    saved: Plan | None = None


def _checked(ctx: typer.Context, flags: _Flags) -> _Flags:
    """``flags`` checked (a ``UsageError`` or ``MemlayoutError`` names the bad one), the
    dtype parsed, the planner's options made, the saved plan read; bf16 bounded where it is
    emulated."""
    run_dtype = parse_dtype(flags.dtype)
    options = _plan_options(flags)
    device = check_device(flags.device)
    at_least(1, batch=flags.batch, image_size=flags.image_size)
    at_least(0, rounds=flags.rounds)
    if flags.save:
        writable_file("--save", Path(flags.save))
    flags = replace(flags, run_dtype=run_dtype, device=device, options=options)
    if flags.plan_file is not None:
        return _from_saved(flags)
    if run_dtype is torch.bfloat16:
        padding = _bounded_for_bf16(ctx, device, measure=flags.measure, compile=flags.compile,
                                    padding=flags.padding)
        return replace(flags, padding=padding, options=replace(options, padding=padding))
    return flags


def _plan_options(flags: _Flags) -> PlanOptions:
    """What the flags ask ``memlayout.optimize`` for (``PlanError`` names a bad option)."""
    from memlayout.plan.options import PlanOptions

    return PlanOptions(dtype=flags.dtype, input_format=flags.input_format, measure=flags.measure,
                       cache=flags.cache, name=flags.model, guard=flags.guard,
                       refresh=flags.refresh, memory_budget=flags.memory_budget,
                       padding=flags.padding, train=flags.train)


def _from_saved(flags: _Flags) -> _Flags:
    """``--plan FILE``: the saved plan, and its example's shape, dtype, input format and task
    in place of the flags'."""
    from memlayout.plan.apply import read_plan

    if flags.compile:
        raise UsageError("--plan applies a saved layout plan; --compile plans and "
                         "compiles here: use one of them")
    saved = read_plan(Path(flags.plan_file))  # type: ignore[arg-type]
    if len(saved.input_shapes) != 1 or len(saved.input_shapes[0]) < 3:
        raise UsageError(f"--plan {flags.plan_file}: made for inputs {saved.input_shapes}; "
                         "the command builds one image-like input")
    shape = saved.input_shapes[0]
    dtype = saved.dtype or "fp32"
    return replace(flags, saved=saved, batch=shape[0], image_size=shape[-1], train=saved.train,
                   dtype=dtype, run_dtype=parse_dtype(dtype), input_format=saved.input_format)


def _model(flags: _Flags) -> tuple[nn.Module, tuple[Any, ...]]:
    """The model and its example inputs on the device, after a line saying what runs."""
    from memlayout.plan.inputs import example_inputs_of, keyword_call

    spec = load_model(flags.model, batch=flags.batch, image_size=flags.image_size)
    # keyword inputs become trailing positional ones: every step and timer below passes
    # one tuple (memlayout.plan.inputs.KeywordCall)
    module, example = keyword_call(
        spec.module.to(flags.device), on_device(example_inputs_of(spec.example_input),
                                                flags.device),
        on_device(spec.example_kwargs, flags.device))
    first = next(iter_tensors(example))
    task_name = "training step" if flags.train else "inference"
    shapes = ", ".join(str(tuple(t.shape)) for t in iter_tensors(example))
    console.print(f"{flags.model}: input {shapes} ({format_name(format_of(first))}"
                  f" as built), {dtype_name(flags.run_dtype)}, {task_name}, device {flags.device}, "
                  f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
    if spec.note:
        console.print(f"note: {spec.note}", markup=False, highlight=False)
    return module, example


def _plan(module: nn.Module, example: tuple[Any, ...], flags: _Flags) -> nn.Module:
    """The planned model: the saved plan applied, memlayout.compile's choice (``--compile``),
    or a plan made here; a progress bar while costs are measured."""
    from memlayout.plan.apply import apply as apply_plan
    from memlayout.plan.pipeline import optimize as plan_model

    print_measuring_conditions(flags.measure)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("measuring", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"measuring {what}")

        if flags.saved is not None:
            return apply_plan(module, flags.saved, example)
        if flags.compile:
            from memlayout.plan.compilers.compiled import compile as plan_and_compile

            return plan_and_compile(module, example, dtype=flags.dtype, measure=flags.measure,
                                    cache=flags.cache, progress=progress, name=flags.model,
                                    guard=flags.guard, input_format=flags.input_format,
                                    plan_kwargs={"refresh": flags.refresh})
        assert flags.options is not None  # made by _checked
        return plan_model(module, example, options=replace(flags.options, progress=progress))


def _report(plan: Plan, example: tuple[Any, ...], flags: _Flags) -> None:
    """The plan (``--explain``: every node's choice), the format inputs arrive in, the
    verification; the plan written to ``--save``."""
    if flags.explain:
        plan.explain(console)  # ends with the summary
    else:
        console.print(plan.summary(), markup=False, highlight=False)
    if plan.input_format is None:
        arrives = f"{format_name(format_of(next(iter_tensors(example))))}, as built"
    else:
        how = ("chosen by the plan (--input-format auto)"
               if flags.input_format.strip().lower() == "auto"  # type: ignore[union-attr]
               else f"--input-format {flags.input_format}")
        arrives = (f"{plan.input_format} ({how}; the speed comparison hands every model its "
                   "input so, and the planned model converts an input that arrives otherwise)")
    console.print(f"input arrives {arrives}", markup=False, highlight=False)
    if plan.verification is not None:
        console.print(plan.verification.describe(), markup=False, highlight=False)
    if flags.save:
        try:
            Path(flags.save).write_text(plan.to_json())
        except OSError as exc:
            fail(UsageError(f"--save {flags.save}: the plan could not be written "
                            f"({exc.strerror}); it is printed above"))
        console.print(f"plan written to {flags.save}")


def _bounded_for_bf16(ctx: typer.Context, device: str, *, measure: bool, compile: bool,  # noqa: A002
                      padding: bool) -> bool:
    """Where bf16 is emulated (measured), say so before any work and keep the work bounded:
    ``--compile`` is refused (Inductor's bf16 builds run for many minutes there), the padding
    candidates (which multiply the measurements) are off unless ``--padding`` is given.
    Returns the padding to plan with."""
    given = ctx.get_parameter_source("padding").name not in ("DEFAULT", "DEFAULT_MAP")
    speed = seam(device).bf16()
    if speed is None or not speed.emulated:
        return padding
    if compile:
        raise UsageError(f"--compile --dtype bf16: {speed.describe()}; Inductor's bf16 "
                         "candidates would build for many minutes to time what no CPU with bf16 "
                         "instructions does: use --dtype fp32, or plan without --compile")
    off = measure and padding and not given
    then = ("every cost is measured in emulated bf16, several times slower than fp32"
            + ("; the padding candidates are off (--padding times them all the same), "
               "--no-measure plans from the analytical model in seconds" if off else ""))
    bf16_notice("bf16", device, then)
    return padding and not off


def _print_comparison(result: ModelComparison, unit: str) -> None:
    """Each mode's median time, then the base mode against each other one (the ratio of the
    medians shown, with the per-round ratios' median and range), and a warning when noisy."""
    for line in result.lines(unit):
        console.print(line, markup=False, highlight=False)
