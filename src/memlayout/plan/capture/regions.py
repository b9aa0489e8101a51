"""Capture (L2 plan, step 1): graphs of what really runs, with the layout of every value in
node.meta.

``capture`` takes the model whole (``torch.fx.symbolic_trace`` where that is faithful, else
non-strict ``torch.export``: :mod:`memlayout.plan.capture.trace`) and runs the graph once on the
example inputs (no grad, under autocast when a dtype is given), recording for every node a
:class:`ValueMeta` under ``node.meta["memlayout"]``: shape, strides, dtype and the full set of
formats (``formats_of``) of each tensor in its output; only image-like values keep a layout
label (:mod:`memlayout.spatial`). When the whole model cannot be captured, the largest
capturable submodules are, each with the arguments it received in one eager run (inside
containers too); the parts left eager are listed with the reason, and ``Captured.coverage``
counts the convolution calls planned against those that run.

>>> from torch import nn
>>> cap = capture(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), (torch.randn(2, 3, 8, 8),))
>>> [(r.path, [getattr(n.meta["memlayout"].label, "text", None) for n in r.gm.graph.nodes])
...  for r in cap.regions]
[('', ['contiguous', 'contiguous', None, None])]
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
from memlayout.plan.capture.trace import (
    FX,
    METHOD_KEY,
    ConvolutionCount,
    count_convolutions,
    export_graph,
    faithful_trace,
    flat_inputs,
)
from memlayout.plan.graph import Label
from memlayout.plan.report.result import Coverage
from memlayout.spatial import mark_spatial
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
    coverage: Coverage | None = None  # convolution calls planned of those that run


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
    """Capture ``model`` (whole, or its largest capturable submodules) and record layouts.

    A whole model is taken by ``torch.fx.symbolic_trace`` when that records it faithfully
    (no grad-mode or autocast change inside forward, which fx would drop, and a graph that
    runs on the example and computes what forward does), else by non-strict
    ``torch.export`` (:mod:`memlayout.plan.capture.trace`: control flow, containers, keyword
    arguments and attribute reads run as Python). When neither takes it whole, each
    submodule called once is tried the same way, descending into containers; what stays
    eager is listed in ``uncaptured`` with the reason and counted in ``coverage``.

    ``model`` is not modified (the run is under ``no_grad`` on the given module, so pass a
    copy when its forward mutates state). Raises ``CaptureError`` naming the node when the
    example inputs do not run, or when nothing at all can be captured. ``ranks``: the layout
    ranks planned (default ``planned_ranks(model)``), recorded in every node's meta;
    ``device``: where it runs (default: the inputs').
    """
    ranks = planned_ranks(model) if ranks is None else tuple(ranks)
    device = device_of(inputs, model) if device is None else device
    reasons: list[str] = []
    eager: tuple[Any, int] | None = None  # forward's output and convolution calls, run once
    for gm, reason in graphs(model, inputs, {}):
        if gm is None:
            reasons.append(reason)
            continue
        method = gm.meta.get(METHOD_KEY, FX)
        # the graph against forward itself, with the same random draws (dropout): the count
        # of convolution calls is the eager run's, and a graph that computes something else
        # is not planned
        try:
            with _seeded(device):  # first: a bad input is named at its node
                output = propagate(gm, inputs, dtype=dtype, ranks=ranks, device=device)
        except CaptureError as exc:
            if method != FX:
                raise
            try:
                if eager is None:
                    eager = _counted_run(model, inputs, dtype, device)
            except CaptureError:
                raise exc from None
            # forward runs where fx's graph fails: fx took a branch on a value it could only
            # see as a Proxy (``torch.jit.isinstance(x, torch.Tensor)``, ``type(x) is ...``)
            reasons.append(f"the torch.fx graph fails where forward runs ({_first_line(exc)})")
            continue
        if eager is None:
            eager = _counted_run(model, inputs, dtype, device)
        same, error = _agree(eager[0], output, dtype)
        if same:
            mark_spatial(gm)
            return Captured([Region("", gm, inputs, output)], [], output, ranks,
                            Coverage(count_convolutions(gm), eager[1], (method,)))
        reasons.append(f"the {method} graph computes other values than forward (relative "
                       f"error {error:.3g})")
    reason = "; ".join(reasons)
    calls, output, total = _record_submodule_calls(model, inputs, dtype, device)
    regions: list[Region] = []
    uncaptured: list[tuple[str, str]] = [("", reason)]
    _capture_children(model, "", calls, dtype, ranks, device, regions, uncaptured)
    if not regions:
        raise CaptureError(
            f"no part of {type(model).__name__} could be traced by torch.fx or exported by "
            f"torch.export (whole model: {reason}); nothing to plan. Make the model's forward "
            "traceable (no data-dependent control flow) or pass a traceable submodule"
        )
    planned = sum(count_convolutions(r.gm) for r in regions)
    methods = tuple(sorted({r.gm.meta.get(METHOD_KEY, FX) for r in regions}))
    # what runs eagerly: a path none of whose parts was captured (a parent some of whose
    # children were is not listed: its children are)
    eager = tuple((p, r) for p, r in uncaptured
                  if not any(reg.path.startswith(p + "." if p else "") for reg in regions))
    return Captured(regions, uncaptured, output, ranks, Coverage(planned, total, methods, eager))


def _seeded(device: torch.device) -> Any:
    """A block whose random draws start from one seed, the caller's RNG state kept."""
    devices = [device.index or 0] if device.type == "cuda" else []

    class _Block:
        def __enter__(self) -> None:
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            torch.manual_seed(0)

        def __exit__(self, *exc: object) -> None:
            self.fork.__exit__(*exc)

    return _Block()


def _counted_run(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
                 device: torch.device) -> tuple[Any, int]:
    """Forward's output on the example (seeded as the graph's run) and its convolution calls."""
    with _seeded(device), ConvolutionCount() as count:
        output = _run(model, inputs, dtype, device)
    return output, count.calls


def _run(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
         device: torch.device) -> Any:
    try:
        with torch.no_grad(), autocast(device, dtype):
            return model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    except Exception as exc:
        raise CaptureError(
            f"running {type(model).__name__} on the example inputs failed: "
            f"{type(exc).__name__}: {_first_line(exc)}; check the example input's shape and dtype"
        ) from exc


def _agree(want: Any, got: Any, dtype: torch.dtype | None) -> tuple[bool, float]:
    from memlayout.plan.check.verify import compare  # verify reads this module's names

    ok, error, _ = compare(want, got, dtype)
    return ok, error


def graphs(module: nn.Module, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Iterator[tuple[fx.GraphModule | None, str]]:
    """Graphs of ``module`` called with ``args``/``kwargs``, each made when asked for:
    ``symbolic_trace``'s where it records the forward faithfully (positional inputs, no
    grad-mode or autocast change), then non-strict ``torch.export``'s; ``(None, why)`` for
    one that could not be made. The caller takes the first that runs as forward does."""
    if not kwargs:
        try:
            yield faithful_trace(module), ""
        except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
            yield None, f"torch.fx: {type(exc).__name__}: {_first_line(exc)}"
    try:
        yield export_graph(module, args, kwargs), ""
    except Exception as exc:  # export raises many types (UserError, GuardOnDataDependent...)
        yield None, f"torch.export: {type(exc).__name__}: {_first_line(exc)}"


def propagate(gm: fx.GraphModule, inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
              ranks: tuple[int, ...] = BASE_RANKS, device: torch.device | None = None) -> Any:
    """Run ``gm`` once on copies of ``inputs`` (no grad, autocast for ``dtype``), storing a
    :class:`ValueMeta` (for layout ``ranks``) in every node's meta; returns the output (the
    reference the planned model is verified against)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # an exported graph takes the inputs' leaves (a dict of tensors is several placeholders)
    given = len(gm.graph.process_inputs(*inputs))
    if given > len(placeholders) or given < sum(not n.args for n in placeholders):
        raise CaptureError(
            f"the model's forward takes {len(placeholders)} inputs "
            f"({', '.join(n.target for n in placeholders)}), the example gave {given}; "
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
    """A short readable name of what ``n`` runs: ``Conv2d``, ``torch.flatten``, ``.view``,
    ``aten.conv2d.default``."""
    if n.op == "call_module":
        return type(root.get_submodule(n.target)).__name__
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return str(n.target)  # an exported graph's aten op: aten.permute.default
    if n.op == "call_function":
        mod = getattr(n.target, "__module__", None) or ""
        name = getattr(n.target, "__name__", repr(n.target))
        return f"{mod.replace('_operator', 'operator')}.{name}" if mod else name
    if n.op == "call_method":
        return f".{n.target}"
    return n.op


@dataclass
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    count: int = 1


def _record_submodule_calls(model: nn.Module, inputs: tuple[Any, ...],
                            dtype: torch.dtype | None, device: torch.device
                            ) -> tuple[dict[str, _Call], Any, int]:
    """The arguments each submodule first received and how often it was called, the model's
    output, and the convolution calls of one eager run."""
    calls: dict[str, _Call] = {}
    handles = []

    def keep(a: Any) -> Any:  # a copy: later in-place ops must not change it
        return a.clone() if isinstance(a, torch.Tensor) else copy.copy(a)

    for path, sub in model.named_modules():
        if path:
            def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     path: str = path) -> None:
                if path in calls:
                    calls[path].count += 1
                else:
                    calls[path] = _Call(tuple(keep(a) for a in args),
                                        {k: keep(v) for k, v in kwargs.items()})
            handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), autocast(device, dtype), ConvolutionCount() as count:
            output = model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    except Exception as exc:
        raise CaptureError(
            f"running {type(model).__name__} on the example inputs failed: "
            f"{type(exc).__name__}: {_first_line(exc)}; check the example input's shape and dtype"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return calls, output, count.calls


def _capture_children(module: nn.Module, prefix: str, calls: dict[str, _Call],
                      dtype: torch.dtype | None, ranks: tuple[int, ...], device: torch.device,
                      regions: list[Region], uncaptured: list[tuple[str, str]]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if not _convolutions_under(child, "") and not any(
                len(p.shape) in ranks for p in child.parameters()):
            continue  # nothing layout-sensitive owned below: left as is
        call = calls.get(path)
        if call is None:
            # a container (ModuleList, ModuleDict) is never called itself: its children are
            if _has_children(child):
                _capture_children(child, path, calls, dtype, ranks, device, regions, uncaptured)
            continue
        if call.count > 1:
            # a graph holds the shapes of one call: a module called several times (shared
            # blocks, loops) is planned at its children's level
            reason = f"called {call.count} times per forward"
        else:
            region, reason = _child_region(child, path, call, dtype, ranks, device)
            if region is not None:
                regions.append(region)
                continue
        uncaptured.append((path, reason))
        if _has_children(child):
            _capture_children(child, path, calls, dtype, ranks, device, regions, uncaptured)


def _child_region(child: nn.Module, path: str, call: _Call, dtype: torch.dtype | None,
                  ranks: tuple[int, ...], device: torch.device) -> tuple[Region | None, str]:
    """The region of a submodule called once: the first of its graphs that runs on the
    arguments it received, or ``(None, why none did)``."""
    reasons = []
    for gm, reason in graphs(child, call.args, call.kwargs):
        if gm is None:
            reasons.append(reason)
            continue
        try:
            flat = flat_inputs(gm, call.args, call.kwargs)
            output = propagate(gm, flat, dtype=dtype, ranks=ranks, device=device)
            mark_spatial(gm)
        except Exception as exc:
            reasons.append(f"the {gm.meta.get(METHOD_KEY, FX)} graph: {type(exc).__name__}: "
                           f"{_first_line(exc)}")
        else:
            return Region(path, gm, flat, output), ""
    return None, "; ".join(reasons)


def _convolutions_under(model: nn.Module, path: str) -> int:
    """How many convolution modules ``model``'s submodule ``path`` holds."""
    sub = model.get_submodule(path) if path else model
    return sum(isinstance(m, nn.modules.conv._ConvNd) for m in sub.modules())


def _has_children(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is not None


def iter_nodes(gm: fx.GraphModule, op: str) -> Iterator[fx.Node]:
    return (n for n in gm.graph.nodes if n.op == op)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 4
