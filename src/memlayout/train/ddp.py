"""DistributedDataParallel for planned and channels-last models, without layout warnings.

DDP builds its gradient buckets when it is constructed: each bucket view takes the strides
its parameter has *then*. A parameter converted to channels-last afterwards (or a plan applied
to a wrapped model) gets gradients that no longer match their bucket views ("Grad strides do
not match bucket view strides", or with ``gradient_as_bucket_view`` gradients whose layout is
not the parameter's). :func:`wrap_ddp` therefore takes the model with its layouts already
final (planned, converted, SyncBatchNorm swapped in), checks that every rank holds the same
layouts, and only then constructs DDP, with ``gradient_as_bucket_view=True`` (no copy between
``.grad`` and the bucket).

A rank that stops answering (crashed, frozen, swapping) must not leave the others waiting
for torch's default (30 minutes on gloo): the process group gets the run's timeout, and
:func:`collectives` turns the backend's error into a ``TrainError`` naming the silent ranks.
NCCL reports a failed collective later than the call, from its watchdog thread: the group
runs with NCCL's asynchronous error handling (a failure aborts the communicators, so the
other ranks' collectives fail too instead of waiting), and the error names the collective
NCCL names (``ALLREDUCE``, its sequence number) and the rank that saw it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memlayout.devices import seam
from memlayout.errors import TrainError, first_line
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


#: Seconds a rank waits for the others in one collective before the run stops with an error.
DEFAULT_TIMEOUT = 300.0
#: Longest wait for the other ranks' answer to the roll call after a failed collective.
ROLL_CALL_SECONDS = 10.0
#: NCCL's switch for asynchronous error handling (``NCCL_ASYNC_ERROR_HANDLING``: its older
#: name); a user's setting of either is kept
NCCL_ASYNC_ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def rank_device(device: str | torch.device, local_rank: int) -> torch.device:
    """Where a rank of a torchrun job computes: on CUDA its local GPU, else ``device``.

    >>> rank_device("cuda", 1), rank_device("cpu", 1)
    (device(type='cuda', index=1), device(type='cpu'))
    """
    device = torch.device(device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def init_distributed(device: str | torch.device = "cpu", *,
                     timeout: float = DEFAULT_TIMEOUT) -> DistInfo:
    """Join the torchrun job this process belongs to (``WORLD_SIZE`` > 1 in the environment):
    gloo on CPU, nccl on CUDA; every collective (and joining itself) gives up after
    ``timeout`` seconds. Without torchrun: ``DistInfo()`` (one process), nothing to join.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_available():
        raise TrainError("WORLD_SIZE > 1 but this torch has no torch.distributed")
    if timeout <= 0:
        raise TrainError(f"--timeout must be > 0 seconds, got {timeout}")
    here = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    # before any collective: NCCL sets up a rank's communicator (and CUDA its context) on the
    # current device, which is cuda:0 on every rank until each makes its own current
    seam(here).make_current()
    if not dist.is_initialized():
        backend = "nccl" if here.type == "cuda" else "gloo"
        if backend == "nccl" and not any(name in os.environ for name in NCCL_ASYNC_ERRORS):
            os.environ[NCCL_ASYNC_ERRORS[0]] = "1"  # read when the process group is made
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError) as exc:
            raise TrainError(
                f"rank {os.environ.get('RANK', '?')} of {world}: not every rank joined the job "
                f"within --timeout {timeout:g} s ({_first_line(exc)}); check the other ranks' "
                "logs (did one fail to start?), or raise --timeout") from exc
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _first_line(exc: BaseException) -> str:
    text = first_line(exc)
    return text if len(text) <= 300 else text[:297] + "..."


# What gloo and nccl say when a peer is gone or silent (their errors are plain RuntimeErrors).
_COMM_FAILURES = ("timed out", "timeout", "connection reset", "connection closed",
                  "connection refused", "pair closure", "broken pipe", "nccl", "gloo")


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _COMM_FAILURES)


#: how NCCL names the work that failed: ``WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...)``
_NCCL_WORK = re.compile(r"SeqNum=(\d+),\s*OpType=(\w+)")
#: and the rank that saw it: ``[Rank 1]``, ``[PG ID 0 PG GUID 0(default_pg) Rank 1]``
_NCCL_RANK = re.compile(r"\[[^\]]*\bRank (\d+)\]")


def nccl_failure(text: str, rank: int) -> str | None:
    """The NCCL collective a backend error names, and the rank that saw it (``rank``, this
    process, unless the text names another); ``None``: not an NCCL error.

    >>> nccl_failure("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL("
    ...              "SeqNum=7, OpType=ALLREDUCE, NumelIn=4, Timeout(ms)=1000) ran for 1004 ms", 1)
    'NCCL collective ALLREDUCE (number 7 of the process group) failed on rank 1'
    >>> nccl_failure("NCCL error: remote process exited or there was a network error", 0)
    'an NCCL collective failed on rank 0'
    >>> nccl_failure("Connection closed by peer", 0) is None
    True
    """
    if "nccl" not in text.lower():
        return None
    named = _NCCL_RANK.search(text)
    where = f"rank {named.group(1) if named else rank}"
    work = _NCCL_WORK.search(text)
    if work is None:
        return f"an NCCL collective failed on {where}"
    return (f"NCCL collective {work.group(2)} (number {work.group(1)} of the process group) "
            f"failed on {where}")


def roll_call(info: DistInfo, seconds: float = ROLL_CALL_SECONDS) -> list[int] | None:
    """After a failed collective: the ranks that do not check in through the job's
    rendezvous store within ``seconds`` (the collective's error does not say who is silent).
    ``None`` when the store cannot be asked."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=seconds))
        store.set(f"memlayout/alive/{info.rank}", "1")
        missing = [r for r in range(info.world_size) if r != info.rank]
        deadline = time.monotonic() + seconds
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"memlayout/alive/{r}"])]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # the store's host may be the silent rank: then we cannot tell
        return None


@contextlib.contextmanager
def collectives(info: DistInfo, timeout: float, doing: str) -> Iterator[None]:
    """Turn a collective's failure (a peer timed out or left) inside the block into a
    ``TrainError`` naming the ranks that stopped answering, ``doing``, the timeout and what
    to do. Other errors, and every error of a one-process run, pass unchanged."""
    try:
        yield
    except Exception as exc:
        if not info.distributed or not _is_comm_failure(exc):
            raise
        silent = roll_call(info, min(timeout, ROLL_CALL_SECONDS))
        nccl = nccl_failure(str(exc), info.rank)
        if nccl is not None:
            raise TrainError(_nccl_message(info, timeout, doing, exc, nccl, silent)) from exc
        who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped "
               "answering" if silent else
               "every rank answers a roll call now, so one was slower than the timeout or "
               "failed the collective" if silent == []
               else "a peer stopped answering (the backend does not say which)")
        raise TrainError(
            f"rank {info.rank} of {info.world_size}: {who} while {doing}; no reply within "
            f"--timeout {timeout:g} s ({_first_line(exc)}). Look at the log and state of "
            f"{'rank ' + ', '.join(map(str, silent)) if silent else 'every rank'} (crashed, "
            "frozen, out of memory?); if it is only slow (planning, writing --synthetic data or "
            "a checkpoint on rank 0), raise --timeout") from exc


def _nccl_message(info: DistInfo, timeout: float, doing: str, exc: BaseException, nccl: str,
                  silent: list[int] | None) -> str:
    """The error for an NCCL failure: the collective and the rank NCCL names, the block it
    surfaced in (NCCL reports failures asynchronously: possibly one after the collective's),
    the ranks that stopped answering the roll call."""
    who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
           "stopped answering" if silent else
           "every rank answers a roll call now" if silent == [] else
           "the roll call could not ask the other ranks")
    look = "rank " + ", ".join(map(str, silent)) if silent else "every rank"
    return (f"rank {info.rank} of {info.world_size}: {nccl}, reported while {doing} (NCCL "
            f"reports failures asynchronously: the collective may be an earlier one); {who} "
            f"({_first_line(exc)}). Look at the log and state of {look} (crashed, frozen, out of "
            f"memory?); if one is only slow, raise --timeout (now {timeout:g} s)")


def batchnorm_notice(model: nn.Module, info: DistInfo, *, device: torch.device,
                     sync_batchnorm: bool) -> str | None:
    """What to tell a user who trains a model with BatchNorm on several ranks without
    SyncBatchNorm: each rank normalizes with its own batch's statistics. ``None``: nothing."""
    if not info.distributed or sync_batchnorm:
        return None
    norms = [n for n, m in unwrap(model).named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]
    if not norms:
        return None
    offer = ("--sync-bn shares the statistics across ranks (SyncBatchNorm)"
             if device.type == "cuda" else
             "SyncBatchNorm would share them, but torch has it for CUDA only (--sync-bn "
             "--device cuda); on CPU, a larger --batch per process brings each rank's "
             "statistics closer to the global batch's")
    return (f"the model has {len(norms)} BatchNorm layers ({', '.join(norms[:3])}"
            f"{', ...' if len(norms) > 3 else ''}): on several ranks each of the {info.world_size} "
            f"ranks normalizes with its own batch's statistics (and keeps its own running "
            "statistics; rank 0's are checkpointed, under FSDP one rank's), so the losses differ from one process "
            f"on the global batch; {offer}")


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


def broadcast_error(info: DistInfo, message: str | None) -> str | None:
    """Rank 0's error message (or ``None``) on every rank, so that all stop together when
    rank 0 cannot go on (one process: ``message`` as is)."""
    if not info.distributed:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def shutdown(info: DistInfo, *, together: bool = True) -> None:
    """Leave the process group this run joined. ``together``: wait for every rank first, so
    that no rank closes its connections while another still has work on them (gloo aborts
    the process then); a run that stops on an error leaves without waiting."""
    if not (info.distributed and dist.is_initialized()):
        return
    try:
        if together:
            barrier(info)
    except RuntimeError as exc:  # a rank already gone: the run's results are out; leave
        if not _is_comm_failure(exc):
            raise
    finally:
        dist.destroy_process_group()
