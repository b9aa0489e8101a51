"""The reference training loop behind ``memlayout train``: ImageFolder classification, one
process or a torchrun job (DDP, or FSDP2 with ``strategy="fsdp"``), in NCHW, channels-last
(NHWC) or planned layouts.

Plain data in and out: a :class:`~memlayout.train.config.TrainConfig` in, :class:`IntervalLog`
events while it runs (the CLI renders them), a :class:`TrainResult` at the end. What goes into
a checkpoint is :mod:`memlayout.train.checkpointing`'s; a planned model comes from rank 0
(:mod:`memlayout.train.planning`); layouts compared side by side are
:mod:`memlayout.train.compare`'s.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from memlayout.devices import seam
from memlayout.dtypes import autocast, parse_dtype
from memlayout.errors import TrainError
from memlayout.models import ModelSpec, load_model
from memlayout.plan.costs.faults import module_faults
from memlayout.tensors import convert_batch, convert_module
from memlayout.train import checkpointing
from memlayout.train.compiling import CompiledPlans, compile_model, compiled_plans, graphs_so_far
from memlayout.train.config import TrainConfig
from memlayout.train.data import SkipSampler, UnreadableBatch, image_folder, loader, model_input
from memlayout.train.ddp import (
    DistInfo,
    all_reduce_sum,
    batchnorm_notice,
    collectives,
    rank_device,
    warn_grad_layouts,
    wrap_ddp,
)
from memlayout.train.fsdp import wrap_fsdp
from memlayout.train.planning import plan_on_rank0
from memlayout.train.together import PLANNED as TOGETHER_PLANNED
from memlayout.train.together import check_together

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class IntervalLog:
    """One log line: the steps since the previous line, over all processes."""

    layout: str
    epoch: int
    step_in_epoch: int          # steps done in this epoch
    steps_per_epoch: int
    step: int                   # steps done since the start of training
    total_steps: int
    seconds: float
    images: int                 # images in the interval, all processes
    loss: float                 # mean loss over the interval's images
    accuracy: float             # top-1 %, over the interval's images

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else math.inf


@dataclass
class TrainResult:
    """What a run did. ``losses``: this process's loss per step of this run (the loss curve)."""

    config: TrainConfig
    world_size: int
    start_step: int
    step: int
    losses: list[float] = field(default_factory=list)
    intervals: list[IntervalLog] = field(default_factory=list)
    checkpoint: str | None = None
    plan_summary: str | None = None
    compiled: CompiledPlans | None = None  # --compile backend: the graphs and their plans


Event = Callable[[Any], None]


def _ignore(_event: Any) -> None:
    pass


class Trainer:
    """One model, optimizer and data stream in one layout, on this process (``model``,
    ``optimizer``, ``scaler``, ``step``, ``dataset`` in ``data_layout``: made by :func:`_build`).
    With a checkpoint folder, rank 0 holds its lock until :meth:`close` (or the end of a
    ``with`` block, or of the process)."""

    # set by _build
    data_layout: str
    dataset: Any
    sampler: DistributedSampler[Any]
    steps_per_epoch: int
    total_steps: int
    model_kind: str
    fsdp: bool
    model: nn.Module
    graphs_before: int  # the backend's graphs compiled in this process before this trainer's
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    step: int

    def __init__(self, config: TrainConfig, dist_info: DistInfo | None = None,
                 on_event: Event | None = None) -> None:
        config.check()
        self.config = config
        self.dist = dist_info or DistInfo()
        self.on_event = on_event or _ignore
        self.device = _run_device(config, self.dist)
        self.autocast_dtype = parse_dtype(config.dtype)
        self._lock = checkpointing.take_folder(config, self.dist)
        try:
            _build(self, config)
        except BaseException:
            self.close()
            raise

    def _warn(self, message: str, kind: str = "warning") -> None:
        # the CLI prints events above its progress bar; a library caller without a handler
        # still hears it
        if self.on_event is _ignore:
            warnings.warn(f"memlayout: {message}", stacklevel=3)
        else:
            self.on_event(f"{kind}: {message}")

    def close(self) -> None:
        """Release the checkpoint folder (rank 0). Idempotent."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_together(self, planned: nn.Module, original: nn.Module, example: torch.Tensor,
                        original_input: torch.Tensor) -> nn.Module:
        """The plan against the original model with every rank computing at once; the
        original (and the NCHW pipeline) when the plan is not faster so."""
        with collectives(self.dist, self.config.timeout, "the ranks timed the plan together"):
            check = check_together(planned, original, example, original_input,
                                   world_size=self.dist.world_size,
                                   dtype=self.autocast_dtype)
        self.plan_summary = "\n".join(s for s in (self.plan_summary, check.describe()) if s)
        if check.kept == TOGETHER_PLANNED:
            if self.dist.is_main:
                self.on_event(check.describe())
            return planned
        if self.dist.is_main:
            self._warn(check.describe(), kind="note")
        self.data_layout = "nchw"
        self.dataset = image_folder(self.config.data, self.data_layout, self.config.image_size)
        return original

    def next_batch(self) -> Batch:
        if self._stream is None:
            self._stream = _batches(self)
        return next(self._stream)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> Batch:
        """Forward, backward, optimizer step on one batch; returns (loss, correct) tensors."""
        x = model_input(images, self.data_layout, self.device)
        y = labels.to(self.device, non_blocking=True)
        # under FSDP its MixedPrecisionPolicy casts parameters and inputs: no autocast
        loss, out = _sgd_step(self, x, y, None if self.fsdp else self.autocast_dtype)
        if not self._checked_grads:
            self._checked_grads = True
            warn_grad_layouts(self.model)
        self.step += 1
        return loss.detach(), (out.detach().argmax(1) == y).sum()

    def run(self) -> TrainResult:
        """Train to ``total_steps``, logging every ``log_every`` steps and at each epoch's
        end; checkpoint at each epoch's end and at the last step."""
        return _run(self)


# -- building a Trainer ---------------------------------------------------------------------
def _run_device(config: TrainConfig, info: DistInfo) -> torch.device:
    """Where this rank trains, made current (under torchrun on CUDA: its local GPU)."""
    device = torch.device(config.device)
    if info.distributed:
        device = rank_device(device, info.local_rank)
    seam(device).make_current()
    if config.sync_batchnorm and info.distributed and device.type != "cuda":
        raise TrainError("--sync-bn needs CUDA: torch's SyncBatchNorm has no CPU kernel "
                         "(it refuses CPU tensors), so on CPU each rank keeps its own "
                         "BatchNorm statistics; drop --sync-bn or train with --device cuda")
    return device


def _build(trainer: Trainer, config: TrainConfig) -> None:
    """The data, the model in its layout (shared across ranks), the optimizer; on resume the
    checkpoint's state."""
    # the pipeline the model's input comes from: the layout's, unless a plan gives way
    # to the original model (``memlayout.train.together``)
    trainer.data_layout = config.layout
    trainer.dataset = image_folder(config.data, config.layout, config.image_size)
    info = trainer.dist
    trainer.sampler = DistributedSampler(trainer.dataset, num_replicas=info.world_size,
                                         rank=info.rank, shuffle=True, seed=config.seed)
    trainer.steps_per_epoch = len(trainer.sampler) // config.batch
    if trainer.steps_per_epoch == 0:
        raise TrainError(f"{len(trainer.dataset)} images give {len(trainer.sampler)} per "
                         f"process, fewer than one batch of {config.batch}; lower --batch or "
                         "add data")
    trainer.total_steps = config.epochs * trainer.steps_per_epoch
    if config.max_steps is not None:
        trainer.total_steps = min(trainer.total_steps, config.max_steps)
    spec = load_model(config.model, batch=config.batch, image_size=config.image_size,
                      seed=config.seed)
    trainer.model_kind = spec.kind
    trainer.plan_summary = None
    trainer.fsdp = config.sharded and info.distributed
    trainer.graphs_before = graphs_so_far() if config.compile == "backend" else 0
    trainer.model = _model(trainer, spec)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=config.lr,
                                        momentum=config.momentum,
                                        weight_decay=config.weight_decay)
    trainer.scaler = (torch.amp.GradScaler(trainer.device.type)
                      if trainer.autocast_dtype is torch.float16 else None)
    torch.manual_seed(config.seed + info.rank)  # dropout etc.: per rank, reproducible
    trainer.step = 0
    trainer._checked_grads = False
    if config.resume:
        checkpointing.load(trainer, checkpointing.latest(config))
    trainer._stream = None


def _model(trainer: Trainer, spec: ModelSpec) -> nn.Module:
    """The model in the run's layout, in train mode, wrapped for its ranks (DDP or FSDP)."""
    config, info, device = trainer.config, trainer.dist, trainer.device
    model = spec.module.to(device)
    faults = module_faults(model, device=torch.device(device)) if config.layout == "nhwc" else {}
    if faults:
        raise TrainError(f"--layout nhwc would train {', '.join(faults)} channels-last, and "
                         f"{next(iter(faults.values()))}. Train with --layout planned (it keeps "
                         "them contiguous) or --layout nchw")
    if config.layout == "nhwc" and not config.sharded:
        # (under FSDP the weights stay contiguous: a convolution given a channels-last
        # input and a contiguous weight runs channels-last all the same)
        convert_module(model, spec.fmt)
    elif config.layout == "planned":
        example = convert_batch(spec.example_input.to(device), spec.fmt)
        with collectives(info, config.timeout, "rank 0 planned the model"):
            planned, trainer.plan_summary = plan_on_rank0(model, example, config, info)
        if info.distributed and config.plan_measure:
            planned = trainer._check_together(planned, model, example,
                                              spec.example_input.to(device))
        model = planned
    model.train()
    # before DDP or FSDP; under FSDP block by block, FSDP's all-gathers between the blocks
    compile_model(model, config.compile, measure=config.plan_measure, per_block=trainer.fsdp)
    notice = batchnorm_notice(model, info, device=device, sync_batchnorm=config.sync_batchnorm)
    if notice and info.is_main:
        trainer._warn(notice)
    if trainer.fsdp:
        if config.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        with collectives(info, config.timeout, "fully_shard (FSDP) of the model"):
            return wrap_fsdp(model, dtype=trainer.autocast_dtype,
                             per_block=config.compile != "none")
    if info.distributed:
        with collectives(info, config.timeout, "the ranks compared parameter layouts"):
            return wrap_ddp(model, device_ids=[device.index] if device.type == "cuda" else None,
                            sync_batchnorm=config.sync_batchnorm)
    return model


# -- data and steps -------------------------------------------------------------------------
def _batches(trainer: Trainer) -> Iterator[Batch]:
    """Batches from the trainer's step on, epoch after epoch (a resumed epoch skips what it
    had seen)."""
    config = trainer.config
    while True:
        epoch, done = divmod(trainer.step, trainer.steps_per_epoch)
        trainer.sampler.set_epoch(epoch)
        sampler = SkipSampler(trainer.sampler, done * config.batch)
        data = loader(trainer.dataset, trainer.data_layout, batch=config.batch,
                      sampler=sampler, image_size=config.image_size, workers=config.workers,
                      pin_memory=trainer.device.type == "cuda",
                      # its own generator: making a loader must not draw from the global
                      # RNG, or a resumed run's dropout would differ from the original's
                      generator=torch.Generator().manual_seed(config.seed + epoch))
        for i, batch in enumerate(data):
            if done + i >= trainer.steps_per_epoch:
                break
            if isinstance(batch, UnreadableBatch):
                raise batch.error()
            yield batch


def _sgd_step(trainer: Trainer, x: torch.Tensor, y: torch.Tensor,
              dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward under autocast in ``dtype``, backward (through the gradient scaler with fp16),
    optimizer step; returns the loss and the model's output."""
    with autocast(trainer.device, dtype):
        out = trainer.model(x)
        loss = F.cross_entropy(out.float(), y)
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.scaler is not None:
        trainer.scaler.scale(loss).backward()
        trainer.scaler.step(trainer.optimizer)
        trainer.scaler.update()
    else:
        loss.backward()
        trainer.optimizer.step()
    return loss, out


def doing_step(trainer: Trainer) -> str:
    """What the collectives of the next step are, for the error when a rank stops answering."""
    what = ("the parameter all-gathers and gradient reduce-scatters of FSDP" if trainer.fsdp
            else "the gradient all-reduce")
    return f"training step {trainer.step + 1} ({what})"


def diverged(trainer: Trainer, values: list[float]) -> TrainError:
    """The error for an interval whose loss is not finite, naming the first such step."""
    first = trainer.step - len(values) + 1
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    where = (f"at step {first + bad} ({values[bad]})" if bad is not None else
             f"on another rank in steps {first}-{trainer.step}")
    kept = " (the last checkpoint written is kept)" if trainer.config.checkpoint else ""
    return TrainError(f"the loss is not finite {where}: training stopped before writing "
                      f"a checkpoint{kept}; lower --lr (now {trainer.config.lr:g}) or check "
                      "the data")


# -- the loop -------------------------------------------------------------------------------
def _run(trainer: Trainer) -> TrainResult:
    """Steps to ``total_steps``; an interval ends every ``log_every`` steps, at each epoch's
    end and at the last step, and the last two write a checkpoint."""
    cfg = trainer.config
    result = TrainResult(cfg, trainer.dist.world_size, trainer.step, trainer.step,
                         plan_summary=trainer.plan_summary)
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []
    start = time.perf_counter()
    while trainer.step < trainer.total_steps:
        with collectives(trainer.dist, cfg.timeout, doing_step(trainer)):
            loss, c = trainer.train_step(*trainer.next_batch())
        losses.append(loss)
        correct.append(c)
        end_of_epoch = trainer.step % trainer.steps_per_epoch == 0
        last = trainer.step == trainer.total_steps
        if len(losses) >= cfg.log_every or end_of_epoch or last:
            values = torch.stack(losses).tolist()
            result.losses.extend(values)
            log = _interval(trainer, values, correct, start)
            result.intervals.append(log)
            trainer.on_event(log)
            losses, correct = [], []
            if (end_of_epoch or last) and cfg.checkpoint:
                checkpointing.check_finite_weights(trainer)
                path = checkpointing.save(trainer)
                if path is not None:
                    result.checkpoint = str(path)
                    trainer.on_event(f"checkpoint: {path} (step {trainer.step})")
            start = time.perf_counter()
    result.step = trainer.step
    if cfg.compile == "backend":
        with collectives(trainer.dist, cfg.timeout, "the ranks compared their plans"):
            result.compiled = compiled_plans(trainer.graphs_before, trainer.dist)
    return result


def _interval(trainer: Trainer, values: list[float], correct: list[torch.Tensor],
              start: float) -> IntervalLog:
    """The log of the steps since ``start`` (their losses ``values``, their correct counts),
    summed over every rank; ``TrainError`` when the loss is not finite (on every rank alike:
    the sum is shared)."""
    cfg = trainer.config
    n = len(values) * cfg.batch
    with collectives(trainer.dist, cfg.timeout, f"summing the losses of step {trainer.step}"):
        total_loss, total_correct, count = all_reduce_sum(
            [sum(values) * cfg.batch, float(torch.stack(correct).sum()), float(n)],
            trainer.device)
    if not math.isfinite(total_loss):
        raise diverged(trainer, values)
    seconds = time.perf_counter() - start
    epoch, done = divmod(trainer.step - 1, trainer.steps_per_epoch)
    return IntervalLog(cfg.layout, epoch, done + 1, trainer.steps_per_epoch, trainer.step,
                       trainer.total_steps, seconds, int(count), total_loss / count,
                       100.0 * total_correct / count)


def train(config: TrainConfig, *, dist_info: DistInfo | None = None,
          on_event: Event | None = None) -> TrainResult:
    """Build a :class:`Trainer` for ``config`` and run it to the end (the checkpoint folder
    is released when it returns or fails)."""
    with Trainer(config, dist_info, on_event) as trainer:
        return trainer.run()


__all__ = ["IntervalLog", "TrainResult", "Trainer", "diverged", "doing_step", "train"]
