"""The reference training loop behind ``memlayout train``: ImageFolder classification, one
process or a torchrun job (DDP, or FSDP2 with ``strategy="fsdp"``), in NCHW, channels-last
(NHWC) or planned layouts.

Plain data in and out: a :class:`TrainConfig` in, :class:`IntervalLog` events while it runs
(the CLI renders them), a :class:`TrainResult` at the end.
"""

from __future__ import annotations

import io
import math
import pickle
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from memlayout.dtypes import autocast, parse_dtype
from memlayout.errors import CheckpointError, DtypeError, TrainError
from memlayout.models import load_model
from memlayout.tensors import convert_batch, convert_module
from memlayout.timing import Comparison, device_sync, interleaved
from memlayout.train import checkpoint as ckpt
from memlayout.train.data import (
    LAYOUTS,
    SkipSampler,
    UnreadableBatch,
    image_folder,
    loader,
    model_input,
)
from memlayout.train.ddp import (
    DEFAULT_TIMEOUT,
    DistInfo,
    all_reduce_sum,
    batchnorm_notice,
    broadcast_error,
    collectives,
    grad_layout_mismatches,
    unwrap,
    warn_grad_layouts,
    wrap_ddp,
)
from memlayout.train.fsdp import fsdp_available, wrap_fsdp
from memlayout.train.together import PLANNED as TOGETHER_PLANNED
from memlayout.train.together import check_together

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
    parameter contiguous, mixed precision through FSDP's policy, sharded checkpoints)."""

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

    @property
    def sharded(self) -> bool:
        """FSDP: parameters stay contiguous, checkpoints are sharded (``latest.dcp``)."""
        return self.strategy == "fsdp"

    def check(self) -> None:
        """Raise ``TrainError`` (``CheckpointError`` for the checkpoint folder) for a setting
        this run cannot use, before anything is built."""
        if self.layout not in LAYOUTS:
            raise TrainError(f"--layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.strategy not in STRATEGIES:
            raise TrainError(f"--strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.sharded:
            missing = fsdp_available()
            if missing:
                raise TrainError(f"--strategy fsdp: {missing}; use --strategy ddp")
            if self.dtype in ("fp16", "float16"):
                raise TrainError("--strategy fsdp runs --dtype fp32 or bf16 (FSDP's "
                                 "MixedPrecisionPolicy; fp16 would need a sharded gradient "
                                 "scaler): use --dtype bf16")
        try:
            parse_dtype(self.dtype)
        except DtypeError as exc:
            raise TrainError(f"--dtype: {exc}") from exc
        for name in ("epochs", "batch", "image_size", "log_every"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "momentum", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise TrainError(f"--{name.replace('_', '-')} {value}: expected a finite number "
                                 f">= 0 (default {getattr(TrainConfig, name)}); a non-finite "
                                 "setting makes every weight NaN at the first step")
        if self.workers < 0:
            raise TrainError(f"--workers must be >= 0, got {self.workers}")
        if self.resume and not self.checkpoint:
            raise TrainError("--resume needs --checkpoint DIR (the folder holding latest.pt)")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise TrainError(f"--timeout must be > 0 seconds and finite, got {self.timeout}")
        if self.resume and self.overwrite:
            raise TrainError("--resume continues the checkpoint, --overwrite replaces it: "
                             "give one of them")
        if self.checkpoint:
            ckpt.check_location(self.checkpoint, resume=self.resume, sharded=self.sharded)
            held = None if self.resume or self.overwrite else ckpt.existing_checkpoint(
                self.checkpoint)
            if held is not None:
                raise CheckpointError(
                    f"--checkpoint {self.checkpoint!r} holds {held}, which this run would "
                    "replace; continue it with --resume, replace it with --overwrite, or give "
                    "another --checkpoint folder")


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


Event = Callable[[Any], None]


def _ignore(_event: Any) -> None:
    pass


def _dumps(module: nn.Module | None) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()


def _class_modules(model: nn.Module) -> list[str]:
    """The Python module of each submodule's class, in module order."""
    return [type(m).__module__ for m in model.modules()]


def _renames(theirs: list[str], mine: list[str]) -> dict[str, str]:
    """Another process's module names -> this one's, for the same model: a model file is
    imported under a name that differs per process (``memlayout.models`` file specs)."""
    return {a: b for a, b in zip(theirs, mine, strict=False) if a != b}


def _loads(data: bytes, renames: dict[str, str]) -> nn.Module:
    """A module pickled by another rank (:func:`_dumps`), its classes found under this
    process's module names."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return super().find_class(renames.get(module, module), name)

    renaming = types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load,
                                     __name__="pickle")
    return torch.load(io.BytesIO(data), weights_only=False, pickle_module=renaming)


def plan_for_training(module: nn.Module, example: torch.Tensor, *, dtype: str,
                      measure: bool, name: str, weights: str = "converted") -> nn.Module:
    """``memlayout.optimize(module, example, train=True)`` with channels-last input;
    ``weights="contiguous"`` for FSDP (every parameter contiguous)."""
    # The planner (torch.fx, scipy) takes about as long to import as the rest of training:
    # only --layout planned loads it.
    from memlayout.plan.pipeline import optimize

    return optimize(module, example, dtype=dtype, input_format="channels_last",
                    measure=measure, name=name, train=True, weights=weights)


def keyed_module(model: nn.Module) -> nn.Module:
    """The module whose ``named_parameters`` carry the plain model's keys: the model inside
    DDP, or the model itself (a planned model is the model's own tree: its keys are the
    model's). DCP's state-dict helpers name optimizer state by parameter names, so they must
    agree with the model's ``state_dict`` keys."""
    return unwrap(model)


class Trainer:
    """One model, optimizer and data stream in one layout, on this process. With a
    checkpoint folder, rank 0 holds its lock until :meth:`close` (or the end of a ``with``
    block, or of the process)."""

    def __init__(self, config: TrainConfig, dist_info: DistInfo | None = None,
                 on_event: Event | None = None) -> None:
        config.check()
        self.config = config
        self.dist = dist_info or DistInfo()
        self.on_event = on_event or _ignore
        device = torch.device(config.device)
        if device.type == "cuda" and self.dist.distributed:
            device = torch.device("cuda", self.dist.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        self.autocast_dtype = parse_dtype(config.dtype)
        if config.sync_batchnorm and self.dist.distributed and device.type != "cuda":
            raise TrainError("--sync-bn needs CUDA: torch's SyncBatchNorm has no CPU kernel "
                             "(it refuses CPU tensors), so on CPU each rank keeps its own "
                             "BatchNorm statistics; drop --sync-bn or train with --device cuda")
        self._lock: ckpt.CheckpointLock | None = None
        with collectives(self.dist, config.timeout, "rank 0 checked the checkpoint folder"):
            self._take_checkpoint_folder()
        try:
            self._build(config, device)
        except BaseException:
            self.close()
            raise

    def _take_checkpoint_folder(self) -> None:
        """Rank 0 locks the checkpoint folder (and removes dead writers' temporary files);
        when it cannot, every rank stops with its reason."""
        problem = None
        if self.config.checkpoint and self.dist.is_main:
            try:
                self._lock = ckpt.CheckpointLock(self.config.checkpoint)
                ckpt.remove_stale_temporaries(self.config.checkpoint)
            except CheckpointError as exc:
                problem = str(exc)
        problem = broadcast_error(self.dist, problem)
        if problem is not None:
            raise CheckpointError(problem if self.dist.is_main else f"rank 0: {problem}")

    def _build(self, config: TrainConfig, device: torch.device) -> None:
        # the pipeline the model's input comes from: the layout's, unless a plan gives way
        # to the original model (``memlayout.train.together``)
        self.data_layout = config.layout
        self.dataset = image_folder(config.data, config.layout, config.image_size)
        self.sampler = DistributedSampler(self.dataset, num_replicas=self.dist.world_size,
                                          rank=self.dist.rank, shuffle=True, seed=config.seed)
        self.steps_per_epoch = len(self.sampler) // config.batch
        if self.steps_per_epoch == 0:
            raise TrainError(f"{len(self.dataset)} images give {len(self.sampler)} per process, "
                             f"fewer than one batch of {config.batch}; lower --batch or add data")
        self.total_steps = config.epochs * self.steps_per_epoch
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)

        spec = load_model(config.model, batch=config.batch, image_size=config.image_size,
                          seed=config.seed)
        self.model_kind = spec.kind
        model = spec.module.to(device)
        self.plan_summary: str | None = None
        if config.layout == "nhwc" and not config.sharded:
            # (under FSDP the weights stay contiguous: a convolution given a channels-last
            # input and a contiguous weight runs channels-last all the same)
            convert_module(model, spec.fmt)
        elif config.layout == "planned":
            example = convert_batch(spec.example_input.to(device), spec.fmt)
            with collectives(self.dist, config.timeout, "rank 0 planned the model"):
                planned = self._plan(model, example)
            if self.dist.distributed and config.plan_measure:
                planned = self._check_together(planned, model, example,
                                               spec.example_input.to(device))
            model = planned
        model.train()
        notice = batchnorm_notice(model, self.dist, device=device,
                                  sync_batchnorm=config.sync_batchnorm)
        if notice and self.dist.is_main:
            self._warn(notice)
        self.fsdp = config.sharded and self.dist.distributed
        if self.fsdp:
            if config.sync_batchnorm:
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            with collectives(self.dist, config.timeout, "fully_shard (FSDP) of the model"):
                model = wrap_fsdp(model, dtype=self.autocast_dtype)
        elif self.dist.distributed:
            with collectives(self.dist, config.timeout, "the ranks compared parameter layouts"):
                model = wrap_ddp(model, device_ids=[device.index] if device.type == "cuda" else None,
                                 sync_batchnorm=config.sync_batchnorm)
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=config.lr,
                                         momentum=config.momentum,
                                         weight_decay=config.weight_decay)
        self.scaler = (torch.amp.GradScaler(device.type)
                       if self.autocast_dtype is torch.float16 else None)
        torch.manual_seed(config.seed + self.dist.rank)  # dropout etc.: per rank, reproducible
        self.step = 0
        self._checked_grads = False
        if config.resume:
            self.load(Path(config.checkpoint) / (  # type: ignore[arg-type]
                ckpt.LATEST_SHARDED if config.sharded else ckpt.LATEST))
        self._stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

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

    def _plan(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        # Rank 0 plans alone and hands its planned model to the others: plans made on each
        # rank could differ (a guard decision timed on a busy machine is timed again, not
        # read from the cost cache), and DDP needs the same parameter layouts on every rank.
        planned: nn.Module | None = None
        failure: Exception | None = None
        if self.dist.is_main:
            try:
                planned = plan_for_training(
                    model, example, dtype=self.config.dtype, measure=self.config.plan_measure,
                    name=self.config.model,
                    weights="contiguous" if self.config.sharded else "converted")
            except Exception as exc:
                failure = exc
        if self.dist.distributed:
            box: list[Any] = [None]
            if self.dist.is_main:
                box[0] = (("failed", str(failure), None) if failure is not None else
                          ("planned", _dumps(planned), _class_modules(model)))
            dist.broadcast_object_list(box, src=0)
            kind, payload, modules = box[0]
            if kind == "failed" and not self.dist.is_main:
                raise TrainError(f"rank 0 could not plan the model: {payload}")
            if not self.dist.is_main:
                planned = _loads(payload, _renames(modules, _class_modules(model)))
        if failure is not None:
            raise failure
        assert planned is not None
        plan = getattr(planned, "plan", None)
        self.plan_summary = plan.summary() if plan is not None else None
        return planned

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

    # -- data --------------------------------------------------------------------------
    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the current step on, epoch after epoch (a resumed epoch skips what
        it had seen)."""
        while True:
            epoch, done = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            sampler = SkipSampler(self.sampler, done * self.config.batch)
            data = loader(self.dataset, self.data_layout, batch=self.config.batch,
                          sampler=sampler, image_size=self.config.image_size,
                          workers=self.config.workers,
                          pin_memory=self.device.type == "cuda",
                          # its own generator: making a loader must not draw from the global
                          # RNG, or a resumed run's dropout would differ from the original's
                          generator=torch.Generator().manual_seed(self.config.seed + epoch))
            for i, batch in enumerate(data):
                if done + i >= self.steps_per_epoch:
                    break
                if isinstance(batch, UnreadableBatch):
                    raise batch.error()
                yield batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stream is None:
            self._stream = self._batches()
        return next(self._stream)

    # -- one step ----------------------------------------------------------------------
    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, optimizer step on one batch; returns (loss, correct) tensors."""
        x = model_input(images, self.data_layout, self.device)
        y = labels.to(self.device, non_blocking=True)
        # under FSDP its MixedPrecisionPolicy casts parameters and inputs: no autocast
        with autocast(self.device, None if self.fsdp else self.autocast_dtype):
            out = self.model(x)
            loss = F.cross_entropy(out.float(), y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        if not self._checked_grads:
            self._checked_grads = True
            warn_grad_layouts(self.model)
        self.step += 1
        return loss.detach(), (out.detach().argmax(1) == y).sum()

    def run_steps(self, n: int) -> tuple[float, float]:
        """``n`` steps; returns the mean loss and the top-1 % over their images (this process)."""
        losses, correct = [], []
        for _ in range(n):
            with collectives(self.dist, self.config.timeout, self._doing_step()):
                loss, c = self.train_step(*self.next_batch())
            losses.append(loss)
            correct.append(c)
        loss = torch.stack(losses).mean().item()
        if not math.isfinite(loss):
            raise self._diverged(torch.stack(losses).tolist())
        return loss, 100.0 * torch.stack(correct).sum().item() / (n * self.config.batch)

    def _diverged(self, values: list[float]) -> TrainError:
        """The error for an interval whose loss is not finite, naming the first such step."""
        first = self.step - len(values) + 1
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        where = (f"at step {first + bad} ({values[bad]})" if bad is not None else
                 f"on another rank in steps {first}-{self.step}")
        kept = " (the last checkpoint written is kept)" if self.config.checkpoint else ""
        return TrainError(f"the loss is not finite {where}: training stopped before writing "
                          f"a checkpoint{kept}; lower --lr (now {self.config.lr:g}) or check "
                          "the data")

    def _check_finite_weights(self) -> None:
        """``TrainError`` instead of a checkpoint of NaN or infinite weights (every rank: a
        sharded model's ranks each check their shards)."""
        bad = [name for name, t in keyed_module(self.model).state_dict().items()
               if isinstance(t, torch.Tensor) and t.is_floating_point()
               and not bool(torch.isfinite(_local(t)).all())]
        with collectives(self.dist, self.config.timeout, "checking the weights are finite"):
            (count,) = all_reduce_sum([float(len(bad))], self.device)
        if count:
            named = (f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad
                     else " (on another rank)")
            raise TrainError(f"{int(count)} weight tensors are not finite at step "
                             f"{self.step}{named}: training stopped before writing a checkpoint "
                             f"of them; lower --lr (now {self.config.lr:g})")

    def _doing_step(self) -> str:
        what = ("the parameter all-gathers and gradient reduce-scatters of FSDP" if self.fsdp
                else "the gradient all-reduce")
        return f"training step {self.step + 1} ({what})"

    # -- checkpoints -------------------------------------------------------------------
    def _rngs(self) -> list[Any]:
        """Every rank's RNG states, in rank order (a collective under torchrun)."""
        rng = ckpt.rng_state(self.device)
        rngs: list[Any] = [rng]
        if self.dist.distributed:
            rngs = [None] * self.dist.world_size
            dist.all_gather_object(rngs, rng)
        return rngs

    def _meta(self, rngs: list[Any]) -> dict[str, Any]:
        return {
            "format": ckpt.FORMAT, "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "step_in_epoch": self.step % self.steps_per_epoch,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rngs, "world_size": self.dist.world_size,
            "config": settings_of(self.config),
        }

    def _sharded_state(self) -> dict[str, Any]:
        """Model and optimizer state dicts as DCP takes them (sharded ``DTensor``s under FSDP),
        under the plain model's keys."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(keyed_module(self.model), self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def state(self) -> dict[str, Any]:
        """The checkpoint of this step. A collective under DDP (RNG states of every rank)."""
        return {**self._meta(self._rngs()),
                "model": ckpt.neutral_state_dict(self.model),
                "optimizer": ckpt.neutral_optimizer_state(self.optimizer)}

    def save(self) -> Path | None:
        """Write ``latest.pt`` (rank 0) atomically; every rank must call it."""
        if not self.config.checkpoint:
            return None
        if self.config.sharded:
            return self._save_sharded()
        with collectives(self.dist, self.config.timeout, "gathering RNG states for a checkpoint"):
            state = self.state()
        if not self.dist.is_main:
            return None
        return ckpt.atomic_save(state, Path(self.config.checkpoint) / ckpt.LATEST)

    def _save_sharded(self) -> Path | None:
        """Every rank writes its shards of ``latest.dcp`` (DCP); rank 0 switches the link."""
        path, problem = None, None
        with collectives(self.dist, self.config.timeout, "writing a sharded checkpoint (DCP)"):
            meta = self._meta(self._rngs())
            try:
                path = ckpt.save_sharded(self._sharded_state(), meta,
                                         self.config.checkpoint,  # type: ignore[arg-type]
                                         rank=self.dist.rank, world_size=self.dist.world_size)
            except CheckpointError as exc:
                problem = str(exc)
            # rank 0 alone switches the link: when that fails, every rank stops with it
            problem = broadcast_error(self.dist, problem)
        if problem is not None:
            raise CheckpointError(problem if self.dist.is_main else f"rank 0: {problem}")
        return path

    def _load_sharded(self, folder: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        meta = ckpt.load_sharded_meta(folder)
        with collectives(self.dist, self.config.timeout, "loading a sharded checkpoint (DCP)"):
            state = self._sharded_state()
            ckpt.load_sharded(state, folder)
            set_state_dict(keyed_module(self.model), self.optimizer,
                           model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return meta

    def load(self, path: Path) -> None:
        if self.config.sharded:
            state = self._load_sharded(path.parent)
        else:
            state = ckpt.load_checkpoint(path)
        note = resume_note(state.get("config", {}), self.config, state.get("world_size"),
                           self.dist.world_size)
        if note and self.dist.is_main:
            self.on_event(f"note: {note}")
        if not self.config.sharded:
            ckpt.load_neutral_state_dict(self.model, state["model"])
            ckpt.load_optimizer_state(self.optimizer, state["optimizer"])
        # the optimizer's state dict brings the checkpoint's hyperparameters: this run's win
        for group in self.optimizer.param_groups:
            group.update(lr=self.config.lr, momentum=self.config.momentum,
                         weight_decay=self.config.weight_decay)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.dist.world_size:
            ckpt.set_rng_state(rngs[self.dist.rank], self.device)
        self.step = int(state["step"])
        self._stream = None

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to ``total_steps``, logging every ``log_every`` steps and at each epoch's
        end; checkpoint at each epoch's end and at the last step."""
        cfg = self.config
        result = TrainResult(cfg, self.dist.world_size, self.step, self.step,
                             plan_summary=self.plan_summary)
        losses: list[torch.Tensor] = []
        correct: list[torch.Tensor] = []
        start = time.perf_counter()
        while self.step < self.total_steps:
            with collectives(self.dist, cfg.timeout, self._doing_step()):
                loss, c = self.train_step(*self.next_batch())
            losses.append(loss)
            correct.append(c)
            end_of_epoch = self.step % self.steps_per_epoch == 0
            last = self.step == self.total_steps
            if len(losses) >= cfg.log_every or end_of_epoch or last:
                values = torch.stack(losses).tolist()
                result.losses.extend(values)
                n = len(values) * cfg.batch
                with collectives(self.dist, cfg.timeout, f"summing the losses of step {self.step}"):
                    total_loss, total_correct, count = all_reduce_sum(
                        [sum(values) * cfg.batch, float(torch.stack(correct).sum()), float(n)],
                        self.device)
                if not math.isfinite(total_loss):  # on every rank alike: the sum is shared
                    raise self._diverged(values)
                seconds = time.perf_counter() - start
                epoch, done = divmod(self.step - 1, self.steps_per_epoch)
                log = IntervalLog(cfg.layout, epoch, done + 1, self.steps_per_epoch, self.step,
                                  self.total_steps, seconds, int(count), total_loss / count,
                                  100.0 * total_correct / count)
                result.intervals.append(log)
                self.on_event(log)
                losses, correct = [], []
                if (end_of_epoch or last) and cfg.checkpoint:
                    self._check_finite_weights()
                    path = self.save()
                    if path is not None:
                        result.checkpoint = str(path)
                        self.on_event(f"checkpoint: {path} (step {self.step})")
                start = time.perf_counter()
        result.step = self.step
        return result


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP ``DTensor``'s shard), or the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


#: settings a checkpoint records but a run may change without changing what it trains
_HARMLESS = ("epochs", "log_every", "workers")
#: settings a checkpoint does not record: they say how this run goes, not what it trains
_NOT_SAVED = ("resume", "overwrite", "max_steps", "checkpoint", "timeout")
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
    saved = ckpt.saved_settings(config.checkpoint, sharded=config.sharded).get("config", {})
    taken = {k: saved[k] for k in RESUMED
             if k not in given and k in saved and saved[k] != getattr(config, k)}
    return replace(config, **taken), taken


def train(config: TrainConfig, *, dist_info: DistInfo | None = None,
          on_event: Event | None = None) -> TrainResult:
    """Build a :class:`Trainer` for ``config`` and run it to the end (the checkpoint folder
    is released when it returns or fails)."""
    with Trainer(config, dist_info, on_event) as trainer:
        return trainer.run()


@dataclass(frozen=True)
class LayoutComparison:
    """Layouts trained side by side in one process, interval by interval
    (``memlayout.timing.interleaved``): seconds per interval and the per-round ratios."""

    comparison: Comparison
    images_per_interval: int              # over all processes
    steps_per_interval: int
    final: dict[str, tuple[float, float]]  # layout -> (loss, top-1 %) of its last interval

    def images_per_second(self, layout: str) -> float:
        return self.images_per_interval / self.comparison[layout].median


#: ``--compare nchw,planned,nchw-again``: a second copy of a layout compared, trained exactly
#: as it is (its own model, same weights and data order): an A/A control, whose ratio to the
#: first copy is the run's noise floor
CONTROL_SUFFIX = "-again"


def layout_of(name: str) -> str:
    """The layout a ``--compare`` entry trains: ``nchw-again`` trains ``nchw``."""
    return name.removesuffix(CONTROL_SUFFIX)


def check_compare(layouts: list[str]) -> None:
    """``TrainError`` for a ``--compare`` list that cannot be run: fewer than two entries, a
    repeat, or an A/A control whose layout is not itself compared."""
    if len(layouts) < 2 or len(set(layouts)) != len(layouts):
        raise TrainError(f"--compare needs two or more different layouts, got {layouts}")
    alone = [n for n in layouts if n != layout_of(n) and layout_of(n) not in layouts]
    if alone:
        raise TrainError(f"--compare: {', '.join(alone)} is a second copy of a layout (an A/A "
                         f"control) that is not itself compared; add {layout_of(alone[0])}")


def compare_layouts(config: TrainConfig, layouts: list[str], *, rounds: int = 7,
                    dist_info: DistInfo | None = None, on_event: Event | None = None,
                    on_step: Callable[[int, str], None] | None = None) -> LayoutComparison:
    """Train one model per layout (same initial weights and data order), alternating
    ``config.log_every`` steps of each, ``rounds`` timed rounds after one warm-up interval;
    the first layout is the baseline of the ratios. ``LAYOUT-again`` (e.g. ``nchw-again``)
    is a second copy of a layout also compared: an A/A control. Under torchrun every rank
    runs the same order, so DDP's collectives line up."""
    check_compare(layouts)
    info = dist_info or DistInfo()
    base = replace(config, checkpoint=None, resume=False, max_steps=None)
    trainers = {}
    for layout in layouts:
        if on_event is not None:
            on_event(f"building {layout}")
        trainers[layout] = Trainer(replace(base, layout=layout_of(layout)), info, on_event)
    final: dict[str, tuple[float, float]] = {}

    def interval(layout: str) -> Callable[[], None]:
        def run() -> None:
            final[layout] = trainers[layout].run_steps(config.log_every)
        return run

    c = interleaved({name: interval(name) for name in layouts}, rounds=rounds, warmup=1,
                    baseline=layouts[0], sync=device_sync(str(trainers[layouts[0]].device)),
                    on_step=on_step)
    return LayoutComparison(c, config.log_every * config.batch * info.world_size,
                            config.log_every, final)


__all__ = ["IntervalLog", "LayoutComparison", "TrainConfig", "TrainResult",
           "Trainer", "compare_layouts", "grad_layout_mismatches", "plan_for_training",
           "resume_note", "resumed_config", "settings_of", "train", "unwrap"]
