"""What a training run depends on (L2 train): one frozen :class:`TrainConfig`, checked before
anything is built, and the settings a checkpoint records so that a resumed run can take them
back (``memlayout train --resume``) and say what it does otherwise.

>>> TrainConfig("torchvision:resnet18", "data", layout="nchw").sharded
False
>>> TrainConfig("torchvision:resnet18", "data", batch=0).check()
Traceback (most recent call last):
...
memlayout.errors.TrainError: --batch must be >= 1, got 0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from memlayout.dtypes import parse_dtype
from memlayout.errors import CheckpointError, DtypeError, TrainError
from memlayout.train import checkpoint
from memlayout.train.compiling import COMPILES
from memlayout.train.data import LAYOUTS
from memlayout.train.ddp import DEFAULT_TIMEOUT
from memlayout.train.fsdp import fsdp_available

#: how a torchrun job shares the model: DDP (a full replica per rank) or FSDP2 (sharded)
STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on. ``batch`` is per process; ``max_steps`` stops early
    (counted from the start of training, across resumes); ``timeout``: seconds a rank waits
    for the others in one collective before the run stops with a ``TrainError``. A
    checkpoint folder that holds a checkpoint is continued (``resume``) or replaced
    (``overwrite``), never replaced unasked; on ``resume`` every setting here is used as
    given (the learning rate too, not the checkpoint's optimizer's) and those that differ
    from the checkpoint's are named in a note.
    ``strategy``: ``"ddp"`` or ``"fsdp"`` (``fully_shard`` per block then the root, every
    parameter contiguous, mixed precision through FSDP's policy, sharded checkpoints).
    ``compile``: ``"none"``, ``"inductor"`` (``torch.compile``) or ``"backend"``
    (``torch.compile`` with memlayout's backend, measured as ``plan_measure`` says; under
    torchrun rank 0 measures each graph and every rank compiles its plan)."""

    model: str
    data: str
    epochs: int = 1
    batch: int = 32
    dtype: str = "fp32"
    layout: str = "nhwc"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-5
    checkpoint: str | None = None
    resume: bool = False
    overwrite: bool = False
    image_size: int = 64
    workers: int = 0
    log_every: int = 10
    seed: int = 0
    max_steps: int | None = None
    device: str = "cpu"
    plan_measure: bool = True
    sync_batchnorm: bool = False
    timeout: float = DEFAULT_TIMEOUT
    strategy: str = "ddp"
    compile: str = "none"

    @property
    def sharded(self) -> bool:
        """FSDP: parameters stay contiguous, checkpoints are sharded (``latest.dcp``)."""
        return self.strategy == "fsdp"

    def check(self) -> None:
        """Raise ``TrainError`` (``CheckpointError`` for the checkpoint folder) for a setting
        this run cannot use, before anything is built."""
        _check_choices(self)
        _check_numbers(self)
        _check_checkpoint(self)


def _check_choices(config: TrainConfig) -> None:
    """The layout, the strategy and the dtype, together."""
    if config.layout not in LAYOUTS:
        raise TrainError(f"--layout {config.layout!r} is not one of {', '.join(LAYOUTS)}")
    if config.strategy not in STRATEGIES:
        raise TrainError(f"--strategy {config.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if config.compile not in COMPILES:
        raise TrainError(f"--compile {config.compile!r} is not one of {', '.join(COMPILES)}")
    if config.compile == "backend" and config.layout == "planned":
        raise TrainError("--compile backend plans every graph it compiles: train it with "
                         "--layout nhwc (weights and batches channels-last, where the plan "
                         "starts) or nchw, not a model planned before (--layout planned)")
    if config.sharded:
        missing = fsdp_available()
        if missing:
            raise TrainError(f"--strategy fsdp: {missing}; use --strategy ddp")
        if config.dtype in ("fp16", "float16"):
            raise TrainError("--strategy fsdp runs --dtype fp32 or bf16 (FSDP's "
                             "MixedPrecisionPolicy; fp16 would need a sharded gradient "
                             "scaler): use --dtype bf16")
    try:
        parse_dtype(config.dtype)
    except DtypeError as exc:
        raise TrainError(f"--dtype: {exc}") from exc


def _check_numbers(config: TrainConfig) -> None:
    """Counts at least 1, hyperparameters finite and not negative, a finite timeout."""
    for name in ("epochs", "batch", "image_size", "log_every"):
        if getattr(config, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    for name in ("lr", "momentum", "weight_decay"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value >= 0):
            raise TrainError(f"--{name.replace('_', '-')} {value}: expected a finite number "
                             f">= 0 (default {getattr(TrainConfig, name)}); a non-finite "
                             "setting makes every weight NaN at the first step")
    if config.workers < 0:
        raise TrainError(f"--workers must be >= 0, got {config.workers}")
    if not (config.timeout > 0 and math.isfinite(config.timeout)):
        raise TrainError(f"--timeout must be > 0 seconds and finite, got {config.timeout}")


def _check_checkpoint(config: TrainConfig) -> None:
    """``resume`` and ``overwrite`` against the checkpoint folder and what it holds."""
    if config.resume and not config.checkpoint:
        raise TrainError("--resume needs --checkpoint DIR (the folder holding latest.pt)")
    if config.resume and config.overwrite:
        raise TrainError("--resume continues the checkpoint, --overwrite replaces it: "
                         "give one of them")
    if not config.checkpoint:
        return
    checkpoint.check_location(config.checkpoint, resume=config.resume, sharded=config.sharded)
    held = None if config.resume or config.overwrite else checkpoint.existing_checkpoint(
        config.checkpoint)
    if held is not None:
        raise CheckpointError(
            f"--checkpoint {config.checkpoint!r} holds {held}, which this run would "
            "replace; continue it with --resume, replace it with --overwrite, or give "
            "another --checkpoint folder")


#: settings a checkpoint records but a run may change without changing what it trains
_HARMLESS = ("epochs", "log_every", "workers")
#: settings a checkpoint does not record: they say how this run goes, not what it trains
_NOT_SAVED = ("resume", "overwrite", "max_steps", "checkpoint", "timeout", "compile")
#: the ``memlayout train`` flags a resumed run takes from its checkpoint unless given again
RESUMED = ("lr", "batch", "epochs", "dtype", "layout", "image_size", "seed", "sync_batchnorm",
           "plan_measure")


def settings_of(config: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records: what was trained, and how."""
    return {k: v for k, v in asdict(config).items() if k not in _NOT_SAVED}


def resume_note(saved: dict[str, Any], config: TrainConfig, saved_world: int | None,
                world_size: int) -> str | None:
    """What a resumed run does otherwise than the checkpoint's: every setting that differs,
    with both values, and whether the run can still repeat the uninterrupted one; ``None``
    when nothing differs.

    >>> a = TrainConfig("torchvision:resnet18", "data", lr=0.01)
    >>> resume_note(settings_of(a), replace(a, lr=0.5, epochs=3), 1, 1)
    "resuming with settings other than the checkpoint's: epochs 1 -> 3, lr 0.01 -> 0.5 (the run will not repeat the uninterrupted one exactly)"
    """
    now = settings_of(config)
    changed = [k for k in saved if k in now and saved[k] != now[k]]
    parts = [f"{k} {saved[k]} -> {now[k]}" for k in changed]
    repeats = all(k in _HARMLESS for k in changed)
    # N ranks with batch B see the batches one process with batch N * B sees
    if saved_world is not None and saved_world != world_size:
        parts.append(f"world size {saved_world} -> {world_size}")
        if "batch" in saved and saved["batch"] * saved_world != config.batch * world_size:
            parts.append("global batch (batch x world size) "
                         f"{saved['batch'] * saved_world} -> {config.batch * world_size}")
            repeats = False
        elif not config.sharded:
            repeats = False  # RNG states are per rank (dropout)
    if not parts:
        return None
    then = ("the steps in common repeat the uninterrupted run" if repeats else
            "the run will not repeat the uninterrupted one exactly")
    return f"resuming with settings other than the checkpoint's: {', '.join(parts)} ({then})"


def resumed_config(config: TrainConfig, given: set[str]) -> tuple[TrainConfig, dict[str, Any]]:
    """``config`` with each of :data:`RESUMED` not in ``given`` (the flags on the command
    line) taken from the checkpoint it resumes, and what was taken: ``--resume`` alone
    continues the run the checkpoint was part of. Nothing changes without ``resume``."""
    if not (config.resume and config.checkpoint):
        return config, {}
    saved = checkpoint.saved_settings(config.checkpoint, sharded=config.sharded).get("config", {})
    taken = {k: saved[k] for k in RESUMED
             if k not in given and k in saved and saved[k] != getattr(config, k)}
    return replace(config, **taken), taken


__all__ = ["RESUMED", "STRATEGIES", "TrainConfig", "resume_note", "resumed_config", "settings_of"]
