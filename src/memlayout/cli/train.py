"""``memlayout train``: the reference training loop in one layout, or several compared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import torch
import typer
from rich.console import Console
from rich.progress import Progress, TaskID

from memlayout.cli.app import app
from memlayout.cli.common import (
    PLAN_COSTS,
    at_least,
    bf16_notice,
    check_device,
    check_dtype,
    choice,
    console,
    fail,
    print_conditions,
    progress_bar,
)
from memlayout.errors import MemlayoutError
from memlayout.machine import Conditions

if TYPE_CHECKING:
    from memlayout.train import LayoutComparison, TrainConfig, TrainResult
    from memlayout.train.ddp import DistInfo


#: ``memlayout train`` flags -> the setting each gives (those a resumed run may take from its
#: checkpoint when they are not on the command line: ``memlayout.train.config.RESUMED``)
_FLAG_SETTINGS = {"lr": "lr", "batch": "batch", "epochs": "epochs", "dtype": "dtype",
                  "layout": "layout", "image_size": "image_size", "seed": "seed",
                  "sync_bn": "sync_batchnorm", "plan_costs": "plan_measure"}


@app.command()
def train(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Classification model spec: torchvision:NAME, timm:NAME or file.py:factory.")],
    data: Annotated[str, typer.Option(help="ImageFolder (one sub-folder per class); with --synthetic, where it is written. Default: memlayout-synthetic.")] = "memlayout-synthetic",
    synthetic: Annotated[int | None, typer.Option(help="Write N synthetic JPEGs (4 classes, PIL, at --image-size) into --data first; nothing is downloaded. Default: off.")] = None,
    epochs: Annotated[int, typer.Option(help="Epochs. Default: 1.")] = 1,
    batch: Annotated[int, typer.Option(help="Batch size per process. Default: 32.")] = 32,
    dtype: Annotated[str, typer.Option(help="fp32, or bf16 / fp16 under autocast. Default: fp32.")] = "fp32",
    layout: Annotated[str, typer.Option(help="nchw (torchvision's usual path), nhwc (channels-last model + memlayout's channels-last data pipeline) or planned (memlayout.optimize(train=True) + the pipeline). Default: nhwc.")] = "nhwc",
    lr: Annotated[float, typer.Option(help="SGD learning rate (momentum 0.9). Default: 0.01.")] = 0.01,
    checkpoint: Annotated[str | None, typer.Option(help="Folder for latest.pt, written atomically at each epoch's end and the last step (rank 0), locked by this run (one writer per folder); its parent must exist. Default: none.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --checkpoint's latest.pt (model, optimizer, step, RNG); the settings not given again (--lr, --batch, --epochs, --dtype, --layout, --image-size, --seed, --sync-bn, --plan-costs) are the checkpoint's, those given win, and a note names every one that differs. Default: off.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the checkpoint --checkpoint holds (a run without --resume or --overwrite refuses to). Default: off.")] = False,
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
    compile: Annotated[str, typer.Option("--compile", help="none, inductor (torch.compile) or backend (torch.compile with memlayout's backend: each graph planned from --plan-costs, verified, timed against Inductor's own layouts; under torchrun rank 0 measures and every rank compiles its plan, and the run ends saying whether the ranks' plans agree). With --layout nhwc or nchw. Default: none.")] = "none",
) -> None:
    """Train an image classifier (reference loop) in one layout, on one process or under
    torchrun (DDP or FSDP); print images/s, loss and accuracy per interval."""
    from memlayout.train import TrainConfig, init_distributed
    from memlayout.train.ddp import shutdown
    from memlayout.train.render import render_comparison, render_run

    layouts = [s.strip() for s in compare.split(",") if s.strip()] if compare else []
    try:
        choice("--plan-costs", plan_costs, PLAN_COSTS)
        at_least(1, synthetic=synthetic, rounds=rounds, max_steps=max_steps, threads=threads)
        cfg = TrainConfig(model, data, epochs=epochs, batch=batch, dtype=check_dtype(dtype), layout=layout,
                          lr=lr, checkpoint=checkpoint, resume=resume, overwrite=overwrite,
                          image_size=image_size, workers=workers, log_every=log_every, seed=seed,
                          max_steps=max_steps, device=check_device(device),
                          plan_measure=plan_costs == "measured", sync_batchnorm=sync_bn,
                          timeout=timeout, strategy=strategy, compile=compile)
        cfg, taken = _checked(ctx, cfg, layouts)
    except MemlayoutError as exc:
        fail(exc)
    out = console
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        info = init_distributed(cfg.device, timeout=cfg.timeout)
    except MemlayoutError as exc:
        fail(exc)
    finished = False
    try:
        if not info.is_main:
            out = Console(quiet=True)
        if synthetic is not None:
            _write_synthetic(cfg, info, synthetic, seed)
        with progress_bar(out) as progress:
            if layouts:
                result = _compare(cfg, layouts, info, rounds, out, progress)
            else:
                run = _train_one(cfg, info, taken, out, progress)
        if layouts:
            render_comparison(result, layouts, out, batch=cfg.batch,
                              world_size=info.world_size, rounds=rounds)
        else:
            render_run(run, out)
        finished = True
    except MemlayoutError as exc:
        fail(exc)
    finally:
        shutdown(info, together=finished)


def _checked(ctx: typer.Context, cfg: TrainConfig,
             layouts: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    """``cfg`` checked, with the settings a resumed run takes from its checkpoint (those not
    on the command line), and what it took; every ``--compare`` layout checked too."""
    from memlayout.train.compare import check_compare, layout_of
    from memlayout.train.config import resumed_config

    cfg.check()
    given = {setting for flag, setting in _FLAG_SETTINGS.items()
             if ctx.get_parameter_source(flag).name not in ("DEFAULT", "DEFAULT_MAP")}
    cfg, taken = resumed_config(cfg, given)
    for name in layouts or [cfg.layout]:
        dataclasses.replace(cfg, layout=layout_of(name)).check()
    if layouts:
        check_compare(layouts)
    return cfg, taken


def _write_synthetic(cfg: TrainConfig, info: DistInfo, images: int, seed: int) -> None:
    """Rank 0 writes ``--synthetic`` images (``--seed``) into ``--data``; the other ranks
    wait for it."""
    from memlayout.train import make_synthetic
    from memlayout.train.ddp import barrier, collectives

    with collectives(info, cfg.timeout, "rank 0 wrote the --synthetic data"):
        if info.is_main:
            make_synthetic(cfg.data, images, size=cfg.image_size, seed=seed)
        barrier(info)


def _where(cfg: TrainConfig, info: DistInfo) -> str:
    """``1 process``, or the torchrun job: ``2 processes (torchrun, DDP gloo)``."""
    if not info.distributed:
        return "1 process" + _compiled(cfg)
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    return (f"{info.world_size} processes (torchrun, {cfg.strategy.upper()} {backend})"
            + _compiled(cfg))


def _compiled(cfg: TrainConfig) -> str:
    """How the model is compiled, for the run's header: nothing, or ``, torch.compile``."""
    return {"none": "", "inductor": ", torch.compile",
            "backend": ", torch.compile with memlayout's backend"}[cfg.compile]


def _printer(progress: Progress, bar: TaskID) -> Callable[[object], None]:
    """What a Trainer's events become: log lines above the bar (which follows the steps)."""
    from memlayout.train.loop import IntervalLog
    from memlayout.train.render import interval_line

    def on_event(event: object) -> None:
        if isinstance(event, IntervalLog):
            progress.console.print(interval_line(event), markup=False, highlight=False)
            progress.update(bar, completed=event.step, total=event.total_steps,
                            description=f"{event.layout} epoch {event.epoch}")
        else:
            progress.console.print(str(event), markup=False, highlight=False)

    return on_event


def _compare(cfg: TrainConfig, layouts: list[str], info: DistInfo, rounds: int, out: Console,
             progress: Progress) -> LayoutComparison:
    """``--compare``: the layouts trained side by side, a bar step per timed interval."""
    from memlayout.train import compare_layouts

    bar = progress.add_task("building", total=rounds * len(layouts), completed=0)
    out.print(f"memlayout train {cfg.model} --compare {','.join(layouts)}: {cfg.dtype}, batch {cfg.batch} per process x {_where(cfg, info)}, "
              f"{cfg.image_size} px, {cfg.log_every} steps per interval, 1 warm-up + {rounds} interleaved rounds, "
              f"device {cfg.device}, torch threads {torch.get_num_threads()}", markup=False, highlight=False)
    if info.is_main:
        print_conditions(Conditions.now())
    steps = [0]

    def on_step(r: int, name: str) -> None:
        steps[0] += 1
        progress.update(bar, completed=steps[0] - 1, description=f"round {r + 1}/{rounds} {name}")

    result = compare_layouts(cfg, layouts, rounds=rounds, dist_info=info,
                             on_event=_printer(progress, bar), on_step=on_step)
    progress.update(bar, completed=rounds * len(layouts), description="done")
    return result


def _train_one(cfg: TrainConfig, info: DistInfo, taken: dict[str, Any], out: Console,
               progress: Progress) -> TrainResult:
    """One layout trained to the end, the bar following its steps."""
    from memlayout.train import Trainer

    bar = progress.add_task("building", total=None)
    with Trainer(cfg, info, _printer(progress, bar)) as trainer:
        out.print(f"memlayout train {cfg.model}: layout {cfg.layout}, {cfg.dtype}, batch {cfg.batch} per process x {_where(cfg, info)}, "
                  f"{cfg.image_size} px, {len(trainer.dataset)} images in {len(trainer.dataset.classes)} classes, "
                  f"{trainer.steps_per_epoch} steps/epoch, {cfg.epochs} epochs, device {trainer.device}, "
                  f"torch threads {torch.get_num_threads()}", markup=False, highlight=False)
        if info.is_main:
            bf16_notice(cfg.dtype, str(trainer.device),
                        "bf16 training runs slower than fp32 here; its speed says "
                        "nothing of a CPU with bf16 instructions")
        if trainer.plan_summary:
            out.print(trainer.plan_summary, markup=False, highlight=False)
        if cfg.resume:
            kept = (" with its settings " + ", ".join(f"{k} {v}" for k, v in taken.items())
                    + " (not given on the command line)" if taken else "")
            out.print(f"resumed at step {trainer.step} from {cfg.checkpoint}{kept}",
                      markup=False, highlight=False)
        progress.update(bar, total=trainer.total_steps, completed=trainer.step,
                        description=cfg.layout)
        return trainer.run()
