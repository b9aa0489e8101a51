"""A training run's checkpoint steps (L2 train): rank 0 holds the folder, every rank saves and
loads its part of the run's state, and weights that are not finite are never written.

The file formats, the lock and the atomic writes are :mod:`memlayout.train.checkpoint`'s;
this module says what of a :class:`~memlayout.train.loop.Trainer` goes into a checkpoint
(model, optimizer, gradient scaler, step, every rank's RNG states, the settings) and how the
ranks take part: under DDP rank 0 writes ``latest.pt``, under FSDP every rank writes its
shards of ``latest.dcp``; a failure on rank 0 stops every rank with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from memlayout.errors import CheckpointError, TrainError
from memlayout.train import checkpoint
from memlayout.train.config import TrainConfig, resume_note, settings_of
from memlayout.train.ddp import DistInfo, all_reduce_sum, broadcast_error, collectives, unwrap


class RunState(Protocol):
    """What of a run this module saves and loads (a :class:`~memlayout.train.loop.Trainer`)."""

    config: TrainConfig
    dist: DistInfo
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    step: int
    steps_per_epoch: int
    on_event: Callable[[Any], None]


def take_folder(config: TrainConfig, info: DistInfo) -> checkpoint.CheckpointLock | None:
    """Rank 0 locks the checkpoint folder (and removes dead writers' temporary files); when it
    cannot, every rank stops with its reason. The lock, on rank 0 with a folder; else ``None``."""
    lock, problem = None, None
    with collectives(info, config.timeout, "rank 0 checked the checkpoint folder"):
        if config.checkpoint and info.is_main:
            try:
                lock = checkpoint.CheckpointLock(config.checkpoint)
                checkpoint.remove_stale_temporaries(config.checkpoint)
            except CheckpointError as exc:
                problem = str(exc)
        problem = broadcast_error(info, problem)
    _stop_on(problem, info)
    return lock


def latest(config: TrainConfig) -> Path:
    """The checkpoint a run with ``config`` resumes: ``latest.pt``, or ``latest.dcp`` sharded."""
    name = checkpoint.LATEST_SHARDED if config.sharded else checkpoint.LATEST
    return Path(config.checkpoint) / name  # type: ignore[arg-type]


def save(trainer: RunState) -> Path | None:
    """Write the checkpoint of ``trainer``'s step: ``latest.pt`` by rank 0, atomically, or
    every rank's shards of ``latest.dcp``; every rank must call it. The path on rank 0."""
    config = trainer.config
    if not config.checkpoint:
        return None
    if config.sharded:
        return _save_sharded(trainer)
    with collectives(trainer.dist, config.timeout, "gathering RNG states for a checkpoint"):
        state = {**_meta(trainer, _rngs(trainer)),
                 "model": checkpoint.neutral_state_dict(trainer.model),
                 "optimizer": checkpoint.neutral_optimizer_state(trainer.optimizer)}
    if not trainer.dist.is_main:
        return None
    return checkpoint.atomic_save(state, Path(config.checkpoint) / checkpoint.LATEST)


def load(trainer: RunState, path: Path) -> None:
    """Put ``trainer`` back at the checkpoint's step: model, optimizer, scaler, this rank's
    RNG states; this run's hyperparameters win over the saved optimizer's, and a note names
    every setting that differs from the checkpoint's."""
    config = trainer.config
    state = (_load_sharded(trainer, path.parent) if config.sharded
             else checkpoint.load_checkpoint(path))
    note = resume_note(state.get("config", {}), config, state.get("world_size"),
                       trainer.dist.world_size)
    if note and trainer.dist.is_main:
        trainer.on_event(f"note: {note}")
    if not config.sharded:
        checkpoint.load_neutral_state_dict(trainer.model, state["model"])
        checkpoint.load_optimizer_state(trainer.optimizer, state["optimizer"])
    # the optimizer's state dict brings the checkpoint's hyperparameters: this run's win
    for group in trainer.optimizer.param_groups:
        group.update(lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if trainer.scaler is not None and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    rngs = state.get("rng") or []
    if len(rngs) == trainer.dist.world_size:
        checkpoint.set_rng_state(rngs[trainer.dist.rank], trainer.device)
    trainer.step = int(state["step"])


def check_finite_weights(trainer: RunState) -> None:
    """``TrainError`` instead of a checkpoint of NaN or infinite weights (every rank: a
    sharded model's ranks each check their shards)."""
    bad = [name for name, t in unwrap(trainer.model).state_dict().items()
           if isinstance(t, torch.Tensor) and t.is_floating_point()
           and not bool(torch.isfinite(_local(t)).all())]
    with collectives(trainer.dist, trainer.config.timeout, "checking the weights are finite"):
        (count,) = all_reduce_sum([float(len(bad))], trainer.device)
    if count:
        named = (f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad
                 else " (on another rank)")
        raise TrainError(f"{int(count)} weight tensors are not finite at step "
                         f"{trainer.step}{named}: training stopped before writing a checkpoint "
                         f"of them; lower --lr (now {trainer.config.lr:g})")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP ``DTensor``'s shard), or the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _rngs(trainer: RunState) -> list[Any]:
    """Every rank's RNG states, in rank order (a collective under torchrun)."""
    rng = checkpoint.rng_state(trainer.device)
    rngs: list[Any] = [rng]
    if trainer.dist.distributed:
        rngs = [None] * trainer.dist.world_size
        dist.all_gather_object(rngs, rng)
    return rngs


def _meta(trainer: RunState, rngs: list[Any]) -> dict[str, Any]:
    return {
        "format": checkpoint.FORMAT, "step": trainer.step,
        "epoch": trainer.step // trainer.steps_per_epoch,
        "step_in_epoch": trainer.step % trainer.steps_per_epoch,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "rng": rngs, "world_size": trainer.dist.world_size,
        "config": settings_of(trainer.config),
    }


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state dicts as DCP takes them (sharded ``DTensor``s under FSDP),
    under the plain model's keys: DCP's helpers name optimizer state by parameter names, so
    they are read from the model inside DDP (a planned model is the model's own tree)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _save_sharded(trainer: RunState) -> Path | None:
    """Every rank writes its shards of ``latest.dcp`` (DCP); rank 0 switches the link."""
    info, config = trainer.dist, trainer.config
    path, problem = None, None
    with collectives(info, config.timeout, "writing a sharded checkpoint (DCP)"):
        meta = _meta(trainer, _rngs(trainer))
        try:
            path = checkpoint.save_sharded(_sharded_state(trainer.model, trainer.optimizer),
                                           meta, config.checkpoint,  # type: ignore[arg-type]
                                           rank=info.rank, world_size=info.world_size)
        except CheckpointError as exc:
            problem = str(exc)
        # rank 0 alone switches the link: when that fails, every rank stops with it
        problem = broadcast_error(info, problem)
    _stop_on(problem, info)
    return path


def _load_sharded(trainer: RunState, folder: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    meta = checkpoint.load_sharded_meta(folder)
    with collectives(trainer.dist, trainer.config.timeout, "loading a sharded checkpoint (DCP)"):
        state = _sharded_state(trainer.model, trainer.optimizer)
        checkpoint.load_sharded(state, folder)
        set_state_dict(unwrap(trainer.model), trainer.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return meta


def _stop_on(problem: str | None, info: DistInfo) -> None:
    """Every rank stops with rank 0's checkpoint problem (broadcast), named as rank 0's on
    the others."""
    if problem is not None:
        raise CheckpointError(problem if info.is_main else f"rank 0: {problem}")
