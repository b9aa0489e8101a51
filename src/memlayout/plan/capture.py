"""Capture (L2 plan, step 1): a torch.fx graph with the layout of every value in node.meta.

``capture`` traces the model with ``torch.fx.symbolic_trace`` and runs it once on the example
inputs (no grad, under autocast when a dtype is given), recording for every node a
:class:`ValueMeta` under ``node.meta["memlayout"]``: shape, strides, dtype and the full set of
formats (``formats_of``) of each tensor in its output. When the whole model cannot be traced,
the largest traceable submodules are captured instead, each with the inputs it received in
one eager run, and the parts left eager are listed with the reason.

>>> from torch import nn
>>> cap = capture(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), (torch.randn(2, 3, 8, 8),))
>>> [(r.path, [str(n.meta["memlayout"].label) for n in r.gm.graph.nodes]) for r in cap.regions]
[('', ['0', '0', 'None', 'None'])]
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memlayout.dtypes import autocast
from memlayout.errors import CaptureError
from memlayout.layout import Format, formats_of
from memlayout.plan.label import Label
from memlayout.tensors import iter_tensors

# The ranks planned (a value's format is a choice): 4 and 5 always (channels_last(_3d)); 3
# (N L C in memory, channels_last_1d) only for a model with 1-d convolutions, whose NLC input
# makes torch's Conv1d run an NLC kernel (rank-3 values elsewhere, such as a transformer's
# tokens, are not convolution layouts). ``capture`` records them in every node's meta
# (``ValueMeta.ranks``, read back by ``graph_ranks``); every step takes them from there.
BASE_RANKS = (4, 5)
CONV1D_RANKS = (3, 4, 5)
CONV1D_MODULES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.ConvTranspose1d)
META_KEY = "memlayout"
FREE = "free"  # every layout tensor is in both formats (C == 1, H == W == 1): no copy needed
NONE = "none"  # some layout tensor is in neither format (a permute, a slice)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    formats: tuple[str, ...]  # sorted format values; several when ambiguous, none for a slice

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class ValueMeta:
    """One node's output: every tensor inside it and the two-format label of the whole value:
    a ``Label``, ``FREE``, ``NONE``, or ``None`` (no tensor of a
    layout rank); ``ranks``: the layout ranks of the model it was captured in."""

    tensors: tuple[TensorMeta, ...]
    label: Label | str | None
    ranks: tuple[int, ...] = BASE_RANKS

    @property
    def layout_tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(t for t in self.tensors if len(t.shape) in self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.layout_tensors)


@dataclass
class Region:
    """A captured part of the model: its module path ("" for the whole model), the graph with
    meta, and the example inputs it received."""

    path: str
    gm: fx.GraphModule
    inputs: tuple[Any, ...]
    output: Any = None  # what the original computes on ``inputs``


@dataclass
class Captured:
    regions: list[Region]
    uncaptured: list[tuple[str, str]]  # (module path, why it stays eager)
    output: Any = None  # what the whole original model computes on the example inputs
    ranks: tuple[int, ...] = BASE_RANKS  # the layout ranks planned (see planned_ranks)


def planned_ranks(model: nn.Module) -> tuple[int, ...]:
    """The layout ranks to plan for ``model``: 3, 4 and 5 when it has a 1-d convolution,
    else 4 and 5.

    >>> planned_ranks(nn.Sequential(nn.Conv1d(2, 4, 3))), planned_ranks(nn.Linear(2, 2))
    ((3, 4, 5), (4, 5))
    """
    has_1d = any(isinstance(m, CONV1D_MODULES) for m in model.modules())
    return CONV1D_RANKS if has_1d else BASE_RANKS


def graph_ranks(gm: fx.GraphModule) -> tuple[int, ...]:
    """The layout ranks ``gm`` was captured with (from its nodes' meta).

    >>> cap = capture(nn.Sequential(nn.Conv1d(2, 4, 3)), (torch.randn(1, 2, 8),))
    >>> graph_ranks(cap.regions[0].gm)
    (3, 4, 5)
    """
    for n in gm.graph.nodes:
        meta = n.meta.get(META_KEY)
        if meta is not None:
            return meta.ranks
    return BASE_RANKS


def label_of(tensors: tuple[TensorMeta, ...], ranks: tuple[int, ...]) -> Label | str | None:
    """The two-format label of a value made of ``tensors`` (see :class:`ValueMeta`)."""
    layout = [t for t in tensors if len(t.shape) in ranks]
    if not layout:
        return None
    in0 = all(Format.CONTIGUOUS.value in t.formats for t in layout)
    in1 = all(Label.CHANNELS_LAST.format(len(t.shape)).value in t.formats for t in layout)
    if in0 and in1:
        return FREE
    if in0:
        return Label.CONTIGUOUS
    if in1:
        return Label.CHANNELS_LAST
    return NONE


def value_meta(value: Any, ranks: tuple[int, ...]) -> ValueMeta:
    """The layout facts of ``value`` (every tensor in it) for a model planned in ``ranks``."""
    tensors = tuple(
        TensorMeta(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                   tuple(sorted(f.value for f in formats_of(tuple(t.shape), tuple(t.stride())))))
        for t in iter_tensors(value)
    )
    return ValueMeta(tensors, label_of(tensors, ranks), ranks)


def device_of(inputs: tuple[Any, ...], module: nn.Module) -> torch.device:
    for t in iter_tensors(inputs):
        return t.device
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def capture(model: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
            ranks: tuple[int, ...] | None = None,
            device: torch.device | None = None) -> Captured:
    """Trace ``model`` (whole, or its largest traceable submodules) and record layouts.

    ``model`` is not modified (tracing reads it; the run is under ``no_grad`` on the given
    module, so pass a copy when its forward mutates state). Raises ``CaptureError`` naming the
    node when the example inputs do not run, or when nothing at all can be captured. ``ranks``:
    the layout ranks planned (default ``planned_ranks(model)``), recorded in every node's meta;
    ``device``: where it runs (default: the inputs').
    """
    ranks = planned_ranks(model) if ranks is None else tuple(ranks)
    device = device_of(inputs, model) if device is None else device
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
    else:
        output = propagate(gm, inputs, dtype=dtype, ranks=ranks, device=device)
        return Captured([Region("", gm, inputs, output)], [], output, ranks)
    seen, output = _record_submodule_inputs(model, inputs, dtype, device)
    regions: list[Region] = []
    uncaptured: list[tuple[str, str]] = [("", reason)]
    _capture_children(model, "", seen, dtype, ranks, device, regions, uncaptured)
    if not regions:
        raise CaptureError(
            f"no part of {type(model).__name__} could be traced by torch.fx "
            f"(whole model: {reason}); nothing to plan. Make the model's forward traceable "
            "(no data-dependent control flow) or pass a traceable submodule"
        )
    return Captured(regions, uncaptured, output, ranks)


def propagate(gm: fx.GraphModule, inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
              ranks: tuple[int, ...] = BASE_RANKS, device: torch.device | None = None) -> Any:
    """Run ``gm`` once on copies of ``inputs`` (no grad, autocast for ``dtype``), storing a
    :class:`ValueMeta` (for layout ``ranks``) in every node's meta; returns the output (the
    reference the planned model is verified against)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders) or len(inputs) < sum(not n.args for n in placeholders):
        raise CaptureError(
            f"the model's forward takes {len(placeholders)} inputs "
            f"({', '.join(n.target for n in placeholders)}), the example gave {len(inputs)}; "
            "pass example_inputs as one tensor or a tuple of forward's positional arguments"
        )
    copies = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
    device = device_of(inputs, gm) if device is None else device
    with torch.no_grad(), autocast(device, dtype):
        return _MetaProp(gm, ranks).run(*copies)


class _MetaProp(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, ranks: tuple[int, ...]) -> None:
        super().__init__(gm)
        self.ranks = ranks

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(
                f"node {n.name!r} ({node_target_name(self.module, n)}) failed on the example "
                f"inputs: {type(exc).__name__}: {_first_line(exc)}; check the example input's "
                "shape and dtype"
            ) from exc
        n.meta[META_KEY] = value_meta(result, self.ranks)
        return result


def node_target_name(root: nn.Module, n: fx.Node) -> str:
    """A short readable name of what ``n`` runs: ``Conv2d``, ``torch.flatten``, ``.view``."""
    if n.op == "call_module":
        return type(root.get_submodule(n.target)).__name__
    if n.op == "call_function":
        mod = getattr(n.target, "__module__", None) or ""
        name = getattr(n.target, "__name__", repr(n.target))
        return f"{mod.replace('_operator', 'operator')}.{name}" if mod else name
    if n.op == "call_method":
        return f".{n.target}"
    return n.op


def _record_submodule_inputs(model: nn.Module, inputs: tuple[Any, ...],
                             dtype: torch.dtype | None,
                             device: torch.device) -> tuple[dict[str, tuple[Any, ...]], Any]:
    """The inputs each submodule first received, and the model's output, from one run."""
    seen: dict[str, tuple[Any, ...]] = {}
    handles = []
    for path, sub in model.named_modules():
        if path:
            def hook(_mod: nn.Module, args: tuple[Any, ...], path: str = path) -> None:
                if path not in seen:  # a copy: later in-place ops must not change it
                    seen[path] = tuple(a.clone() if isinstance(a, torch.Tensor) else copy.copy(a)
                                       for a in args)
            handles.append(sub.register_forward_pre_hook(hook))
    try:
        with torch.no_grad(), autocast(device, dtype):
            output = model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    except Exception as exc:
        raise CaptureError(
            f"running {type(model).__name__} on the example inputs failed: "
            f"{type(exc).__name__}: {_first_line(exc)}; check the example input's shape and dtype"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return seen, output


def _capture_children(module: nn.Module, prefix: str, seen: dict[str, tuple[Any, ...]],
                      dtype: torch.dtype | None, ranks: tuple[int, ...], device: torch.device,
                      regions: list[Region], uncaptured: list[tuple[str, str]]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if path not in seen:
            continue  # not called by forward: nothing runs, nothing to plan
        if not any(len(p.shape) in ranks for p in child.parameters()) and not _has_children(child):
            continue  # a leaf without layout parameters (activation, flatten): left as is
        try:
            gm = fx.symbolic_trace(child)
            output = propagate(gm, seen[path], dtype=dtype, ranks=ranks, device=device)
        except Exception as exc:
            if _has_children(child):
                uncaptured.append((path, f"{type(exc).__name__}: {_first_line(exc)}"))
                _capture_children(child, path, seen, dtype, ranks, device, regions, uncaptured)
            else:
                uncaptured.append((path, f"{type(exc).__name__}: {_first_line(exc)}"))
            continue
        regions.append(Region(path, gm, seen[path], output))


def _has_children(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is not None


def iter_nodes(gm: fx.GraphModule, op: str) -> Iterator[fx.Node]:
    return (n for n in gm.graph.nodes if n.op == op)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 4
