"""``memlayout inspect``: the format of each parameter and module output after a channels-last run."""

from __future__ import annotations

from typing import Annotated

import typer

from memlayout import inspection
from memlayout.cli.app import app
from memlayout.cli.common import (
    DEVICE_HELP,
    MODEL_HELP,
    at_least,
    check_device,
    console,
    fail,
    on_device,
)
from memlayout.errors import MemlayoutError
from memlayout.models import load_model
from memlayout.tensors import iter_tensors


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    batch: Annotated[int, typer.Option(help="Batch size of the random input. Default: 2.")] = 2,
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; inception_v3 299; video 112).")] = None,
    device: Annotated[str, typer.Option(help=f"Device to run on: {DEVICE_HELP}")] = "cpu",
) -> None:
    """Run MODEL once in channels-last and show the format of its parameters and module outputs."""
    try:
        at_least(1, batch=batch, image_size=image_size)
        device = check_device(device)
        spec = load_model(model, batch=batch, image_size=image_size)
        inputs = on_device(spec.example_input, device)
        report = inspection.inspect_model(spec.module.to(device), inputs, spec.fmt,
                                          kwargs=on_device(spec.example_kwargs, device))
    except MemlayoutError as exc:
        fail(exc)
    if spec.note:
        console.print(f"note: {spec.note}", markup=False, highlight=False)
    first = next(iter_tensors(spec.example_input))
    inspection.render_terminal(report, console, model=model, input_shape=tuple(first.shape))
