"""The planned model of a training run (L2 train): rank 0 plans alone and hands its planned
model to the other ranks.

Plans made on each rank could differ (a guard decision timed on a busy machine is timed
again, not read from the cost cache), and DDP needs the same parameter layouts on every
rank; so only rank 0 runs the planner, and the others unpickle its model. A model file is
imported under a module name that differs per process (``memlayout.models`` file specs), so
the classes are found under this process's names.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memlayout.errors import TrainError
from memlayout.train.config import TrainConfig
from memlayout.train.ddp import DistInfo


def plan_for_training(module: nn.Module, example: torch.Tensor, *, dtype: str,
                      measure: bool, name: str, weights: str = "converted") -> nn.Module:
    """``memlayout.optimize(module, example, train=True)`` with channels-last input;
    ``weights="contiguous"`` for FSDP (every parameter contiguous)."""
    # The planner (torch.fx, scipy) takes about as long to import as the rest of training:
    # only --layout planned loads it.
    from memlayout.plan.pipeline import optimize

    return optimize(module, example, dtype=dtype, input_format="channels_last",
                    measure=measure, name=name, train=True, weights=weights)


def plan_on_rank0(model: nn.Module, example: torch.Tensor, config: TrainConfig,
                  info: DistInfo) -> tuple[nn.Module, str | None]:
    """The planned model on every rank, on the device of that rank's ``example``, planned by
    rank 0 (a collective under torchrun), and its plan's summary. Rank 0's failure is raised
    there, and named on the other ranks."""
    planned: nn.Module | None = None
    failure: Exception | None = None
    if info.is_main:
        try:
            planned = plan_for_training(
                model, example, dtype=config.dtype, measure=config.plan_measure,
                name=config.model, weights="contiguous" if config.sharded else "converted")
        except Exception as exc:
            failure = exc
    if info.distributed:
        box: list[Any] = [None]
        if info.is_main:
            box[0] = (("failed", str(failure), None) if failure is not None else
                      ("planned", _dumps(planned), _class_modules(model)))
        dist.broadcast_object_list(box, src=0)
        kind, payload, modules = box[0]
        if kind == "failed" and not info.is_main:
            raise TrainError(f"rank 0 could not plan the model: {payload}")
        if not info.is_main:
            planned = _loads(payload, _renames(modules, _class_modules(model)),
                             map_location=example.device)
    if failure is not None:
        raise failure
    assert planned is not None
    plan = getattr(planned, "plan", None)
    return planned, plan.summary() if plan is not None else None


def _dumps(module: nn.Module | None) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()


def _class_modules(model: nn.Module) -> list[str]:
    """The Python module of each submodule's class, in module order."""
    return [type(m).__module__ for m in model.modules()]


def _renames(theirs: list[str], mine: list[str]) -> dict[str, str]:
    """Another process's module names -> this one's, for the same model."""
    return {a: b for a, b in zip(theirs, mine, strict=False) if a != b}


def _loads(data: bytes, renames: dict[str, str], *, map_location: torch.device) -> nn.Module:
    """A module pickled by another rank (:func:`_dumps`), its classes found under this
    process's module names, its tensors on ``map_location`` (this rank's device: rank 0's
    tensors were saved on rank 0's)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return super().find_class(renames.get(module, module), name)

    renaming = types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load,
                                     __name__="pickle")
    return torch.load(io.BytesIO(data), weights_only=False, pickle_module=renaming,
                      map_location=map_location)
