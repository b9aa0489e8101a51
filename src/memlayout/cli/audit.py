"""``memlayout audit``: every op that drops channels-last, forward and backward."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from memlayout.audit import render as audit_render
from memlayout.audit.overhead import overhead as measure_overhead
from memlayout.audit.recorder import audit as run_audit
from memlayout.cli.app import app
from memlayout.cli.common import (
    DEVICE_HELP,
    MODEL_HELP,
    at_least,
    check_device,
    check_dtype,
    console,
    fail,
    on_device,
    print_conditions,
)
from memlayout.errors import MemlayoutError
from memlayout.layout import Format
from memlayout.machine import Conditions
from memlayout.models import load_model
from memlayout.tensors import iter_tensors


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
        dtype = check_dtype(dtype)
        fmt = Format.parse(format) if format else None
        at_least(1, batch=batch, image_size=image_size, top=top, rounds=rounds)
        device = check_device(device)
    except MemlayoutError as exc:
        fail(exc)
    if overhead:
        print_conditions(Conditions.now())
    try:
        spec = load_model(model, batch=batch, image_size=image_size)
        fmt = fmt or spec.fmt
        module = spec.module.to(device).train(train)
        inputs = on_device(spec.example_input, device)
        kwargs = on_device(spec.example_kwargs, device)
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
        fail(exc)
    runs_on = _input_words(inputs, kwargs)
    if overhead:
        what = "forward+backward" if train else "forward"
        audit_render.render_overhead(c, console, f"{model} {runs_on} {fmt.value} {dtype} {what}")
        return
    title = f"memlayout audit {model} ({'train' if train else 'inference'}, {runs_on})"
    audit_render.render_terminal(report, console, title=title, top=top)
    if json_path:
        audit_render.write_json(report, json_path)
        console.print(f"JSON report: {json_path}")
    if html_path:
        audit_render.write_html(report, html_path, title=title)
        console.print(f"HTML report: {html_path}")


def _input_words(inputs: Any, kwargs: dict[str, Any]) -> str:
    """``batch 8``, read from the input that runs (a factory's own input keeps its batch,
    whatever ``--batch`` says), with its shape when it is not one image-like tensor."""
    tensors = list(iter_tensors((inputs, kwargs)))
    if not tensors or tensors[0].dim() == 0:
        return "no tensor input"
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
    if len(tensors) == 1 and tensors[0].dim() in (4, 5):
        return f"batch {tensors[0].shape[0]}"
    return f"batch {tensors[0].shape[0]}, inputs {shapes}"
