"""The ``memlayout`` command (L3): one verb per capability; parse -> call -> render."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from memlayout.errors import MemlayoutError

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
    image_size: Annotated[int | None, typer.Option(help="Image size. Default: the model's own (224; video 112).")] = None,
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


if __name__ == "__main__":
    app()
