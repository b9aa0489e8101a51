"""``memlayout optimize``: plan, verify and time a model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
import typer
from rich.progress import Progress

from memlayout import machine
from memlayout.cli.app import app
from memlayout.cli.common import (
    UsageError,
    at_least,
    bf16_notice,
    check_device,
    console,
    debug_log,
    fail,
    on_device,
    print_measuring_conditions,
    writable_file,
)
from memlayout.dtypes import dtype_name, parse_dtype
from memlayout.errors import MemlayoutError
from memlayout.models import load_model
from memlayout.tensors import format_name, format_of, iter_tensors

if TYPE_CHECKING:
    from memlayout.plan.report.compare import ModelComparison


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
    plan_file: Annotated[str | None, typer.Option("--plan", help="Apply this saved plan (--save) instead of measuring: checked against the model and this torch, verified; its input shape, dtype, input format and train/inference are the plan's. Default: none (plan here).")] = None,
) -> None:
    """Plan NCHW / channels-last per operation from costs measured here, verify the planned
    model equal to the original, and time it against eager NCHW and eager NHWC (with
    --compile: against torch.compile's default and eager NCHW)."""
    from memlayout.plan.apply import apply as apply_plan
    from memlayout.plan.apply import read_plan
    from memlayout.plan.inputs import example_inputs_of, format_label, keyword_call
    from memlayout.plan.pipeline import optimize as plan_model
    from memlayout.plan.report.compare import compare_with_eager

    debug_log(ctx, debug)
    try:  # the options first: a bad one is reported before any model is built
        run_dtype = parse_dtype(dtype)
        if input_format is not None and input_format.strip().lower() != "auto":
            format_label(input_format, "input_format")
        run_device = check_device(device)
        at_least(1, batch=batch, image_size=image_size)
        at_least(0, rounds=rounds)
        if save:
            writable_file("--save", Path(save))
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
        if saved is None and run_dtype is torch.bfloat16:
            padding = _bounded_for_bf16(ctx, run_device, measure=measure, compile=compile,
                                        padding=padding)
    except MemlayoutError as exc:
        fail(exc)
    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        # keyword inputs become trailing positional ones: every step and timer below passes
        # one tuple (memlayout.plan.inputs.KeywordCall)
        module, example = keyword_call(
            spec.module.to(run_device), on_device(example_inputs_of(spec.example_input),
                                                   run_device),
            on_device(spec.example_kwargs, run_device))
        first = next(iter_tensors(example))
        task_name = "training step" if train else "inference"
        shapes = ", ".join(str(tuple(t.shape)) for t in iter_tensors(example))
        console.print(f"{model}: input {shapes} ({format_name(format_of(first))}"
                      f" as built), {dtype_name(run_dtype)}, {task_name}, device {run_device}, "
                      f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
        if spec.note:
            console.print(f"note: {spec.note}", markup=False, highlight=False)
        print_measuring_conditions(measure)
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
        fail(exc, debug=debug)
    plan = opt.plan
    if explain:
        plan.explain(console, full=debug)  # ends with the summary
    else:
        console.print(plan.summary(full=debug), markup=False, highlight=False)
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
            fail(UsageError(f"--save {save}: the plan could not be written ({exc.strerror}); "
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


def _bounded_for_bf16(ctx: typer.Context, device: str, *, measure: bool, compile: bool,  # noqa: A002
                      padding: bool) -> bool:
    """Where bf16 is emulated (measured), say so before any work and keep the work bounded:
    ``--compile`` is refused (Inductor's bf16 builds run for many minutes there), the padding
    candidates (which multiply the measurements) are off unless ``--padding`` is given.
    Returns the padding to plan with."""
    given = ctx.get_parameter_source("padding").name not in ("DEFAULT", "DEFAULT_MAP")
    speed = machine.bf16_speed(device)
    if not speed.emulated:
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
