"""``memlayout bench-data``: the channels-last data pipeline against torchvision's recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer

from memlayout.cli.app import app
from memlayout.cli.common import at_least, check_device, console, fail, print_conditions
from memlayout.errors import MemlayoutError
from memlayout.machine import Conditions


@app.command("bench-data")
def bench_data(
    images: Annotated[int, typer.Option(help="Synthetic JPEGs in the folder; one timed sample is one epoch over them. Default: 256.")] = 256,
    size: Annotated[int, typer.Option(help="Image height and width in pixels. Default: 224.")] = 224,
    workers: Annotated[int, typer.Option(help="DataLoader num_workers, for both pipelines. Default: 0.")] = 0,
    batch: Annotated[int, typer.Option(help="Batch size. Default: 64.")] = 64,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds. Default: 7.")] = 7,
    threads: Annotated[int | None, typer.Option(help="torch.set_num_threads in the main process. Default: torch's own.")] = None,
    cache_dir: Annotated[str | None, typer.Option(help="Folder for the JPEGs, made once and reused. Default: $MEMLAYOUT_CACHE_DIR/bench-data, else $XDG_CACHE_HOME/memlayout/bench-data.")] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here. Default: none.")] = None,
    device: Annotated[str, typer.Option(help="Where the normalized batch goes (cpu, cuda, cuda:N). Default: cpu.")] = "cpu",
) -> None:
    """Images/s from JPEG files to a normalized float32 channels-last batch: the torchvision
    recipe (ToTensor, Normalize, default collate, .to(channels_last)) vs memlayout.data,
    interleaved in one run, and the bytes each writes per batch."""
    from memlayout.data.bench import DataBenchConfig, run_data_bench
    from memlayout.data.render import render_terminal, to_record

    try:
        at_least(1, images=images, size=size, batch=batch, rounds=rounds, threads=threads)
        at_least(0, workers=workers)
        device = check_device(device)
    except MemlayoutError as exc:
        fail(exc)
    if threads is not None:
        torch.set_num_threads(threads)
    config = DataBenchConfig(images=images, size=size, batch=batch, workers=workers, rounds=rounds,
                             cache_dir=Path(cache_dir) if cache_dir else None, device=device)
    console.print(f"{images} synthetic {size}x{size} JPEGs, batch {batch}, workers {workers}, "
                  f"torch threads {torch.get_num_threads()}, {rounds} interleaved rounds of one epoch each")
    print_conditions(Conditions.now())
    try:
        res = run_data_bench(config)
    except MemlayoutError as exc:
        fail(exc)
    render_terminal(res, console)
    if res.ratio is None:
        fail(MemlayoutError("no ratio: a pipeline failed (see the table)"))
    if json_path:
        Path(json_path).write_text(json.dumps(to_record(res, torch.get_num_threads()), indent=2))
        console.print(f"JSON: {json_path}")
