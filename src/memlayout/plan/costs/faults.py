"""Kernels torch runs wrongly in one format, known from their arguments before they run.

A crash cannot be caught, a hang cannot be timed, and a wrong gradient is not seen by the run
that makes it: a node such a fault applies to is never run in that format, not to measure it,
not in the plan, not in the guard's one-format models, whatever its cost. Each fault names the
bug of torch (or of a library it ships) behind it.

>>> from torch import fx, nn
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.Conv2d(8, 8, 1)))
>>> first, second = [n for n in gm.graph.nodes if n.op == "call_module"]
>>> cpu = torch.device("cpu")
>>> channels_last_fault(gm, first, train=True, device=cpu) is ONEDNN_STRIDED_1X1
True
>>> channels_last_fault(gm, first, train=False, device=cpu), channels_last_fault(gm, second, train=True, device=cpu)
(None, None)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from memlayout.plan.capture.trace import is_convolution
from memlayout.plan.costs.table import CostTable
from memlayout.plan.graph import META_KEY

ONEDNN_STRIDED_1X1 = (
    "oneDNN's channels-last weight gradient of a strided 1x1 convolution with fewer than "
    "16 input channels writes past its workspace on x86 CPUs: the step hangs, crashes the "
    "process or returns wrong gradients")
#: oneDNN's input-channel block: 8 with AVX2, 16 with AVX-512; the fault needs fewer input
#: channels than the block, and 16 covers every x86 CPU whichever kernel it picks
_BLOCK = 16


def channels_last_fault(gm: fx.GraphModule, n: fx.Node, *, train: bool,
                        device: torch.device) -> str | None:
    """Why ``n`` (of ``gm``) must not run channels-last, or ``None``: the faults of torch's
    kernels that its arguments show. Training only: each is in a backward."""
    if not train or device.type != "cpu" or not is_convolution(gm, n):
        return None
    conv = _arguments(gm, n)
    if conv is None:
        return None
    weight, stride, groups, transposed = conv
    if (not transposed and groups == 1 and len(weight) == 4 and weight[1] < _BLOCK
            and all(k == 1 for k in weight[2:]) and any(s > 1 for s in stride)):
        return ONEDNN_STRIDED_1X1
    return None


def _arguments(gm: fx.GraphModule, n: fx.Node
               ) -> tuple[tuple[int, ...], tuple[int, ...], int, bool] | None:
    """A convolution node's weight shape, strides, groups and whether it is transposed: a
    module's (torch.fx), or an op's by its schema's positions (``conv2d``: stride 3, groups 6;
    ``convolution``: stride 3, transposed 6, groups 8); ``None`` where the weight's shape, a
    stride or the groups are not known numbers."""
    if n.op == "call_module":
        sub: Any = gm.get_submodule(str(n.target))
        return (tuple(sub.weight.shape), tuple(sub.stride), int(sub.groups),
                bool(sub.transposed))
    name = getattr(n.target, "__name__", str(n.target))
    w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    meta = w.meta.get(META_KEY) if isinstance(w, fx.Node) else None
    if meta is None or not meta.tensors:
        return None
    full = "convolution" in name
    stride = _at(n, 3, "stride", 1)
    groups = _at(n, 8 if full else 6, "groups", 1)
    transposed = "transpose" in name or bool(full and _at(n, 6, "transposed", False))
    strides = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,)
    if not all(isinstance(v, int) for v in (*strides, groups)):
        return None  # symbolic (a graph with dynamic sizes): not known here
    return tuple(meta.tensors[0].shape), strides, groups, transposed


def _at(n: fx.Node, position: int, name: str, default: Any) -> Any:
    return n.args[position] if len(n.args) > position else n.kwargs.get(name, default)


def fault_notes(tables: Iterable[CostTable]) -> list[str]:
    """The plan's notes on the nodes it keeps contiguous for a fault: one per fault, naming
    them (a few, then how many more)."""
    by_why: dict[str, list[str]] = {}
    for table in tables:
        for name, why in table.faults.items():
            by_why.setdefault(why, []).append(name)
    notes = []
    for why, names in by_why.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        notes.append(f"kept contiguous, never run channels-last: {shown} ({why}); the model "
                     "run channels-last end to end is not a candidate either")
    return notes


def module_faults(model: nn.Module, *, device: torch.device) -> dict[str, str]:
    """The convolution modules of ``model`` that training must not run channels-last, and why:
    what the rule above says of each module's call, read from the module itself (for a model
    run as a whole in one format, as eager channels-last is).

    >>> module_faults(nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.Conv2d(8, 8, 1)),
    ...               device=torch.device("cpu")) == {"0": ONEDNN_STRIDED_1X1}
    True
    """
    if device.type != "cpu":
        return {}
    return {path: ONEDNN_STRIDED_1X1 for path, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and not m.transposed and m.groups == 1
            and m.in_channels < _BLOCK and m.kernel_size == (1, 1) and max(m.stride) > 1}
