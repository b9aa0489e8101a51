"""DistributedDataParallel for planned and channels-last models, without layout warnings.

DDP builds its gradient buckets when it is constructed: each bucket view takes the strides
its parameter has *then*. A parameter converted to channels-last afterwards (or a plan applied
to a wrapped model) gets gradients that no longer match their bucket views ("Grad strides do
not match bucket view strides", or with ``gradient_as_bucket_view`` gradients whose layout is
not the parameter's). :func:`wrap_ddp` therefore takes the model with its layouts already
final (planned, converted, SyncBatchNorm swapped in), checks that every rank holds the same
layouts, and only then constructs DDP, with ``gradient_as_bucket_view=True`` (no copy between
``.grad`` and the bucket).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memlayout.errors import TrainError
from memlayout.layout import is_non_overlapping_and_dense, strides_agree


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a (torchrun) job; one process: rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | torch.device = "cpu") -> DistInfo:
    """Join the torchrun job this process belongs to (``WORLD_SIZE`` > 1 in the environment):
    gloo on CPU, nccl on CUDA. Without torchrun: ``DistInfo()`` (one process), nothing to join.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_available():
        raise TrainError("WORLD_SIZE > 1 but this torch has no torch.distributed")
    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def layout_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, shape, strides) of every parameter: what DDP's buckets are built from."""
    return [(n, tuple(p.shape), tuple(p.stride())) for n, p in unwrap(model).named_parameters()]


def check_layouts_agree(model: nn.Module) -> None:
    """Raise ``TrainError`` unless every rank holds the same parameter layouts (a plan made on
    each rank from its own timings could differ; DDP would then sum gradients of permuted
    elements, or refuse). One process: nothing to check."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = layout_signature(model)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        diff = next((a, b) for a, b in zip(every[0], theirs, strict=False) if a != b) \
            if len(theirs) == len(every[0]) else (len(every[0]), len(theirs))
        raise TrainError(
            f"rank {rank} holds other parameter layouts than rank 0 (first difference: "
            f"rank 0 {diff[0]}, rank {rank} {diff[1]}); plan once and share the plan: run "
            "rank 0's planning first (its costs are cached) or plan with measure=False")


def convert_sync_batchnorm(model: nn.Module, process_group: Any = None) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm`` keeping the plan: the planned graph calls
    its BatchNorm children by name, so swapping the children in place keeps every planned
    format and conversion (BatchNorm parameters are 1-D: they have no layout to lose).
    Works on a plain, channels-last or optimized model; returns the converted model."""
    before = layout_signature(model)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    after = layout_signature(converted)
    assert [s[1:] for s in before] == [s[1:] for s in after], "SyncBatchNorm changed a layout"
    return converted


def wrap_ddp(model: nn.Module, *, device_ids: list[int] | None = None,
             sync_batchnorm: bool = False, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap a model whose layouts are final (planned, ``convert_module``-ed, on its device) in
    DDP so that gradient buckets take the parameters' layouts: SyncBatchNorm first (when
    asked), a check that every parameter is dense and that all ranks agree, then DDP with
    ``gradient_as_bucket_view=True`` unless given. Convert nothing after this call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise TrainError("wrap_ddp needs an initialized process group (torchrun and "
                         "memlayout.train.ddp.init_distributed, or dist.init_process_group)")
    if sync_batchnorm:
        model = convert_sync_batchnorm(model)
    sparse = [n for n, p in model.named_parameters()
              if p.requires_grad and not is_non_overlapping_and_dense(tuple(p.shape), tuple(p.stride()))]
    if sparse:
        raise TrainError(f"parameters {sparse[:5]} are not dense (overlapping or strided); DDP "
                         "buckets need dense parameters: make them contiguous or channels-last")
    check_layouts_agree(model)
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


def grad_layout_mismatches(model: nn.Module) -> list[str]:
    """Parameters whose ``.grad`` is not laid out as the parameter (strides compared on the
    dims of size > 1; the gradient layout contract of autograd and DDP). Empty: all fine."""
    bad = []
    for name, p in unwrap(model).named_parameters():
        g = p.grad
        if g is None or g.shape != p.shape:
            continue
        if not strides_agree(tuple(p.shape), tuple(p.stride()), tuple(g.stride())):
            bad.append(f"{name} (param strides {tuple(p.stride())}, grad {tuple(g.stride())})")
    return bad


def warn_grad_layouts(model: nn.Module) -> None:
    """Warn (once per call) when a gradient's layout is not its parameter's."""
    bad = grad_layout_mismatches(model)
    if bad:
        warnings.warn(f"memlayout: {len(bad)} gradients are not laid out as their parameters "
                      f"(gradient layout contract), e.g. {bad[0]}; was a parameter converted "
                      "after the optimizer or DDP was built?", stacklevel=2)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum ``values`` over ranks (as is with one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    """Wait for every rank (nothing to wait for with one process)."""
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group this run joined."""
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()
