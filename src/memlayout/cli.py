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

if __name__ == "__main__":
    app()
