"""``memlayout coverage``: which ops keep channels-last on this build."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from memlayout.cli.app import app
from memlayout.cli.common import (
    DEVICE_HELP,
    UsageError,
    at_least,
    check_device,
    console,
    fail,
    progress_bar,
)
from memlayout.errors import MemlayoutError
from memlayout.layout import Format


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
        at_least(1, max_samples=max_samples)
        at_least(0, jobs=jobs)
        if op_timeout <= 0:
            raise UsageError(f"--op-timeout must be > 0, got {op_timeout:g}")
        config = CoverageConfig(
            device=check_device(device), dtypes=tuple(d.strip() for d in dtype.split(",") if d.strip()),
            fmt=Format.parse(format), ops=ops, max_samples=max_samples, jobs=jobs,
            op_timeout=op_timeout)
    except MemlayoutError as exc:
        fail(exc)
    command = "memlayout " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        with progress_bar(console) as progress:
            task = progress.add_task("starting (importing OpInfo)", total=None)

            def on_record(dt: str, rec: Any) -> None:
                progress.update(task, advance=1, description=f"{dt} {rec.name[:36]:<36}")

            reports = run_coverage(config, command=command,
                                   on_start=lambda n: progress.update(task, total=n),
                                   on_record=on_record)
    except MemlayoutError as exc:
        fail(exc)
    out_dir = Path(out)
    write_json(reports, out_dir / "coverage.json")
    (out_dir / "coverage.md").write_text(document(reports))
    cached = {i: save_to_cache(r) for i, r in enumerate(reports)} if cache else None
    render_terminal(reports, console, cached)
    console.print(f"wrote {out_dir / 'coverage.json'} and {out_dir / 'coverage.md'}")
