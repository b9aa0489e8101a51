"""FSDP2 (``fully_shard``) for planned and channels-last models.

``fully_shard`` shards flat, contiguous parameters: it refuses a channels-last weight ("FSDP
does not support non-contiguous parameters yet"). A convolution given a channels-last input
and a contiguous weight still runs channels-last, and its weight gradient comes back
contiguous, so under FSDP the activations keep their planned (or channels-last) layout and
every parameter stays contiguous: ``memlayout.optimize(..., weights="contiguous")``.

Sharding is per block, then the root. A block is a child of an ``nn.Sequential`` or
``nn.ModuleList`` that is not itself one (a torchvision ResNet's ``BasicBlock``), holding
parameters. A planned graph calls the block's leaf modules (its convolutions, norms) one by one
and never the block's own ``forward``, so each block is sharded as the *group* of its modules
that own parameters (``fully_shard([...])``): FSDP gathers the group's parameters before the
first of them runs and frees them after the last, whichever code calls them.

>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(8, 8, 3)))
>>> [name for name, _ in shard_groups(net)]
['0', '2.0']
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memlayout.errors import FSDPError
from memlayout.layout import Format, strides_for

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def fsdp_available() -> str | None:
    """``None`` when this torch has FSDP2's ``fully_shard``, else why not."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError as exc:
        return f"this torch ({torch.__version__}) has no torch.distributed.fsdp.fully_shard ({exc})"
    return None


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def shard_groups(model: nn.Module) -> Iterator[tuple[str, list[nn.Module]]]:
    """``(block name, the block's modules that own parameters)`` for every block of
    ``model``, in module order: children of ``nn.Sequential`` / ``nn.ModuleList`` that are
    not containers themselves (nested containers are searched; a block is not)."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, list[nn.Module]]]:
        container = isinstance(module, _CONTAINERS)
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if container and not isinstance(child, _CONTAINERS):
                owners = [m for m in child.modules() if _owns_parameters(m)]
                if owners:
                    yield path, owners
            else:
                yield from walk(child, f"{path}.")

    yield from walk(model, "")


def not_contiguous(model: nn.Module) -> list[str]:
    """Parameters of ``model`` that ``fully_shard`` would refuse (not contiguous)."""
    return [f"{n} {tuple(p.shape)} strides {tuple(p.stride())}"
            for n, p in model.named_parameters()
            if tuple(p.stride()) != strides_for(tuple(p.shape), Format.CONTIGUOUS)
            and not p.is_contiguous()]


def mixed_precision(dtype: torch.dtype | None, *, cast_inputs: bool = True) -> Any:
    """FSDP's own ``MixedPrecisionPolicy`` for a run in ``dtype`` (``None``: fp32): parameters
    gathered in ``dtype``, gradients reduced in fp32, inputs cast to ``dtype`` unless
    ``cast_inputs`` is off."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype is None or dtype is torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=cast_inputs)


def _is_planned(model: nn.Module) -> bool:
    steering = sys.modules.get("memlayout.plan.steer.steering")  # loaded only once a plan was made
    return steering is not None and steering.planned_state(model) is not None


def wrap_fsdp(model: nn.Module, *, dtype: torch.dtype | None = None,
              reshard_after_forward: bool = True, per_block: bool = False) -> nn.Module:
    """``fully_shard`` each block of ``model`` (its parameter owners as one group, see the
    module docstring), then the root, with :func:`mixed_precision`. The model's layouts must
    be final and every parameter contiguous (plan with ``weights="contiguous"``); returns
    ``model``, sharded in place. Needs an initialized process group.

    ``per_block``: each block sharded as the block module itself, for blocks compiled one
    by one (``memlayout.train.compiling.compile_model(..., per_block=True)``): FSDP's hooks
    then run around the block's compiled forward, and its graph is the whole block (hooks on
    its leaf modules would break it at each of them)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise FSDPError("wrap_fsdp needs an initialized process group (torchrun and "
                        "memlayout.train.ddp.init_distributed, or dist.init_process_group)")
    bad = not_contiguous(model)
    if bad:
        raise FSDPError(
            f"fully_shard takes contiguous parameters only; {len(bad)} are not, e.g. "
            f"{bad[0]}: plan with memlayout.optimize(..., weights='contiguous') and run "
            "activations channels-last on contiguous weights (do not convert_module the model)")
    policy = mixed_precision(dtype)
    for name, owners in shard_groups(model):
        block = model.get_submodule(name) if per_block else None
        fully_shard(block if block is not None else owners if len(owners) > 1 else owners[0],
                    mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # A planned model keys its plans by the inputs' dtype and runs its forward under the
    # autocast it was planned with: its inputs reach it as they come (cast to bf16 first, they
    # would make it plan that "new shape" again, on sharded weights)
    root = mixed_precision(dtype, cast_inputs=not _is_planned(model))
    fully_shard(model, mp_policy=root, reshard_after_forward=reshard_after_forward)
    return model


__all__ = ["fsdp_available", "mixed_precision", "not_contiguous", "shard_groups", "wrap_fsdp"]
