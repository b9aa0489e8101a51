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

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import CaptureError
from memlayout.plan.capture.calls import (
    RUN_KEY,
    EagerRun,
    ModuleCall,
    first_line,
    record_calls,
    run_facts,
    versions_of,
)
from memlayout.plan.capture.reads import LayoutRead, in_scope
from memlayout.plan.capture.trace import (
    EXPORT,
    FX,
    METHOD_KEY,
    count_convolutions,
    export_graph,
    faithful_trace,
    flat_inputs,
    throwaway,
)
from memlayout.plan.graph import (
    BASE_RANKS,
    KEEP_KEY,
    META_KEY,
    node_target_name,
    planned_ranks,
    value_meta,
)
from memlayout.plan.report.records import Coverage
from memlayout.spatial import mark_spatial
from memlayout.tensors import clone_inputs, device_of

log = logging.getLogger(__name__)

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
    calls: dict[str, ModuleCall] = field(default_factory=dict)  # every module call, by path
    reads: tuple[LayoutRead, ...] = ()  # the model's own layout reads (capture.reads)


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
    eager: EagerRun | None = None  # forward's output, convolution and module calls, run once
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
                    eager = _eager(model, inputs, dtype, device)
            except CaptureError:
                raise exc from None
            # forward runs where fx's graph fails: fx took a branch on a value it could only
            # see as a Proxy (``torch.jit.isinstance(x, torch.Tensor)``, ``type(x) is ...``)
            reasons.append(f"the torch.fx graph fails where forward runs ({first_line(exc)})")
            continue
        if eager is None:
            eager = _eager(model, inputs, dtype, device)
        same, error = _agree(eager.output, output, dtype)
        if same:
            mark_spatial(gm)
            whole = [Region("", gm, inputs, output)]
            keep_where_read(whole, eager.reads)
            return Captured(whole, [], output, ranks,
                            Coverage(count_convolutions(gm), eager.convolutions, (method,)),
                            eager.calls, eager.reads)
        reasons.append(f"the {method} graph computes other values than forward (relative "
                       f"error {error:.3g})")
    reason = join_reasons(reasons)
    with _seeded(device):
        run = record_calls(model, inputs, dtype=dtype, device=device, keep_arguments=True)
    regions: list[Region] = []
    uncaptured: list[tuple[str, str]] = [("", reason)]
    _capture_children(model, "", run, dtype, ranks, device, regions, uncaptured)
    if not regions:
        raise CaptureError(
            f"no part of {type(model).__name__} could be traced by torch.fx or exported by "
            f"torch.export (whole model: {short_reason(reason)}); nothing to plan. Make the model's forward "
            "traceable (no data-dependent control flow) or pass a traceable submodule"
        )
    planned = sum(count_convolutions(r.gm) for r in regions)
    methods = tuple(sorted({r.gm.meta.get(METHOD_KEY, FX) for r in regions}))
    # what runs eagerly: a path none of whose parts was captured (a parent some of whose
    # children were is not listed: its children are)
    eager = tuple((p, r) for p, r in uncaptured
                  if not any(reg.path.startswith(p + "." if p else "") for reg in regions))
    keep_where_read(regions, run.reads)
    return Captured(regions, uncaptured, run.output, ranks,
                    Coverage(planned, run.convolutions, methods, eager), run.calls, run.reads)


def keep_where_read(regions: list[Region], reads: tuple[LayoutRead, ...]) -> None:
    """Mark (``node.meta[KEEP_KEY]``) every node whose value a layout-reading module sees:
    the nodes of its own code and those that feed it, so the plan keeps each in the format
    the original gives it (:func:`memlayout.plan.solve.formulate.node_terms` pins them)."""
    modules = {r.module for r in reads}
    for region in regions:
        inside = [n for n in region.gm.graph.nodes
                  if any(in_scope(m, p) for m in modules for p in _paths(region, n))]
        for n in inside:
            n.meta[KEEP_KEY] = True
            for arg in n.all_input_nodes:
                arg.meta[KEEP_KEY] = True


def _paths(region: Region, n: fx.Node) -> list[str]:
    """The modules whose code ``n`` runs in (outermost first), as paths in the whole model."""
    stack = n.meta.get("nn_module_stack") or {}
    inner = [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]
    return [region.path] + [f"{region.path}.{p}" if region.path else p for p in inner]


@contextlib.contextmanager
def _seeded(device: torch.device) -> Iterator[None]:
    """A block whose random draws start from one seed, the caller's RNG state kept."""
    with seam(device).fork_rng():
        torch.manual_seed(0)
        yield


def _eager(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
           device: torch.device) -> EagerRun:
    """Forward on the example, seeded as the graph's run: its output, convolution calls and
    module calls."""
    with _seeded(device):
        return record_calls(model, inputs, dtype=dtype, device=device)


def _agree(want: Any, got: Any, dtype: torch.dtype | None) -> tuple[bool, float]:
    from memlayout.plan.compare import compare

    ok, error, _ = compare(want, got, dtype)
    return ok, error


def graphs(module: nn.Module, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Iterator[tuple[fx.GraphModule | None, str]]:
    """Graphs of ``module`` called with ``args``/``kwargs``, each made when asked for:
    ``symbolic_trace``'s where it records the forward faithfully (positional inputs, no
    grad-mode or autocast change), then non-strict ``torch.export``'s; ``(None, why)`` for
    one that could not be made. The caller takes the first that runs as forward does.
    Each traces a :func:`~memlayout.plan.capture.trace.throwaway` copy: ``module`` itself is
    left as it was, to run eagerly."""
    if not kwargs:
        try:
            yield faithful_trace(throwaway(module)), ""
        except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
            yield None, _failed(module, FX, exc)
    try:
        yield export_graph(throwaway(module), args, kwargs), ""
    except Exception as exc:  # export raises many types (UserError, GuardOnDataDependent...)
        yield None, _failed(module, EXPORT, exc)


def _failed(module: nn.Module, how: str, exc: BaseException) -> str:
    """Why ``how`` could not capture ``module``: torch's whole text to the debug log, the
    :func:`reason_text` (whose first line is what a terminal shows) to the caller."""
    log.debug("%s not captured by %s: %s: %s", type(module).__name__, how,
              type(exc).__name__, str(exc).strip())
    return reason_text([(how, exc)])


def propagate(gm: fx.GraphModule, inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
              ranks: tuple[int, ...] = BASE_RANKS, device: torch.device | None = None,
              facts: bool = True) -> Any:
    """Run ``gm`` once on copies of ``inputs`` (no grad, autocast for ``dtype``), storing a
    :class:`ValueMeta` (for layout ``ranks``) in every node's meta and, with ``facts``, its
    ``calls.RunFacts`` (what finds a graph value among a module call's: a digest of every
    tensor, so only a plan steered by module calls needs them); returns the output (the
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
    copies = clone_inputs(inputs)
    device = device_of(inputs, gm) if device is None else device
    with torch.no_grad(), autocast(device, dtype):
        return _MetaProp(gm, ranks, facts).run(*copies)


class _MetaProp(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, ranks: tuple[int, ...], facts: bool) -> None:
        super().__init__(gm)
        self.ranks = ranks
        self.facts = facts

    def run_node(self, n: fx.Node) -> Any:
        inputs = {m.name: self.env[m] for m in n.all_input_nodes if m in self.env}
        versions = {name: versions_of(v) for name, v in inputs.items()} if self.facts else {}
        try:
            result = super().run_node(n)
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(
                f"node {n.name!r} ({node_target_name(self.module, n)}) failed on the example "
                f"inputs: {type(exc).__name__}: {first_line(exc)}; check the example input's "
                "shape and dtype"
            ) from exc
        n.meta[META_KEY] = value_meta(result, self.ranks)
        if self.facts:
            n.meta[RUN_KEY] = run_facts(result, inputs, versions)
        return result




def _capture_children(module: nn.Module, prefix: str, run: EagerRun,
                      dtype: torch.dtype | None, ranks: tuple[int, ...], device: torch.device,
                      regions: list[Region], uncaptured: list[tuple[str, str]]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if not _convolutions_under(child, "") and not any(
                len(p.shape) in ranks for p in child.parameters()):
            continue  # nothing layout-sensitive owned below: left as is
        call = run.calls.get(path)
        if call is None:
            # a container (ModuleList, ModuleDict) is never called itself: its children are
            if _has_children(child):
                _capture_children(child, path, run, dtype, ranks, device, regions, uncaptured)
            continue
        if call.count > 1:
            # a graph holds the shapes of one call: a module called several times (shared
            # blocks, loops) is planned at its children's level
            reason = f"called {call.count} times per forward"
        else:
            args, kwargs = run.arguments[path]
            region, reason = _child_region(child, path, args, kwargs, dtype, ranks, device)
            if region is not None:
                regions.append(region)
                continue
        uncaptured.append((path, reason))
        if _has_children(child):
            _capture_children(child, path, run, dtype, ranks, device, regions, uncaptured)


def _child_region(child: nn.Module, path: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dtype: torch.dtype | None,
                  ranks: tuple[int, ...], device: torch.device) -> tuple[Region | None, str]:
    """The region of a submodule called once: the first of its graphs that runs on the
    arguments it received, or ``(None, why none did)``."""
    reasons = []
    for gm, reason in graphs(child, args, kwargs):
        if gm is None:
            reasons.append(reason)
            continue
        try:
            flat = flat_inputs(gm, args, kwargs)
            output = propagate(gm, flat, dtype=dtype, ranks=ranks, device=device)
            mark_spatial(gm)
        except Exception as exc:
            reasons.append(_failed(child, f"the {gm.meta.get(METHOD_KEY, FX)} graph", exc))
        else:
            return Region(path, gm, flat, output), ""
    return None, join_reasons(reasons)


def _convolutions_under(model: nn.Module, path: str) -> int:
    """How many convolution modules ``model``'s submodule ``path`` holds."""
    sub = model.get_submodule(path) if path else model
    return sum(isinstance(m, nn.modules.conv._ConvNd) for m in sub.modules())


def _has_children(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is not None


def model_signature(captured: Captured) -> str:
    """A hash of what a plan depends on in a captured model: per region every node's name,
    op and target, the shapes and dtypes of its value, and every parameter's and buffer's name,
    shape and dtype. Strides are left out: the same model given inputs in another format is
    the same model."""
    h = hashlib.sha256()
    for region in captured.regions:
        gm = region.gm
        h.update(f"region {region.path!r}\n".encode())
        for n in gm.graph.nodes:
            meta = n.meta.get(META_KEY)
            values = [] if meta is None else [(t.shape, t.dtype) for t in meta.tensors]
            h.update(repr((n.name, n.op, node_target_name(gm, n), values)).encode())
        for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
            h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
    return h.hexdigest()


# -- why a part stays eager: one short line first, torch's whole text after it -------------
#: characters of torch's message kept in a reason's first line
SHORT = 100


def reason_text(failures: list[tuple[str, BaseException]]) -> str:
    """Why capture methods failed, as one text: its first line short (each method's exception
    type and the first sentence of its message), torch's whole messages on the lines after
    it (kept in the plan's JSON; a terminal shows the first line, the debug log all).

    >>> print(reason_text([("torch.fx", TypeError("no. Details follow\\nline two"))]))
    torch.fx: TypeError: no.
    torch.fx: TypeError: no. Details follow
    line two
    """
    short = "; ".join(f"{how}: {type(exc).__name__}: {_first_sentence(exc)}"
                      for how, exc in failures)
    whole = "\n".join(f"{how}: {type(exc).__name__}: {str(exc).strip() or type(exc).__name__}"
                      for how, exc in failures)
    return short if whole == short else f"{short}\n{whole}"


def join_reasons(reasons: list[str]) -> str:
    """Several :func:`reason_text` as one: the first lines joined, then the rest of each."""
    heads = "; ".join(short_reason(r) for r in reasons)
    if not any("\n" in r for r in reasons):
        return heads
    return "\n".join([heads, *(r.partition("\n")[2] or r for r in reasons)])


def short_reason(reason: str) -> str:
    """The first line of a reason (:func:`reason_text`): what a terminal shows."""
    return reason.partition("\n")[0]


def _first_sentence(exc: BaseException) -> str:
    line = first_line(exc)
    end = line.find(". ")
    if 0 < end < SHORT:
        return line[:end + 1]
    return line if len(line) <= SHORT else line[:SHORT].rsplit(" ", 1)[0] + " ..."
